"""`vlm eval ...` commands. `vlm.cli` calls `add_eval_commands(subparsers)`; each command sets
`func`. Their arguments are all declared here; a command's module (and the model, torch,
transformers) loads when it runs.

    vlm eval longctx --ckpt RUN/final [--baseline-ckpt BASE/final] --lengths 1024 4096 \
        --depths 0 50 100 --tasks niah_single_essay vt --out OUT

writes OUT/model/{summary.json, samples.jsonl, heatmap*.png} (and OUT/baseline/..., plus
OUT/comparison*.png and OUT/comparison.json when a baseline is given) and OUT/compression.png.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
from pathlib import Path
from typing import Callable

from configs.config import ConfigError, apply_overrides, from_dict, load_yaml, to_dict
from eval.longctx.config import LongCtxConfig
from eval.longctx.tasks import TASKS
from eval.preflight import check_model_dir, check_out_dir, fail, positive_int
from vlm.cli import refuse_set_option

# a write that fails for lack of room after the work: the user's to fix, not a traceback. Only
# errors no read raises: a denied write to --out is found before the work (check_out_*)
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _later(module: str, name: str = "run") -> Callable[[argparse.Namespace], int]:
    """`module.name(args)`, imported when the command runs: registering `vlm eval` imports no
    model (nor torch). `--out` is checked before the work; a write that still fails at the end (the
    disk filled meanwhile) is one line naming the file."""

    def run(args: argparse.Namespace) -> int:
        try:
            return getattr(importlib.import_module(module), name)(args)
        except OSError as e:
            if e.errno not in WRITE_ERRNOS:
                raise
            fail(
                f"vlm eval {args.eval_command}",
                f"writing {e.filename or 'the results'} failed ({e.strerror}); the results were "
                "computed but not all written: free the space or give another --out, and run again",
            )

    return run


def add_eval_commands(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Register `eval` with `longctx`, `lmms-tasks`, `vqa`, `probe`, `ppl` and `ct-start`; returns
    the `eval` sub-command set. Every `vlm eval` command's arguments are declared here; its module
    runs it."""
    ev = subparsers.add_parser(
        "eval",
        help="evaluation: long-context sweep, lmms-eval task export, VQA, "
        "caption probes, perplexity, the loss continual training starts from",
    )
    sub = ev.add_subparsers(
        dest="eval_command", metavar="{longctx,lmms-tasks,vqa,probe,ppl,ct-start}"
    )
    sub.required = True
    lc = sub.add_parser(
        "longctx",
        help="RULER-style synthetic long-context sweep (lengths x depths)",
        description="Offline RULER-style sweep; scores per task x "
        "length x depth, heat maps, realized compression per length.",
    )
    lc.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint directory (loaded with vlm.generate.load_eval_model)",
    )
    lc.add_argument(
        "--baseline-ckpt", help="second checkpoint (e.g. the MoE baseline) for a side-by-side plot"
    )
    lc.add_argument(
        "--lengths", type=int, nargs="+", help="target prompt lengths in the model's tokens"
    )
    lc.add_argument("--depths", type=float, nargs="+", help="needle depths in percent")
    lc.add_argument(
        "--tasks", nargs="+", help=f"tasks (default: RULER-like set); allowed: {', '.join(TASKS)}"
    )
    lc.add_argument("--num-samples", type=int, help="samples per task x length x depth")
    lc.add_argument(
        "--mode", choices=["generate", "loglik", "both"], help="scoring mode (default both)"
    )
    lc.add_argument("--batch-size", type=positive_int)
    lc.add_argument("--num-distractors", type=int)
    lc.add_argument("--max-new-tokens", type=int)
    lc.add_argument("--seed", type=int)
    lc.add_argument(
        "--config", help="YAML with LongCtxConfig fields (overrides and flags win over it)"
    )
    lc.add_argument("--out", required=True, help="output directory")
    lc.add_argument("--no-progress", action="store_true")
    lc.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="LongCtxConfig field overrides, e.g. num_samples=2 haystack=essay",
    )
    refuse_set_option(lc)
    lc.set_defaults(func=run_longctx_command)

    ex = sub.add_parser(
        "lmms-tasks",
        help="export a dataset split + task YAMLs for lmms-eval (--include_path)",
        description="Export a split of the default dataset (or any VQA/caption "
        "shards) for lmms-eval's local JSON tasks: TASK_DIR/{vqa,caption}_test.jsonl "
        "and the task YAMLs, to pass as lmms-eval --include_path TASK_DIR.",
    )
    ex.add_argument("--data", help="dataset directory from `vlm data build-default`")
    ex.add_argument("--split", default="test")
    ex.add_argument(
        "--vqa-shards", help="VQA shards (dir, glob or brace pattern) instead of --data"
    )
    ex.add_argument("--caption-shards", help="caption shards instead of --data")
    ex.add_argument(
        "--limit", type=positive_int, help="at most this many records per task (N >= 1)"
    )
    ex.add_argument(
        "--out", required=True, help="task directory to pass to lmms-eval --include_path"
    )
    ex.set_defaults(func=_later("eval.export_tasks"))

    p = sub.add_parser(
        "vqa", help="exact-match VQA accuracy on the default dataset's held-out split"
    )
    p.add_argument("--ckpt", required=True, help="exported model directory (RUN_DIR/final)")
    p.add_argument(
        "--data",
        default=None,
        help="default dataset directory (default: data/default, built there if missing), or a "
        "folder of imported VQA shards (their meta.qa questions are scored)",
    )
    p.add_argument(
        "--build",
        action="store_true",
        help="build the default dataset at --data when it is not there (without it a --data "
        "that does not exist is refused: a typo does not build 58 MB)",
    )
    p.add_argument("--split", default="test", choices=["test", "val"])
    # --limit 0 is refused, not read as "no limit" or "none": leave the flag out to score
    # every question
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="score the first N questions (default: all)",
    )
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--no-blind", action="store_true", help="skip the blind (no image) baseline")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=_later("eval.vqa"))

    p = sub.add_parser(
        "probe", help="caption probes: an object's cell, and two objects' relation, teacher-forced"
    )
    p.add_argument("--ckpt", required=True, help="exported model directory (RUN_DIR/final)")
    p.add_argument(
        "--data",
        default=None,
        help="default dataset directory (default: data/default, built there if missing)",
    )
    p.add_argument(
        "--build",
        action="store_true",
        help="build the default dataset at --data when it is not there (without it a --data "
        "that does not exist is refused: a typo does not build 58 MB)",
    )
    p.add_argument("--split", default="val", choices=["train", "val", "test"])
    p.add_argument("--limit", type=positive_int, default=300, help="items per probe")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=_later("eval.caption_probe"))

    p = sub.add_parser(
        "ppl",
        help="held-out LM loss and bits per byte per kind of sample",
        description="Held-out LM loss and bits per byte of an exported model, per "
        "kind of sample (without --data: the default dataset's validation split).",
    )
    p.add_argument("--ckpt", required=True, help="exported model directory (RUN_DIR/final)")
    p.add_argument(
        "--data",
        nargs="+",
        help="shards (dirs, globs, files); default: the default dataset's val split",
    )
    p.add_argument(
        "--default-dir",
        default=None,
        help="the default dataset (default: data/default, built there if missing)",
    )
    p.add_argument(
        "--build",
        action="store_true",
        help="build the default dataset at --default-dir when it is not there",
    )
    p.add_argument("--max-batches", type=positive_int)
    p.add_argument("--row-tokens", type=positive_int, default=512)
    p.add_argument("--out", help="write the result as JSON here")
    p.set_defaults(func=_later("eval.perplexity"))

    p = sub.add_parser(
        "ct-start",
        help="the loss a MoE -> ConceptMoE conversion starts continual training from",
        description="LM loss on validation batches of the source MoE and of its ConceptMoE "
        "conversion with real boundaries (every document start plus random tokens at rate "
        "1/R), the conversion with a zero residual, and with every boundary on.",
    )
    p.add_argument(
        "src",
        help="an exported MoE baseline (RUN_DIR/final with chunking off) or a transformers MoE",
    )
    p.add_argument("--ratio", type=float, default=1.5, help="boundary rate 1/R (default 1.5)")
    p.add_argument(
        "--batches", type=positive_int, default=8, help="validation batches scored (default 8)"
    )
    p.add_argument(
        "--data",
        default=None,
        help="default dataset folder (its val split is scored; default: data/default, built "
        "there if missing)",
    )
    p.add_argument(
        "--build",
        action="store_true",
        help="build the default dataset at --data when it is not there (without it a --data "
        "that does not exist is refused: a typo does not build 58 MB)",
    )

    p.set_defaults(func=_later("eval.ct_start"))
    return sub


