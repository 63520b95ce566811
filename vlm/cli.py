"""`vlm` command line. Each package registers its subcommands (train, chain, data, flops, convert, chat, demo,
eval, experiment) under the `vlm.commands` entry-point group in pyproject.toml, so this module imports none of them."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from configs.config import ConfigError, parse_args_anywhere

COMMANDS = "vlm.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm", description="ConceptMoE vision-language training system")
    sub = parser.add_subparsers(dest="command", required=True)
    found = entry_points(group=COMMANDS)
    if not found:
        raise SystemExit("vlm: no subcommands registered; install the package (`pip install -e .`)")
    for ep in found:
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if not sys.stderr.isatty():   # a redirected log gets no carriage-return progress bars from transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    parser = build_parser()
    args = parse_args_anywhere(parser, argv)
    try:
        rc = args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
