"""One process's state (the vision warm-up's) as a folder with its checksum, written atomically."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from vlm.train.checksums import file_digests
from vlm.train.ckpt_layout import fsync_dir, fsync_tree
from vlm.train.ckpt_manifest import damaged_file
from vlm.train.engine import safe_load
from vlm.train.write_errors import WriteError, describe_write_error, torch_save

log = logging.getLogger(__name__)


def save_state_dir(root: Path, name: str, state: dict) -> Path:
    """One process's state (tensors and plain containers) as root/name/state.pt with its checksum,
    written into `.tmp-name` and renamed: an interrupted write leaves the previous one in place.
    WriteError on a failed write."""
    final, tmp = root / name, root / f".tmp-{name}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch_save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(
            json.dumps({"time": time.time(), "files": file_digests(tmp)})
        )
        fsync_tree(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(
            f"cannot write {final}: {describe_write_error(e, tmp)}; removed the partial {tmp.name}"
        ) from None
    if final.exists():
        old = root / f".del-{name}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    return final


def load_state_dir(root: Path, name: str, warn=log.warning) -> dict | None:
    """The state `save_state_dir` wrote, or None (absent, or damaged: with a warning)."""
    d = root / name
    if not (d / "meta.json").is_file():
        return None
    bad = damaged_file(d)
    if bad is not None:
        warn(f"{d} is damaged: {bad}; not using it")
        return None
    return safe_load(d / "state.pt")
