"""`python -m vlm.train ...` is `vlm train ...` (handy under launchers: `torchrun --nproc_per_node 2 -m vlm.train`)."""

from __future__ import annotations

import sys

from vlm.cli import main as vlm_main


def main(argv: list[str] | None = None) -> int:
    return vlm_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
