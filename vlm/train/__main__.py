"""`python -m vlm.train ...` is `vlm train ...` (handy under launchers: `torchrun --nproc_per_node 2 -m vlm.train`)."""
from __future__ import annotations

import argparse
import sys

from configs.config import ConfigError, parse_args_anywhere
from vlm.train.cli import add_train_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlm")
    add_train_command(parser.add_subparsers(dest="command", required=True))
    args = parse_args_anywhere(parser, ["train", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
