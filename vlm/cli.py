"""`vlm` command line. Each package registers its subcommands (train, chain, data, flops, convert,
chat, demo, eval, experiment, scaling, bench) under the `vlm.commands` entry-point group in
pyproject.toml, so this module imports none of them. A registration function only builds argparse;
torch, transformers and the model are imported inside the command that runs, so `vlm --help` and
`vlm data ...` start in well under a second (`tests/test_cli.py` checks what they import)."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from configs.config import ConfigError, parse_args_anywhere
from configs.folder_lock import FolderBusy

COMMANDS = "vlm.commands"


class _RemovedSet(argparse.Action):
    """`--set KEY=VALUE` (the old override syntax of chain, flops and eval longctx): one line, exit 2."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(
            2, f"{parser.prog}: --set was removed; write overrides as KEY=VALUE after the config\n"
        )


def refuse_set_option(parser: argparse.ArgumentParser) -> None:
    """Give `parser` a hidden `--set` that fails with a one-line pointer to `key=value` overrides."""
    parser.add_argument("--set", nargs="?", action=_RemovedSet, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm", description="ConceptMoE vision-language training system"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    found = entry_points(group=COMMANDS)
    if not found:
        raise SystemExit("vlm: no subcommands registered; install the package (`pip install -e .`)")
    for ep in found:
        ep.load()(sub)
    return parser


def quiet_progress_bars() -> None:
    """A redirected log gets no carriage-return progress bars from transformers or the hub. Set
    through the environment (read when huggingface_hub is first imported), so the CLI does not
    import transformers to say it; a command that already imported it is switched directly."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    quiet_progress_bars()
    parser = build_parser()
    args = parse_args_anywhere(parser, argv)
    try:
        rc = args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except FolderBusy as e:  # a second writer into a folder another process is writing
        print(f"vlm {args.command}: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
