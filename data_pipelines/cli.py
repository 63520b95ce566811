"""`vlm data ...`: build-default, stats, import-folder, import-table, train-tokenizer."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from data_pipelines.default_dataset import DefaultDatasetConfig, build_default, ensure_default_dataset
from data_pipelines.importers import ImporterError, import_folder, import_table
from data_pipelines.reader import ShardError
from data_pipelines.samples import iter_samples
from data_pipelines.schema import IMAGE_TOKEN
from data_pipelines.stats import collect_stats, format_stats
from data_pipelines.tokenizer import TokenizerError, train_bpe

__all__ = ["add_data_commands", "ensure_default_dataset"]
_USER_ERRORS = (ShardError, ImporterError, TokenizerError, FileNotFoundError, FileExistsError, ValueError)


def _guarded(fn):
    def run(args) -> int:
        try:
            return fn(args) or 0
        except _USER_ERRORS as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


def _build_default(args) -> int:
    cfg = DefaultDatasetConfig(seed=args.seed, train_scenes=args.train_scenes, val_scenes=args.val_scenes,
                               test_scenes=args.test_scenes, text_docs=args.text_docs,
                               interleaved_docs=args.interleaved_docs, relation_captions=args.relation_captions)
    t0 = time.time()
    out = build_default(args.out, cfg) if args.force else ensure_default_dataset(args.out, cfg)
    print(f"default dataset in {out} ({time.time() - t0:.1f}s)")
    for split in ("train", "val", "test"):
        if (out / split).is_dir() and any((out / split).glob("*.tar")):   # a split built with 0 items is empty
            print(f"\n== {split}\n" + format_stats(collect_stats([out / split]), per_shard=False))


def _stats(args) -> int:
    result = collect_stats(args.shards, scan=args.scan, write_manifest=args.write_manifest)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_stats(result, per_shard=not args.totals))


def _report(result: dict) -> None:
    print(f"wrote {result['written']} samples into {len(result['shards'])} shard(s)")
    if result["skipped"]:
        print("skipped: " + ", ".join(f"{k}={v}" for k, v in sorted(result["skipped"].items())))
    if result.get("columns"):
        print("columns: " + ", ".join(f"{k}={v}" for k, v in result["columns"].items() if v))


def _import_folder(args) -> int:
    _report(import_folder(args.images, args.out, captions=args.captions, prefix=args.prefix,
                          max_count=args.max_count, max_bytes=args.max_bytes,
                          allow_outside_root=args.allow_outside_root, progress=True))


def _import_table(args) -> int:
    _report(import_table(args.table, args.out, image_col=args.image_col, text_col=args.text_col,
                         question_col=args.question_col, answer_col=args.answer_col, type_col=args.type_col,
                         conversations_col=args.conversations_col, image_root=args.image_root, fmt=args.format,
                         prefix=args.prefix, max_count=args.max_count, max_bytes=args.max_bytes,
                         allow_outside_root=args.allow_outside_root, progress=True))


def iter_texts(patterns: list[str], limit: int | None = None):
    """Texts of the shards' samples (placeholders removed), for tokenizer training."""
    for n, sample in enumerate(iter_samples(patterns, manifest_counts=False), 1):
        yield sample.all_text().replace(IMAGE_TOKEN, " ")
        if limit is not None and n >= limit:
            return


def _train_tokenizer(args) -> int:
    tok = train_bpe(iter_texts(args.shards, args.limit), args.vocab_size, min_frequency=args.min_frequency,
                    show_progress=True)
    tok.save(args.out)
    print(f"BPE tokenizer with {tok.vocab_size} ids saved in {args.out} (load with tokenizer: {args.out})")


def _add_writer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output folder for the shards and manifest.json")
    p.add_argument("--prefix", default="shard", help="shard file name prefix (default: shard)")
    p.add_argument("--max-count", type=int, default=10_000, help="samples per shard (default: 10000)")
    p.add_argument("--max-bytes", type=int, default=1 << 30, help="bytes per shard (default: 1 GiB)")
    p.add_argument("--allow-outside-root", action="store_true",
                   help="read image files outside the folder / image root (../, absolute paths, symlinks out)")


def add_data_commands(subparsers) -> None:
    data = subparsers.add_parser("data", help="datasets: build the default, import, inspect shards")
    sub = data.add_subparsers(dest="data_command", required=True)

    p = sub.add_parser("build-default", help="write the embedded default dataset (train/val/test shards)")
    p.add_argument("--out", required=True, type=Path)
    d = DefaultDatasetConfig()
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--train-scenes", type=int, default=d.train_scenes)
    p.add_argument("--val-scenes", type=int, default=d.val_scenes)
    p.add_argument("--test-scenes", type=int, default=d.test_scenes)
    p.add_argument("--text-docs", type=int, default=d.text_docs)
    p.add_argument("--interleaved-docs", type=int, default=d.interleaved_docs)
    p.add_argument("--relation-captions", action=argparse.BooleanOptionalAction, default=d.relation_captions,
                   help="captions also state left/right/above/below for objects sharing a row or column")
    p.add_argument("--force", action="store_true", help="rebuild even if an identical build is there")
    p.set_defaults(func=_guarded(_build_default))

    p = sub.add_parser("stats", help="sample counts and modality statistics of shards")
    p.add_argument("shards", nargs="+", help="shard folders, globs, brace patterns, .tar files or URLs "
                                            "(pipe:CMD, http(s)://..., file:PATH)")
    p.add_argument("--scan", action="store_true", help="read the shards instead of trusting manifest.json")
    p.add_argument("--write-manifest", action="store_true", help="write manifest entries for scanned shards")
    p.add_argument("--totals", action="store_true", help="totals only, no per-shard lines")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guarded(_stats))

    p = sub.add_parser("import-folder", help="a folder of images with captions (name.txt or --captions) -> shards")
    p.add_argument("images", help="folder of images (searched recursively)")
    p.add_argument("--captions", help="JSONL/CSV mapping file name -> caption, instead of sidecar .txt files")
    _add_writer_args(p)
    p.set_defaults(func=_guarded(_import_folder))

    p = sub.add_parser("import-table", help="a JSONL/CSV/Parquet table of images and text/QA/chats -> shards")
    p.add_argument("table")
    p.add_argument("--format", choices=["jsonl", "csv", "tsv", "parquet"], help="default: from the extension")
    for col, what in (("image", "image path(s)/bytes"), ("text", "caption or document"), ("question", "question"),
                      ("answer", "answer"), ("type", "question type"), ("conversations", "chat turns")):
        p.add_argument(f"--{col}-col", help=f"column with the {what} (default: guessed from common names)")
    p.add_argument("--image-root", help="folder that relative image paths start from (default: the table's)")
    _add_writer_args(p)
    p.set_defaults(func=_guarded(_import_table))

    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on shards' text")
    p.add_argument("shards", nargs="+")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="use at most this many samples")
    p.add_argument("--out", required=True, help="folder for tokenizer.json (+ transformers files)")
    p.set_defaults(func=_guarded(_train_tokenizer))
