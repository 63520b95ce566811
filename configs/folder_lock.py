"""One writer per folder: an advisory lock that `vlm train` (its run folder), `vlm convert` (its
--out) and `vlm data import-*` / `build-default` (their --out) hold while they write.

The lock is `fcntl.flock` on `FOLDER/.vlm-lock`, a file that also records the holder (pid, host,
command, since when), so that a second writer is refused in one line naming the first
(`FolderBusy`). The kernel releases a flock when its holder dies, however it dies (kill -9
included), so a lock is never left held by a dead process of this machine; the record such a holder
leaves behind is what tells the next writer that it takes over from one that did not finish, which
it says in one line. A holder that ends normally removes the file: a lock file never makes a folder
look used.

What a lock file alone cannot tell, and how each case is met:
- **Another machine.** On many shared filesystems (NFS with `local_lock`, Lustre's `localflock`)
  flock is per machine: a writer alive on another node is invisible to this one's flock. A record
  naming another host is therefore never taken over silently: it is refused in one line naming the
  host and pid, and taken over only when the user says that process is gone (`VLM_TAKE_OVER_LOCK=1`).
- **The record deleted during a run.** The holder also flocks the folder itself, which nobody
  deletes by accident (a non-empty folder cannot be removed without its contents): a second writer
  is refused while the first runs even when `.vlm-lock` was removed. Where a filesystem has no
  flock on folders, `FolderLock.check()` (called before a writer replaces what it made, e.g. the
  trainer's export) finds the record gone or replaced and refuses.
- **No flock at all** (ENOLCK / EOPNOTSUPP: NFS mounted `nolock`, Lustre without `flock`). The
  record file itself is the lock, created with O_EXCL: it exists while its holder runs. A record
  of this machine whose pid is gone is taken over (one line); one whose pid runs, or of another
  host, is refused. This is said once, in one line, when the lock is taken.
- **Not a lock file.** A `.vlm-lock` that is a symbolic link, a FIFO, a folder or a device is
  never opened through (no write follows a link, no open blocks on a FIFO): refused in one line.
- **Folders inside a locked folder.** A writer into FOLDER/sub while another process holds FOLDER
  is refused (`vlm convert --out RUN/final` while RUN trains), naming the enclosing folder's holder;
  a caller that `wait`s (the default dataset a run's ranks build once, wherever it is) is not.

A refusal leaves nothing behind: no lock file, and no folder that taking the lock made.

Shared by data_pipelines and vlm, so it lives in the lowest layer. One process may take the lock on
a folder it already holds (the same writer: a test or a caller that builds a second trainer for the
same run); the file goes when the last holder in the process lets go.

On a system without fcntl (Windows) nothing is locked.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_NAME = ".vlm-lock"
TAKE_OVER_ENV = "VLM_TAKE_OVER_LOCK"
# flock's answers on a filesystem that has no locks (NFS `nolock`, Lustre without `flock`)
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class FolderBusy(Exception):
    """The folder's lock cannot be taken: another live process holds it (or may: a writer on another
    machine, a lock file that is no file); the message is the one line to print."""


def _read_record(fd: int) -> dict:
    """The record in an open lock file ({} when it holds none: a fresh or damaged file)."""
    try:
        raw = os.pread(fd, 4096, 0)
        rec = json.loads(raw.decode("utf-8") or "{}")
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


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _not_a_lock_file(path: Path, mode: int) -> FolderBusy:
    where = f" (to {os.readlink(path)})" if stat.S_ISLNK(mode) else ""
    return FolderBusy(
        f"{path} is {_kind(mode)}{where}, not a lock file: nothing is written through it; "
        "remove it (it is no run's or import's data) and run the command again"
    )


def _open_record(path: Path) -> tuple[int, bool] | None:
    """(fd, made by this call) of the lock file, opened without following a link or blocking on a
    FIFO; None when it vanished between two looks. FolderBusy when it is no regular file."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link; EISDIR: a folder; ENXIO: a socket; EACCES
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = None
        if mode is None or stat.S_ISREG(mode):
            raise FolderBusy(f"cannot open the lock file {path} ({e.strerror or e})") from None
        raise _not_a_lock_file(path, mode) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_a_lock_file(path, mode)
    return fd, False


