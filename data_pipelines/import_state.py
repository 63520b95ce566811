"""The state file of a resumable import (data_pipelines.import_run): where it is, what makes one
usable, reading it with a fall-back to the state saved before it, saving it, and the digest of the
files the rows made the import read.

`OUT/PREFIX.import.json` records the input's fingerprint and options (`key`), the next row and
shard, the counts so far, the shards written and a digest of the size and modification time of
every file the rows read (`inputs`); the state before it is kept as `OUT/.PREFIX.import.prev.json`,
what a damaged state falls back to (with a warning).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from data_pipelines.import_out import os_reason
from data_pipelines.import_sources import ImporterError
from data_pipelines.writer import write_atomic

STATE_VERSION = 1


def state_path(out: Path, prefix: str) -> Path:
    return out / f"{prefix}.import.json"


def prev_state_path(out: Path, prefix: str) -> Path:
    """The state saved before the current one: what a damaged state falls back to."""
    return out / f".{prefix}.import.prev.json"


STATE_FIELDS = {
    "next_row": int,
    "next_shard": int,
    "written": int,
    "skipped": dict,
    "examples": list,
    "shards": list,
}


def state_problem(state: Any) -> str | None:
    """What makes `state` something no import wrote (None: it is usable)."""
    if not isinstance(state, dict):
        return f"a JSON {type(state).__name__}, not an object"
    for k, t in STATE_FIELDS.items():
        v = state.get(k)
        if not isinstance(v, t) or isinstance(v, bool) or (t is int and v < 0):
            return (
                f"its {k!r} is {str(v)[:40]!r}, not {'a count' if t is int else 'a ' + t.__name__}"
            )
    if not all(isinstance(n, str) for n in state["shards"]):
        return "its 'shards' is not a list of names"
    if state.get("complete") and not isinstance(state.get("summary"), dict):
        return "it says complete but holds no summary"
    return None


def load_state(path: Path) -> tuple[dict | None, str | None]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"not valid JSON: {type(e).__name__}"
    except OSError as e:
        return None, f"cannot be read: {os_reason(e)}"
    problem = state_problem(state)
    return (None, problem) if problem else (state, None)


def read_state(out: Path, prefix: str, warn) -> dict | None:
    """The import state in OUT (None: there is none). A damaged one falls back to the state saved
    before it, with a warning; ImporterError when there is no usable one to fall back to."""
    sp, prev = state_path(out, prefix), prev_state_path(out, prefix)
    if not sp.is_file():
        # a save stopped between keeping the previous state and writing the new one
        return load_state(prev)[0] if prev.is_file() else None
    state, problem = load_state(sp)
    if state is not None:
        return state
    older, _ = load_state(prev) if prev.is_file() else (None, None)
    if older is None:
        raise ImporterError(
            f"{sp} is damaged ({problem}) and no earlier state is kept: the import cannot resume "
            "from it; --overwrite imports again from the start"
        )
    warn(
        f"warning: {sp} is damaged ({problem}); resuming from the state saved before it (row "
        f"{older['next_row']})"
    )
    return older


def save_state(out: Path, prefix: str, state: dict) -> None:
    """The new state, the current one kept as the previous one (what a damage falls back to)."""
    sp = state_path(out, prefix)
    if sp.is_file():
        os.replace(sp, prev_state_path(out, prefix))
    write_atomic(sp, json.dumps(state))


def fold_inputs(digest: str, stats: list) -> str:
    """The inputs digest after one more row's files (`import_rows.file_stat` lists)."""
    if not stats:
        return digest
    text = digest + json.dumps(stats)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def missing_shard(out: Path, names: list[str]) -> str | None:
    """The first shard a state lists that is not in OUT (deleted, or lost to a concurrent writer)."""
    return next((n for n in names if not (out / n).is_file()), None)
