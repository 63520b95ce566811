"""Writes that fail because of the machine (a full disk, a quota, a read-only mount): one line
naming the path and the system's reason, never a traceback. torch.save reports a failed write as
"iostream error" or "unexpected pos" without the errno, so every torch.save of a checkpoint
(DeepSpeed's included) writes through a file object that keeps the OSError."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch


class WriteError(RuntimeError):
    """A checkpoint or export that could not be written; the message is one line naming the path and why."""


# errors that come from the machine, not from a bug: reported in one line, never as a traceback
DISK_ERRNOS = (
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EIO,
    errno.EFBIG,
    errno.EACCES,
    errno.EPERM,
)


class _KeepsWriteError:
    """A file object for torch.save that remembers the OSError its write raised (torch replaces it
    with "iostream error" / "unexpected pos")."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data):
        try:
            return self.fh.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        return self.fh.flush()

    def __getattr__(self, name):  # tell, seek, fileno, ...: the real file's
        return getattr(self.fh, name)


def torch_save_file(obj, fh, path, **kwargs) -> None:
    """torch.save into the open file `fh` (of `path`) that fails with the OSError (errno, path) of
    a failed write instead of torch's message."""
    w = _KeepsWriteError(fh)
    try:
        torch.save(obj, w, **kwargs)
    except RuntimeError:
        if w.error is not None:
            raise OSError(w.error.errno, w.error.strerror, str(path)) from None
        raise
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def torch_save(obj, path, **kwargs) -> None:
    """torch.save that fails with the OSError (errno, path) of a failed write instead of torch's message."""
    path = Path(path)
    try:
        with open(path, "wb") as fh:
            torch_save_file(obj, fh, path, **kwargs)
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def describe_write_error(e: BaseException, fallback: Path) -> str:
    """'PATH: No space left on device' for a failed write (the path the OS named, else `fallback`)."""
    if isinstance(e, OSError):
        return f"{e.filename or fallback}: {e.strerror or e}"
    return f"{fallback}: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def is_disk_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_ERRNOS


def disk_full_guess(e: RuntimeError, where: Path) -> BaseException:
    """A write error that lost its errno inside a library: when the disk has no room left, say so."""
    try:
        if shutil.disk_usage(where).free < 1 << 20:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None)
    except OSError:
        pass
    return e
