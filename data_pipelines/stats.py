"""`vlm data stats SHARDS...`: counts and modality statistics from manifests, or by reading the
shards (URL shards too: streamed through the same reader as the loader's)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from data_pipelines.encode import process_images
from data_pipelines.reader import (
    SHARD_SUFFIXES,
    ManifestEntries,
    Shard,
    listed_but_missing,
    local_source,
    resolve_shards,
    shard_name,
)
from data_pipelines.samples import iter_decoded
from data_pipelines.schema import BadSample
from data_pipelines.writer import ShardStats, merge_stats, update_manifest
from vision.image_processor import ImageProcessor

log = logging.getLogger("data_pipelines")


def scan_shard(
    path: Shard, processor: ImageProcessor | None = None
) -> tuple[dict[str, Any], Counter]:
    """Read one shard: its stats entry and the problems found (by reason). Images are decoded as the
    loader decodes them (default processor settings), so corrupt images and decompression bombs
    count here too."""
    processor = processor or ImageProcessor()
    stats, bad = ShardStats(), Counter()
    for raw, sample in iter_decoded(path, counters=bad):
        try:
            process_images(sample, processor)
            stats.add(sample, sum(len(v) for k, v in raw.items() if not k.startswith("__")))
        except BadSample as e:
            bad[e.reason] += e.count
    entry = {"name": shard_name(path), **stats.to_dict()}
    if isinstance(path, Path):  # a URL's size is not known without fetching it
        entry["file_bytes"] = path.stat().st_size if path.exists() else 0
    return entry, bad


def _with_split_folders(patterns: list[str | os.PathLike]) -> list[str | os.PathLike]:
    """A dataset folder whose shards sit in split subfolders (what `vlm data build-default` writes:
    train/, val/, test/) stands for those subfolders."""
    out: list[str | os.PathLike] = []
    for p in patterns:
        local = local_source(p)
        if local is None:
            out.append(p)
            continue
        d = Path(local)
        subs = (
            sorted(q for q in d.iterdir() if q.is_dir() and any(q.glob("*.tar*")))
            if d.is_dir()
            else []
        )
        has_own = d.is_dir() and any(q.name.endswith(SHARD_SUFFIXES) for q in d.iterdir())
        out += subs if subs and not has_own else [p]
    return out


def collect_stats(
    patterns: list[str | os.PathLike], scan: bool = False, write_manifest: bool = False
) -> dict[str, Any]:
    """Per-shard entries and totals. Manifest entries are used unless `scan` (or a shard has none)."""
    paths: list[Shard] = []
    missing: list[Path] = []
    for p in _with_split_folders(patterns):
        paths += resolve_shards(p)
        missing += listed_but_missing(p)
    # local shards sorted, then URLs in the order given (a Path and a str do not compare)
    paths = sorted(dict.fromkeys(p for p in paths if isinstance(p, Path))) + list(
        dict.fromkeys(p for p in paths if isinstance(p, str))
    )
    entries, bad, scanned = [], Counter(), []
    manifest_entry = ManifestEntries()
    for path in paths:
        entry = manifest_entry(path)
        if scan or entry is None:
            entry, b = scan_shard(path)
            bad.update(b)
            scanned.append(path)
        entries.append({**entry, "path": str(path)})
    if write_manifest:
        by_dir: dict[Path, list] = {}
        if any(isinstance(p, str) for p in scanned):
            log.warning(
                "manifest entries are written next to local "
                "shards only; the URL shards are left out"
            )
        for path, e in zip(paths, entries):
            if path in scanned and isinstance(path, Path):
                by_dir.setdefault(path.parent, []).append(
                    {k: v for k, v in e.items() if k != "path"}
                )
        for d, es in by_dir.items():
            update_manifest(d, es)
    return {
        "shards": entries,
        "totals": merge_stats(entries),
        "bad": dict(sorted(bad.items())),
        "scanned": len(scanned),
        "missing": [str(m) for m in sorted(set(missing))],
    }


def _fmt_counter(c: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.items()) or "-"


def format_stats(result: dict[str, Any], per_shard: bool = True) -> str:
    lines = []
    if per_shard:
        lines.append(f"{'shard':<40} {'samples':>8} {'images':>7} {'MB':>8}  kinds")
        for e in result["shards"]:
            lines.append(
                f"{Path(e['path']).name:<40} {e['count']:>8} {e['images']:>7} "
                f"{e.get('file_bytes', e['bytes']) / 1e6:>8.2f}  {_fmt_counter(e['kinds'])}"
            )
        lines.append("")
    t = result["totals"]
    n = max(t["count"], 1)
    lines += [
        f"shards:            {t['shards']}",
        f"samples:           {t['count']}  ({_fmt_counter(t['kinds'])}; chat {t['chat']})",
        f"images:            {t['images']}  (per sample: {_fmt_counter(t['images_per_sample'])})",
        (
            f"image sides:       {t['min_image_side']}..{t['max_image_side']} px, "
            f"mean {t['image_pixels'] / max(t['images'], 1):.0f} pixels/image"
        ),
        f"text:              {t['text_bytes']} bytes ({t['text_bytes'] / n:.1f} per sample)",
        f"payload:           {t['bytes'] / 1e6:.2f} MB",
    ]
    if t["qa_types"]:
        lines.append(
            f"VQA questions:     {sum(t['qa_types'].values())}  ({_fmt_counter(t['qa_types'])})"
        )
    if result["scanned"]:
        lines.append(f"read {result['scanned']} shard(s); problems: {_fmt_counter(result['bad'])}")
    for m in result.get("missing", []):
        lines.append(f"missing:           {m} (listed in its manifest, not on disk)")
    return "\n".join(lines)
