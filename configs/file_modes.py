"""Files a writer makes get the permissions the user's umask gives every other file.

safetensors writes its file through a temporary one made like `mkstemp`'s, mode 0600 whatever the
umask, so an export's `model.safetensors` would be the only file in it a teammate or a serving
account cannot read (every other one is 0644 under umask 022). A writer calls `follow_umask` on
its folder before renaming it into place.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def created_file_mode(folder: str | os.PathLike) -> int:
    """The permissions a new file gets in `folder`: 0666 less the umask, and whatever a default ACL
    there says, as the kernel applies them (read off a probe file made and removed there)."""
    probe = Path(folder) / f".vlm-mode-probe-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        os.unlink(probe)


def follow_umask(folder: str | os.PathLike) -> list[Path]:
    """Give every regular file under `folder` that lacks some of `created_file_mode`'s permissions
    those permissions (a 0600 file becomes 0644 under umask 022; nothing is taken away, nothing is
    made executable); the files changed."""
    want = created_file_mode(folder)
    changed = []
    for root, _, names in os.walk(folder):
        for name in names:
            p = Path(root) / name
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & want != want:
                os.chmod(p, stat.S_IMODE(st.st_mode) | want)
                changed.append(p)
    return changed
