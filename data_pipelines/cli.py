"""`vlm data ...`: build-default, stats, import-folder, import-table, train-tokenizer, import-bench.

Registering the commands builds argparse only; what a command needs (the shard reader, the
importers, the tokenizer trainer, and through them torch) is imported when it runs, so `vlm data
--help` starts at once."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from data_pipelines import import_bench
from data_pipelines.import_sources import FORMATS

__all__ = ["add_data_commands"]
# data_pipelines.import_summary.DEFAULT_MAX_SKIP_SHARE (tests/test_cli.py checks)
DEFAULT_MAX_SKIP_SHARE_TEXT = "0.1"


def _user_errors() -> tuple[type[BaseException], ...]:
    from configs.folder_lock import FolderBusy
    from data_pipelines.import_sources import ImporterError
    from data_pipelines.reader import ShardError
    from data_pipelines.tokenizer import TokenizerError

    # OSError last: a folder that cannot be written, a full disk, ... as one line (the importers
    # name the path)
    return ShardError, ImporterError, TokenizerError, FolderBusy, ValueError, OSError


def _guarded(fn):
    def run(args) -> int:
        errors = _user_errors()
        try:
            return fn(args) or 0
        except errors as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run


_DEFAULT_FIELDS = (
    "seed",
    "train_scenes",
    "val_scenes",
    "test_scenes",
    "text_docs",
    "interleaved_docs",
    "relation_captions",
)


def _build_default(args) -> int:
    from data_pipelines.default_dataset import (
        DefaultDatasetConfig,
        build_default,
        ensure_default_dataset,
    )
    from data_pipelines.stats import collect_stats, format_stats

    cfg = DefaultDatasetConfig(
        **{k: getattr(args, k) for k in _DEFAULT_FIELDS if getattr(args, k) is not None}
    )
    t0 = time.time()
    out = (
        build_default(args.out, cfg)
        if args.force
        else ensure_default_dataset(args.out, cfg, wait=False)
    )
    print(f"default dataset in {out} ({time.time() - t0:.1f}s)")
    for split in ("train", "val", "test"):
        # a split built with 0 items is empty
        if (out / split).is_dir() and any((out / split).glob("*.tar")):
            print(f"\n== {split}\n" + format_stats(collect_stats([out / split]), per_shard=False))


def _stats(args) -> int:
    from data_pipelines.stats import collect_stats, format_stats

    result = collect_stats(args.shards, scan=args.scan, write_manifest=args.write_manifest)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_stats(result, per_shard=not args.totals))


def _run_import(args, fn, *pos, **kw) -> int:
    """An import with its report: exit 0 when done, 1 when more than --max-skip-share of the rows
    were skipped, 2 when nothing could be imported (one line on stderr naming the first skipped
    rows), 128 + the signal when stopped by SIGINT (130), SIGTERM (143) or SIGHUP (129), in one
    line saying where the same command resumes. `--json`: the summary as one JSON object
    on stdout, whatever the outcome."""
    from data_pipelines.import_run import default_workers
    from data_pipelines.import_summary import (
        DEFAULT_MAX_SKIP_SHARE,
        ImportFailed,
        ImportInterrupted,
    )
    from data_pipelines.importers import summary_lines

    workers = default_workers() if args.workers is None else args.workers
    share = DEFAULT_MAX_SKIP_SHARE if args.max_skip_share is None else args.max_skip_share
    try:
        summary = fn(
            *pos,
            out=args.out,
            prefix=args.prefix,
            max_count=args.max_count,
            max_bytes=args.max_bytes,
            allow_outside_root=args.allow_outside_root,
            workers=workers,
            progress=not args.quiet,
            max_skip_share=share,
            overwrite=args.overwrite,
            **kw,
        )
    except ImportFailed as e:
        if args.json:
            print(json.dumps({**e.summary, "error": str(e)}))
        print(f"error: {e}", file=sys.stderr)
        return 128 + int(e.signum) if isinstance(e, ImportInterrupted) else 2
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(summary_lines(summary)))
    if summary["status"] == "too_many_skipped":
        if args.json:
            print(summary_lines(summary)[-1], file=sys.stderr)
        return 1
    return 0


def _import_folder(args) -> int:
    from data_pipelines.importers import import_folder

    return _run_import(
        args, import_folder, args.images, captions=args.captions, encoding=args.encoding
    )


def _import_table(args) -> int:
    from data_pipelines.importers import import_table

    return _run_import(
        args,
        import_table,
        args.table,
        image_col=args.image_col,
        text_col=args.text_col,
        question_col=args.question_col,
        answer_col=args.answer_col,
        type_col=args.type_col,
        conversations_col=args.conversations_col,
        image_root=args.image_root,
        fmt=args.format,
        split=args.split,
        encoding=args.encoding,
    )


def iter_texts(patterns: list[str], limit: int | None = None):
    """Texts of the shards' samples (placeholders removed), for tokenizer training."""
    from data_pipelines.samples import iter_samples
    from data_pipelines.schema import IMAGE_TOKEN

    for n, sample in enumerate(iter_samples(patterns, manifest_counts=False), 1):
        yield sample.all_text().replace(IMAGE_TOKEN, " ")
        if limit is not None and n >= limit:
            return