_FLAG_FIELDS = {
    "lengths": "lengths",
    "depths": "depths",
    "tasks": "tasks",
    "num_samples": "num_samples",
    "mode": "mode",
    "batch_size": "batch_size",
    "num_distractors": "num_distractors",
    "max_new_tokens": "max_new_tokens",
    "seed": "seed",
}


def longctx_config_from_args(args: argparse.Namespace) -> LongCtxConfig:
    data = load_yaml(args.config) if getattr(args, "config", None) else {}
    apply_overrides(data, list(getattr(args, "overrides", []) or []))
    for flag, field in _FLAG_FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None:
            data[field] = value
    return from_dict(LongCtxConfig, data)


def _default_loader() -> Callable:
    try:
        from vlm.generate import load_eval_model
    except ImportError as e:
        raise SystemExit(
            f"vlm eval longctx: cannot import vlm.generate.load_eval_model ({e})"
        ) from None
    return load_eval_model


def run_longctx_command(args: argparse.Namespace) -> int:
    run_longctx(args)
    return 0


def run_longctx(args: argparse.Namespace, loader: Callable | None = None) -> dict:
    """The `eval longctx` command; returns {label: summary}. `loader(ckpt_dir)` defaults to the model's."""
    from eval.longctx.plot import available_keys, plot_comparison, plot_compression, plot_heatmaps
    from eval.longctx.sweep import run_sweep, write_summary

    try:
        cfg = longctx_config_from_args(args)  # validated as it is built
    except ConfigError as e:
        raise SystemExit(f"vlm eval longctx: {e}") from None
    load = loader or _default_loader()
    runs = [("model", args.ckpt)] + (
        [("baseline", args.baseline_ckpt)] if args.baseline_ckpt else []
    )
    for _, ckpt in runs:  # both checkpoints and --out before the first sweep
        if not Path(ckpt).exists():
            raise SystemExit(f"vlm eval longctx: checkpoint directory {ckpt} does not exist")
        # the real loader: an exported model folder
        if getattr(load, "__module__", None) == "vlm.generate":
            check_model_dir(ckpt, "vlm eval longctx")
    out = check_out_dir(args.out, "vlm eval longctx")
    summaries = {}
    for label, ckpt in runs:
        try:
            model = load(ckpt)
        except FileNotFoundError as e:  # a folder without the model's files
            raise SystemExit(f"vlm eval longctx: {e}") from None
        records: list[dict] = []
        summary = run_sweep(model, cfg, label=label, progress=not args.no_progress, records=records)
        summary["ckpt"] = str(ckpt)
        write_summary(summary, out / label, records)
        for key in available_keys(summary):
            plot_heatmaps(summary, out / label / _plot_name("heatmap", key), key)
        summaries[label] = summary
        del model
        _print_table(summary)
    plot_compression(list(summaries.values()), out / "compression.png")
    if "baseline" in summaries:
        a, b = summaries["model"], summaries["baseline"]
        for key in available_keys(a):
            plot_comparison(a, b, out / _plot_name("comparison", key), key)
        (out / "comparison.json").write_text(
            json.dumps(
                {
                    "config": to_dict(cfg),
                    "model": a["task_means"],
                    "baseline": b["task_means"],
                    "compression": {"model": a["compression"], "baseline": b["compression"]},
                },
                indent=2,
            )
        )
    return summaries


def _plot_name(stem: str, key: str) -> str:
    return f"{stem}.png" if key == "string_match_all" else f"{stem}_{key}.png"


def _print_table(summary: dict) -> None:
    print(f"[{summary['label']}] {summary['ckpt']}  ({summary['elapsed_s']:.1f}s)")
    short = {"string_match_all": "all", "string_match_part": "part", "loglik_acc": "ll"}
    print(
        "  (mean over depths; all/part = string_match_all/_part "
        "of generations, ll = log-likelihood ranking)"
    )
    for task, by_len in summary["task_means"].items():
        cells = "  ".join(
            f"{n}: " + " ".join(f"{short[k]}={v:.1f}" for k, v in s.items() if k in short)
            for n, s in by_len.items()
        )
        print(f"  {task:22s} {cells}")
    for n, comp in summary["compression"].items():
        if comp:
            shown = {m: r for m, r in comp.items() if m.startswith("compression/")} or comp
            print(f"  compression @ {n}: " + ", ".join(f"{m}={r:.2f}" for m, r in shown.items()))
    for s in summary["skipped"]:
        print(f"  skipped {s['task']} @ {s['length']} depth={s['depth']}: {s['reason']}")
