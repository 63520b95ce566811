"""The SHA-256 of every file a folder holds: what checkpoints and converted checkpoints record in
their meta.json, and check before they are used."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_digests(root: Path) -> dict[str, str]:
    """SHA-256 of every file under `root` except meta.json, by relative path."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "meta.json"):
        with open(path, "rb") as fh:
            out[path.relative_to(root).as_posix()] = hashlib.file_digest(fh, "sha256").hexdigest()
    return out