def _train_tokenizer(args) -> int:
    from configs.folder_lock import folder_problem
    from data_pipelines.tokenizer import train_bpe

    problem = folder_problem(args.out)  # before the shards are read and the tokenizer trained
    if problem is not None:
        raise ValueError(f"--out {args.out}: {problem}")

    tok = train_bpe(
        iter_texts(args.shards, args.limit),
        args.vocab_size,
        min_frequency=args.min_frequency,
        show_progress=True,
    )
    tok.save(args.out)
    print(
        f"BPE tokenizer with {tok.vocab_size} ids saved "
        f"in {args.out} (load with tokenizer: {args.out})"
    )


def _add_writer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output folder for the shards and manifest.json")
    p.add_argument("--prefix", default="shard", help="shard file name prefix (default: shard)")
    p.add_argument(
        "--max-count", type=int, default=10_000, help="samples per shard (default: 10000)"
    )
    p.add_argument(
        "--max-bytes", type=int, default=1 << 30, help="bytes per shard (default: 1 GiB)"
    )
    p.add_argument(
        "--allow-outside-root",
        action="store_true",
        help="read image files outside the folder / image root (../, absolute paths, symlinks out)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that read, decode and check images (0: in "
        "this process; default: the usable CPU cores, at most 8)",
    )
    p.add_argument(
        "--max-skip-share",
        type=_share,
        default=None,
        help="exit 1 (after writing) when more than this share of "
        f"rows is skipped (default: {DEFAULT_MAX_SKIP_SHARE_TEXT})",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the PREFIX-*.tar shards already in --out (by default the same "
        "command resumes an interrupted import and does nothing after a complete one)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _share(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a share between 0 and 1")
    return x


def add_data_commands(subparsers) -> None:
    data = subparsers.add_parser("data", help="datasets: build the default, import, inspect shards")
    sub = data.add_subparsers(dest="data_command", required=True)

    p = sub.add_parser(
        "build-default", help="write the embedded default dataset (train/val/test shards)"
    )
    p.add_argument("--out", required=True, type=Path)
    # unset options keep DefaultDatasetConfig's defaults (the same build `vlm train` makes when data
    # is missing)
    for name in (
        "seed",
        "train-scenes",
        "val-scenes",
        "test-scenes",
        "text-docs",
        "interleaved-docs",
    ):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument(
        "--relation-captions",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="captions also state left/right/above/below for objects sharing a row or column",
    )
    p.add_argument(
        "--force", action="store_true", help="rebuild even if an identical build is there"
    )
    p.set_defaults(func=_guarded(_build_default))

    p = sub.add_parser("stats", help="sample counts and modality statistics of shards")
    p.add_argument(
        "shards",
        nargs="+",
        help="shard folders, globs, brace patterns, .tar "
        "files or URLs (pipe:CMD, http(s)://..., file:PATH)",
    )
    p.add_argument(
        "--scan", action="store_true", help="read the shards instead of trusting manifest.json"
    )
    p.add_argument(
        "--write-manifest", action="store_true", help="write manifest entries for scanned shards"
    )
    p.add_argument("--totals", action="store_true", help="totals only, no per-shard lines")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guarded(_stats))

    p = sub.add_parser(
        "import-folder", help="a folder of images with captions (name.txt or --captions) -> shards"
    )
    p.add_argument("images", help="folder of images (searched recursively)")
    p.add_argument(
        "--captions", help="JSONL/CSV mapping file name -> caption, instead of sidecar .txt files"
    )
    p.add_argument(
        "--encoding",
        default="utf-8",
        help="text encoding of the captions (sidecar files or the --captions table; default: utf-8)",
    )
    _add_writer_args(p)
    p.set_defaults(func=_guarded(_import_folder))

    p = sub.add_parser(
        "import-table",
        help="a table or dataset of images and text/QA/chats -> shards: LLaVA "
        "JSON arrays, JSONL, CSV/TSV, Parquet/Arrow files and datasets folders",
    )
    p.add_argument(
        "table",
        help="a .json/.jsonl/.csv/.tsv/.parquet/.arrow file, or a folder "
        "of them (also what datasets' save_to_disk or to_parquet wrote)",
    )
    p.add_argument(
        "--format",
        choices=list(FORMATS),
        help="default: from the extension (.json: an array or JSON lines, from its first character)",
    )
    p.add_argument(
        "--split", help="the split of a dataset folder that holds several (train, test, ...)"
    )
    p.add_argument(
        "--encoding", default="utf-8", help="text encoding of a CSV/TSV/JSONL file (default: utf-8)"
    )
    for col, what in (
        ("image", "image path(s)/bytes"),
        ("text", "caption or document"),
        ("question", "question"),
        ("answer", "answer"),
        ("type", "question type"),
        ("conversations", "chat turns"),
    ):
        p.add_argument(
            f"--{col}-col", help=f"column with the {what} (default: guessed from common names)"
        )
    p.add_argument(
        "--image-root", help="folder that relative image paths start from (default: the table's)"
    )
    _add_writer_args(p)
    p.set_defaults(func=_guarded(_import_table))

    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on shards' text")
    p.add_argument("shards", nargs="+")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="use at most this many samples")
    p.add_argument("--out", required=True, help="folder for tokenizer.json (+ transformers files)")
    p.set_defaults(func=_guarded(_train_tokenizer))

    p = sub.add_parser(
        "import-bench",
        help="time an import: generate a LLaVA-format JSON "
        "array, import it, report rows/s and peak memory",
        description="Generates (once) a LLaVA-format JSON array over generated JPEGs in --dir, "
        "imports it with import-table's code and prints rows/s and peak resident memory as one "
        "JSON line. Run each measurement as its own command (peak memory is per process).",
    )
    import_bench.add_arguments(p)
    p.set_defaults(func=import_bench.run)
