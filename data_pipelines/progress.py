"""Progress for long data jobs: a tqdm bar on a terminal, plain periodic lines in a redirected log.

tqdm writes carriage-return updates, which fill a log file with one long line; when stderr is
not a terminal this prints `desc: n/total` lines instead, at most every `every_s` seconds (and
at the end).
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(
        self,
        total: int | None,
        desc: str,
        enabled: bool = True,
        unit: str = "item",
        every_s: float = 10.0,
    ):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n, self.t0 = 0, time.time()
        self.last = self.t0
        self.bar = None
        self.plain = enabled and not sys.stderr.isatty()
        if enabled and not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.plain and time.time() - self.last >= self.every_s:
            self._line()

    def set(self, n: int) -> None:
        """Move to an absolute count (for work counted from outside, e.g. steps written by subprocesses)."""
        self.update(n - self.n)

    def _line(self) -> None:
        self.last = time.time()
        of = f"/{self.total}" if self.total else ""
        rate = self.n / max(self.last - self.t0, 1e-9)
        print(f"{self.desc}: {self.n}{of} {self.unit}s ({rate:.0f}/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.plain:
            self._line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
