"""`vlm` command line: train, chain, data, flops, convert, eval, experiment. Each part registers its own subcommands."""
from __future__ import annotations

import argparse
import sys

from configs.config import ConfigError, parse_args_anywhere


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm", description="ConceptMoE vision-language training system")
    sub = parser.add_subparsers(dest="command", required=True)
    from vlm.train.chain import add_chain_command
    from vlm.train.cli import add_train_command
    from data_pipelines.cli import add_data_commands
    from vlm.flops_cli import add_flops_command
    from vlm.convert_cli import add_convert_command
    from eval.cli import add_eval_commands
    from eval.experiments import add_experiment_command

    for add in (add_train_command, add_chain_command, add_data_commands, add_flops_command, add_convert_command, add_eval_commands,
                add_experiment_command):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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
