"""Preemption: SIGTERM (what SLURM and Kubernetes send before they kill), SIGINT (Ctrl-C) and SIGHUP
(the terminal or SSH session the run was started from closed) stop a run cleanly.

The first signal sets a flag (and says so on stderr): the step in flight finishes, the trainer (or
the vision warm-up) writes a checkpoint and returns the conventional exit code, 128 + the signal
number (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP: a run left in a closed terminal keeps its
last steps instead of dying without a checkpoint). Python runs a handler between bytecodes, never inside a
torch kernel, so setting a flag cannot corrupt a step. A second signal means "now": one line, and
the process exits at once without saving (os._exit: no cleanup that could hang on a collective or a
full disk).

What runs after the last checkpoint (the export of final/ and the end-of-run evaluation) has no step
to finish: there the trainer sets `StopFlag.heard` to what a signal does, and inside
`StopFlag.interruptible()` (the evaluation) the first signal raises `Interrupted` at once, so the
run stops with the signal's exit code and the same command finishes it from its last checkpoint.

Forked data-loader workers (data.num_workers > 0) inherit the handler, which does nothing in them,
so a Ctrl-C to the whole process group does not kill them mid-batch. A SIGTERM sent to the whole
group is different: torch gives its workers their own SIGTERM handler, they end, and the run stops
with torch's "worker killed" error instead of a checkpoint; schedulers that signal only the main
process (or num_workers: 0, the default) are fine.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


def exit_code(signum: int) -> int:
    return 128 + signum


class Preempted(Exception):
    """Raised where a stop cannot be a return value (the vision warm-up runs while the
    trainer is being built): its state was saved; `code` is the exit code, the message the
    one line to print."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Interrupted(BaseException):
    """Raised by the first signal inside `StopFlag.interruptible()`. A BaseException,
    as KeyboardInterrupt is, so that an `except Exception` in the interrupted code does
    not swallow it."""


STEP_IN_FLIGHT = "finishing this step and saving a checkpoint"


class StopFlag:
    """Set by the first SIGTERM / SIGINT / SIGHUP; `requested` is what the loops poll. `heard`: what the
    first signal makes the run do (said on stderr when it comes)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._pid = os.getpid()
        self.heard = STEP_IN_FLIGHT
        self._interruptible = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def code(self) -> int:
        return exit_code(self.signum) if self.signum is not None else 0

    def request(self, signum: int) -> None:
        """What the handler does (and what a test or a caller may do to ask for a stop)."""
        self.signum = signum

    @contextmanager
    def interruptible(self):
        """A block that a signal ends at once (`Interrupted`), also when it came before the block began."""
        if self.requested:
            raise Interrupted()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _handle(self, signum, frame) -> None:
        # a forked worker: the parent decides, the worker keeps serving it
        if os.getpid() != self._pid:
            return
        if self.signum is not None:
            print(
                f"vlm train: second {signal.Signals(signum).name}: "
                "exiting now, without a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os._exit(exit_code(signum))
        self.signum = signum
        # said at once (a step or a save can take a while): someone at a terminal knows the
        # Ctrl-C was heard, a log shows when the signal came; the outcome is one more line when
        # the run stops
        print(
            f"vlm train: {signal.Signals(signum).name} received: "
            f"{self.heard} (send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )
        if self._interruptible:
            self._interruptible = False
            raise Interrupted()


@contextmanager
def stop_on_signals(flag: StopFlag | None = None):
    """Install the handlers for the duration of the block (main thread only) and restore the previous ones."""
    flag = flag or StopFlag()
    previous = {s: signal.signal(s, flag._handle) for s in SIGNALS}
    try:
        yield flag
    finally:
        # after a first signal the handlers stay: a second one during the exit that follows (export,
        # the closing lines) still means "now" and exits with the signal's code, never by the
        # default action's bare death
        if not flag.requested:
            for s, h in previous.items():
                signal.signal(s, h)
