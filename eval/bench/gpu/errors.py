"""An exception as one line of the JSON: what was raised, and the project line that raised it."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def reason(e: BaseException) -> str:
    """The exception, its first line, and where in the project it was raised: for Dynamo's errors,
    the innermost frame of its 'from user code' trace (the model line that broke the graph), not the
    compiler's own frames."""
    text = str(e).strip()
    msg = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".strip()[:300]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
    if not frames:
        frames = [
            (f.filename, str(f.lineno), f.name) for f in traceback.extract_tb(e.__traceback__)
        ]
    mine = [
        f
        for f in frames
        if str(ROOT) in f[0] and not any(x in f[0] for x in ("/eval/bench/", "-packages/"))
    ] or frames[-1:]
    if mine:
        path, line, fn = mine[-1]
        try:
            path = str(Path(path).resolve().relative_to(ROOT))
        except ValueError:
            path = Path(path).name
        msg += f" (at {path}:{line} in {fn})"
    return msg
