"""A shard folder's manifest.json: per shard its sample count, bytes and modality statistics, and
their totals (data_pipelines.writer writes it; the loader and `vlm data stats` read it)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def merge_stats(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum per-shard stat dicts into totals."""
    tot: dict[str, Any] = {
        "shards": len(entries),
        "count": 0,
        "bytes": 0,
        "kinds": Counter(),
        "chat": 0,
        "images": 0,
        "images_per_sample": Counter(),
        "image_pixels": 0,
        "min_image_side": None,
        "max_image_side": 0,
        "text_bytes": 0,
        "qa_types": Counter(),
    }
    for e in entries:
        for k in ("count", "bytes", "chat", "images", "image_pixels", "text_bytes"):
            tot[k] += e.get(k, 0)
        for k in ("kinds", "images_per_sample", "qa_types"):
            tot[k].update(e.get(k, {}))
        if e.get("min_image_side") is not None:
            lo = tot["min_image_side"]
            tot["min_image_side"] = (
                e["min_image_side"] if lo is None else min(lo, e["min_image_side"])
            )
        tot["max_image_side"] = max(tot["max_image_side"], e.get("max_image_side") or 0)
    for k in ("kinds", "images_per_sample", "qa_types"):
        tot[k] = dict(sorted(tot[k].items()))
    return tot


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"manifest {path} cannot be read: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
        raise ValueError(f"manifest {path}: expected an object with a 'shards' list")
    return data


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` or what it held before (a full disk leaves the old file and no `.tmp` beside it)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def update_manifest(
    directory: str | os.PathLike, entries: list[dict[str, Any]], drop: Any = ()
) -> Path:
    """Insert/replace `entries` (by shard name) in DIR/manifest.json, remove the entries
    named in `drop`, and recompute the totals; replaced in one step (a manifest left with no
    entry is removed)."""
    directory = Path(directory)
    old = read_manifest(directory) or {"shards": []}
    by_name = {e["name"]: e for e in old["shards"] if e.get("name") not in drop}
    by_name.update({e["name"]: e for e in entries})
    shards = [by_name[n] for n in sorted(by_name)]
    if not shards:
        (directory / MANIFEST).unlink(missing_ok=True)
        return directory / MANIFEST
    data = {"version": MANIFEST_VERSION, "shards": shards, "totals": merge_stats(shards)}
    write_atomic(directory / MANIFEST, json.dumps(data, indent=1))
    return directory / MANIFEST