def _is_ours(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd` (not removed, not replaced)."""
    try:
        return os.path.samestat(os.lstat(path), os.fstat(fd))
    except OSError:
        return False


def _pid_runs(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process, alive
        return True
    return True


def _take_over_allowed() -> bool:
    return os.environ.get(TAKE_OVER_ENV, "").strip().lower() in ("1", "true", "yes")


def _other_host(folder: Path, rec: dict) -> FolderBusy:
    return FolderBusy(
        f"{folder} is locked by {describe(rec)}, another machine: whether that process still "
        "runs cannot be seen from here (file locks are per machine on many shared "
        f"filesystems); if it is no longer running, run the command again with "
        f"{TAKE_OVER_ENV}=1 to take the lock over"
    )


def _busy(folder: Path, rec: dict, record_gone: bool = False) -> FolderBusy:
    who = (
        f"(its record {LOCK_NAME} was removed, so it cannot be named)"
        if record_gone
        else describe(rec)
    )
    return FolderBusy(
        f"{folder} is being written by another process: {who}; "
        "wait for it to finish (or stop it), or give another folder"
    )


class FolderLock:
    """The lock on one folder, held until `release()` (or the process ends)."""

    _held: dict[str, FolderLock] = {}  # this process's locks, by real path

    def __init__(self, folder: Path, fd: int | None, path: Path, dir_fd: int | None = None):
        self.folder, self.fd, self.path, self.dir_fd = folder, fd, path, dir_fd
        self.count = 1
        self.took_over: str | None = None

    def check(self) -> None:
        """FolderBusy (one line) unless `.vlm-lock` is still this holder's file: a writer about to
        replace what it made calls it, so that a lock removed or replaced during its run (a second
        writer let in where the folder itself cannot be flocked) stops it instead."""
        if self.fd is None or _is_ours(self.path, self.fd):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            rec = None
        else:
            rec = _read_record(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
            os.close(fd)
        now = f"now holds {describe(rec)}" if rec else "was removed"
        raise FolderBusy(
            f"{self.path}, this process's lock on {self.folder}, {now} during the run: another "
            "writer may be in the folder, so nothing of it is replaced"
        )

    def release(self) -> None:
        self.count -= 1
        if self.count > 0 or self.fd is None:
            return
        real = os.path.realpath(self.folder)
        if FolderLock._held.get(real) is self:
            del FolderLock._held[real]
        # removed while still held: a writer that opened it meanwhile finds it unlinked and opens
        # the path again (see `lock_folder`)
        if _is_ours(self.path, self.fd):
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = None
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

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
    it (or a folder enclosing it), unless `wait` (then block until it is free, saying so once);
    FolderBusy too where the lock cannot be judged (see the module docstring). `say(line)` is told
    when a lock left by a writer that did not finish is taken over (default: stderr). `command`:
    what the record names (default: this process's command line). A refusal leaves no lock file,
    and no folder that this call made."""
    folder = Path(folder)
    real = os.path.realpath(folder)
    path = folder / LOCK_NAME
    mine = FolderLock._held.pop(real, None)
    if mine is not None and mine.fd is not None:
        if _is_ours(path, mine.fd):
            FolderLock._held[real] = mine
            mine.count += 1
            return mine
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    if fcntl is None:  # pragma: no cover
        folder.mkdir(parents=True, exist_ok=True)
        return FolderLock(folder, None, path)
    if not wait:
        _check_enclosing(folder)
    made = _first_missing(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        try:
            lock = _take(folder, path, command, wait, say)
        except OSError as e:  # writing the record (a full disk): the lock's reason, not mkdir's
            raise FolderBusy(f"cannot lock {folder}: {path}: {e.strerror or e}") from None
    except BaseException:
        if made is not None:
            _remove_empty(folder, made)
        raise
    FolderLock._held[real] = lock
    return lock


def _take(folder: Path, path: Path, command: str | None, wait: bool, say) -> FolderLock:
    dir_fd = _lock_the_folder(folder, path, wait, say)
    try:
        fd, no_flock, made = _lock_the_record(folder, path, wait, say)
    except BaseException:
        if dir_fd is not None:
            os.close(dir_fd)
        raise
    lock = FolderLock(folder, fd, path, dir_fd)
    try:
        left = {} if made else _read_record(fd)
        if no_flock and not (made or left):  # a holder just starting, or a damaged file
            raise FolderBusy(
                f"{path} holds no readable record (a writer that is just starting, or a damaged "
                f"file): run the command again in a moment, or remove it if no process writes "
                f"{folder}"
            )
        if left:
            mine = left.get("host") == socket.gethostname()
            if no_flock and mine and _pid_runs(left.get("pid")):
                raise _busy(folder, left)
            if not mine and not _take_over_allowed():
                raise _other_host(folder, left)
            lock.took_over = describe(left)
            say(
                f"{folder}: taking over the lock left by {describe(left)}, which is no longer "
                f"running{'' if mine else f' (as {TAKE_OVER_ENV}=1 says)'}"
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "command": (command or " ".join([Path(sys.argv[0] or "python").name, *sys.argv[1:]]))[
                :300
            ],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        if no_flock:
            say(
                f"{folder}: this filesystem has no file locks (flock: {no_flock}); the lock is "
                f"{LOCK_NAME} itself, there while its holder runs"
            )
    except BaseException:
        # refused: a file this call made goes (a holder's file stays theirs)
        if made and _is_ours(path, fd):
            os.unlink(path)
        os.close(fd)
        if dir_fd is not None:
            os.close(dir_fd)
        raise
    return lock


def _lock_the_folder(folder: Path, path: Path, wait: bool, say) -> int | None:
    """flock on the folder itself (what a deleted `.vlm-lock` cannot undo); None where the
    filesystem has no flock on folders."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        rec = _peek(path)
        if not wait:
            os.close(dir_fd)
            raise _busy(folder, rec or {}, record_gone=rec is None) from None
        say(f"{folder} is being written by {describe(rec or {})}: waiting for it to finish")
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(dir_fd)
            raise
    except OSError:  # no flock on folders here: the record's flock (or its presence) is the lock
        os.close(dir_fd)
        return None
    return dir_fd


def _lock_the_record(folder: Path, path: Path, wait: bool, say) -> tuple[int, str | None, bool]:
    """(fd, why there is no flock or None, file made by this call) of `.vlm-lock`, flocked where
    the filesystem can; where it cannot, the file's own creation (O_EXCL) is the lock and an
    existing one is judged by its record."""
    while True:
        opened = _open_record(path)
        if opened is None:
            continue
        fd, made = opened
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = _read_record(fd)
                if not wait:
                    raise _busy(folder, rec) from None
                say(f"{folder} is being written by {describe(rec)}: waiting for it to finish")
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                if e.errno not in NO_FLOCK:
                    raise FolderBusy(
                        f"cannot lock {folder}: flock on {path} failed ({e.strerror or e})"
                    ) from None
                return fd, e.strerror or str(e), made
            # the holder that just let go may have removed the file this fd was opened on
            if not _is_ours(path, fd):
                os.close(fd)
                continue
        except BaseException:
            if made and _is_ours(path, fd):
                os.unlink(path)
            os.close(fd)
            raise
        return fd, None, made


def _peek(path: Path) -> dict | None:
    """The record at `path` (None: no lock file there), read without following a link or
    blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        return _read_record(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else {}
    finally:
        os.close(fd)


def _check_enclosing(folder: Path) -> None:
    """FolderBusy when a folder enclosing `folder` is held by another process (its lock file is
    flocked, or, with no flock there, records a live holder): what is written inside it is that
    writer's."""
    here = Path(os.path.realpath(folder)).parent
    for outer in (here, *here.parents):
        if str(outer) in FolderLock._held:  # this process's own
            continue
        path = outer / LOCK_NAME
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            rec = _read_record(fd)
            elsewhere = bool(rec) and rec.get("host") != socket.gethostname()
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                # free here; a holder on another machine may not show (closing lets go)
                held = elsewhere and not _take_over_allowed()
            except BlockingIOError:
                held = True
            except OSError:  # no flock here: the record says
                held = (elsewhere and not _take_over_allowed()) or (
                    bool(rec) and not elsewhere and _pid_runs(rec.get("pid"))
                )
        finally:
            os.close(fd)
        if held:
            how = (
                f" (if it is no longer running, {TAKE_OVER_ENV}=1 writes inside regardless)"
                if elsewhere
                else ""
            )
            raise FolderBusy(
                f"{folder} is inside {outer}, which is being written by another process: "
                f"{describe(rec)}{how}; give a folder outside it, or wait for that process to "
                "finish"
            )


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet."""
    path = path.absolute()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def _remove_empty(folder: Path, made: Path) -> None:
    """Remove `folder` and its parents up to `made` (the folders a refused lock made), if empty."""
    for p in (folder.absolute(), *folder.absolute().parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == made:
            return


def is_lock_file(name: str) -> bool:
    """Whether a name in a folder is the lock (what checks for an empty or a used folder skip)."""
    return name == LOCK_NAME


def held_lock(folder: str | os.PathLike) -> FolderLock | None:
    """This process's lock on `folder` (None: it holds none)."""
    return FolderLock._held.get(os.path.realpath(folder))


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
