"""The output folder of an import: checked before any work (`check_out`), and writes into it that
fail part way (a full disk) turned into one line naming the file (`writing` -> `WriteFailed`)."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

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
    p = Path(out)
    here = p
    try:
        while not (here.exists() or here.is_symlink()) and here != here.parent:
            here = here.parent
        if not here.is_dir():
            what = "a file" if here.exists() else "a broken link"
            raise ImporterError(f"--out {out}: {here} is {what}, not a folder")
        fd, probe = tempfile.mkstemp(prefix=".vlm-write-check-", dir=here)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ImporterError(
            f"--out {out}: cannot write in {here} ({os_reason(e)}); give a folder you can write to"
        ) from None
