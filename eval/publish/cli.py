"""`vlm results`: render every table of measured figures in README.md and docs/ from
the committed JSON.

    vlm results            rewrite the tables between <!-- results:NAME --> markers (prose
    untouched)
    vlm results --check    exit 1, with a diff, where a table differs from its JSON (writes nothing)
    vlm results --rerun launches   re-count operators per training step first (seconds), then render

The JSON: eval/bench/results/ (`vlm bench ... --out eval/bench/results`),
docs/results/data/default_run/ (a run's summary.json and vqa.json), docs/results/data/launches.json,
and docs/results/data/recorded/ (figures of runs whose outputs were not kept, each file with its
provenance). Training runs and the full bench take minutes to hours on a 2-core CPU, so they are
never re-run here: run them, copy their JSON in, then `vlm results`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RERUN = ("launches",)


def add_results_command(subparsers) -> None:
    ap = subparsers.add_parser(
        "results",
        help="render the docs' tables of measured figures from their JSON",
        description=__doc__.split("\n")[0],
    )
    ap.add_argument(
        "--check", action="store_true", help="only compare: exit 1 where a table differs"
    )
    ap.add_argument(
        "--rerun",
        action="append",
        default=[],
        choices=RERUN,
        help="re-run a cheap producer first (launches: operators per training step, seconds)",
    )
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from eval.publish import registry

    root = Path(args.root)
    if args.check and args.rerun:
        print("vlm results: --check compares only; drop --rerun", file=sys.stderr)
        return 2
    if "launches" in args.rerun:
        from eval.publish import bench, launches

        res = launches.run(root, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        (root / bench.LAUNCHES).write_text(json.dumps(res, indent=1) + "\n")
    if args.check:
        problems = registry.check(root)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print(
                f"vlm results --check: {len(problems)} table(s) "
                "differ from their JSON; run `make results`",
                file=sys.stderr,
            )
            return 1
        print(f"vlm results --check: {len(registry.TABLES)} tables agree with their JSON")
        return 0
    changed = registry.write(root)
    print(
        f"vlm results: {len(registry.TABLES)} tables rendered; "
        + (f"rewrote {', '.join(changed)}" if changed else "every document already up to date")
    )
    return 0
