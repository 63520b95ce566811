"""One writer per folder: an advisory lock that `vlm train` (its run folder), `vlm convert` (its
--out) and `vlm data import-*` / `build-default` (their --out) hold while they write.

The lock is `fcntl.flock` on `FOLDER/.vlm-lock`, a file that also records the holder (pid, host,
command, since when), so that a second writer is refused in one line naming the first
(`FolderBusy`). The kernel releases a flock when its holder dies, however it dies (kill -9
included), so a lock is never left held by a dead process; the record such a holder leaves behind
is what tells the next writer that it takes over from one that did not finish, which it says in
one line. A holder that ends normally removes the file: a lock file never makes a folder look used.

Shared by data_pipelines and vlm, so it lives in the lowest layer. One process may take the lock on
a folder it already holds (the same writer: a test or a caller that builds a second trainer for the
same run); the file goes when the last holder in the process lets go.

On a system without fcntl (Windows) nothing is locked.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_NAME = ".vlm-lock"


class FolderBusy(Exception):
    """Another live process holds the folder's lock; the message is the one line to print."""


def _holder(path: Path) -> dict:
    """The record in a lock file ({} when it holds none: a fresh or damaged file)."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return rec if isinstance(rec, dict) else {}


def describe(rec: dict) -> str:
    """`pid 123 on host (vlm train ..., since 2025-01-01 12:00:00)`."""
    since = rec.get("since")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        if isinstance(since, (int, float))
        else "an unknown time"
    )
    cmd = rec.get("command")
    return (
        f"pid {rec.get('pid', '?')} on {rec.get('host', '?')} "
        f"({f'{cmd}, ' if cmd else ''}since {when})"
    )


class FolderLock:
    """The lock on one folder, held until `release()` (or the process ends)."""

    _held: dict[str, FolderLock] = {}  # this process's locks, by real path

    def __init__(self, folder: Path, fd: int | None, path: Path):
        self.folder, self.fd, self.path = folder, fd, path
        self.count = 1
        self.took_over: str | None = None

    def release(self) -> None:
        self.count -= 1
        if self.count > 0 or self.fd is None:
            return
        real = os.path.realpath(self.folder)
        if FolderLock._held.get(real) is self:
            del FolderLock._held[real]
        try:
            # removed while still held: a writer that opened it meanwhile finds it unlinked and
            # opens the path again (see `lock_folder`)
            if os.path.exists(self.path) and os.path.samestat(
                os.stat(self.path), os.fstat(self.fd)
            ):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(
    folder: str | os.PathLike,
    command: str | None = None,
    wait: bool = False,
    say=None,
) -> FolderLock:
    """Take FOLDER's lock (the folder is made if missing). `FolderBusy` when a live process holds
    it, unless `wait` (then block until it is free, saying so once). `say(line)` is told when a lock
    left by a writer that did not finish is taken over (default: stderr). `command`: what the
    record names (default: this process's command line)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    real = os.path.realpath(folder)
    path = folder / LOCK_NAME
    mine = FolderLock._held.pop(real, None)
    if mine is not None and mine.fd is not None:
        try:
            still = os.path.samestat(os.stat(path), os.fstat(mine.fd))
        except OSError:  # the folder was removed and made again since: a new lock
            still = False
        if still:
            FolderLock._held[real] = mine
            mine.count += 1
            return mine
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    if fcntl is None:  # pragma: no cover
        return FolderLock(folder, None, path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = _holder(path)
                if not wait:
                    raise FolderBusy(
                        f"{folder} is being written by another process: {describe(rec)}; "
                        "wait for it to finish (or stop it), or give another folder"
                    ) from None
                say(f"{folder} is being written by {describe(rec)}: waiting for it to finish")
                fcntl.flock(fd, fcntl.LOCK_EX)
            # the holder that just let go may have removed the file this fd was opened on
            if not (path.exists() and os.path.samestat(os.stat(path), os.fstat(fd))):
                os.close(fd)
                continue
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        break
    lock = FolderLock(folder, fd, path)
    left = _holder(path)
    if left:  # the file of a holder that died (its flock went with it)
        lock.took_over = describe(left)
        say(f"{folder}: taking over the lock left by {describe(left)}, which is no longer running")
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.time(),
        "command": (command or " ".join([Path(sys.argv[0] or "python").name, *sys.argv[1:]]))[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    FolderLock._held[real] = lock
    return lock


def is_lock_file(name: str) -> bool:
    """Whether a name in a folder is the lock (what checks for an empty or a used folder skip)."""
    return name == LOCK_NAME


def folder_problem(out: str | os.PathLike) -> str | None:
    """Why nothing can be written into the folder `out` (or where making it would make it), or
    None: a file (or a broken link) where the folder or one of its parents should be, or a folder
    that refuses a new file (tested by creating and removing one: the test that holds for root,
    read-only mounts and full quotas alike). Nothing is left behind."""
    import tempfile

    here = Path(out)
    while not (here.exists() or here.is_symlink()) and here != here.parent:
        here = here.parent
    if not here.is_dir():
        what = "a file" if here.exists() else "a broken link"
        return f"{here} is {what}, not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".vlm-write-check-", dir=here)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write in {here} ({e.strerror or e})"
    return None
