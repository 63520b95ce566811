"""The output folder of an import: checked before any work (`check_out`), and writes into it that
fail part way (a full disk) turned into one line naming the file (`writing` -> `WriteFailed`)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from configs.folder_lock import folder_problem
from data_pipelines.import_sources import ImporterError


class WriteFailed(Exception):
    """An OSError while writing `path` into the output folder."""

    def __init__(self, error: OSError, path: Path):
        super().__init__(str(error))
        self.error, self.path = error, path


@contextmanager
def writing(path: Path):
    """OSErrors of the writes inside, as a `WriteFailed` naming the file being written."""
    try:
        yield
    except OSError as e:
        raise WriteFailed(e, path) from None


def os_reason(e: OSError) -> str:
    return e.strerror or " ".join(str(e).split()) or type(e).__name__


def check_out(out: str | os.PathLike) -> None:
    """Raise ImporterError (one line) unless shards can be written into `out` (or it can be
    created): checked before an import reads anything, by writing and removing an empty file where
    OUT is or would be made."""
    problem = folder_problem(out)
    if problem is None:
        return
    if problem.startswith("cannot write"):
        problem += "; give a folder you can write to"
    raise ImporterError(f"--out {out}: {problem}")
