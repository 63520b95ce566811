"""Multi-rank test runs whose failures say what broke: `spawn` is torch.multiprocessing.spawn with a
rank's death turned into one message naming the run and the rank. gloo aborts a process (SIGABRT,
"Received data size doesn't match expected size") when the ranks' collectives differ in size, and
a bare "process 0 terminated with signal SIGABRT" names neither."""

from __future__ import annotations

import os
import socket

import pytest
import torch.multiprocessing as mp

GLOO_MISMATCH = (
    "gloo aborts a rank whose collective differs in size from the other ranks': the ranks made "
    "different collectives (a different number of micro-batches, held-out forwards or exchanged "
    "rows, or statistics of different lengths); the rank's stderr above names the collective"
)


def spawn(fn, args: tuple, nprocs: int, what: str) -> None:
    """Run `fn(rank, *args)` on `nprocs` processes; a rank that dies or raises fails the test with
    one message naming `what` ran, the rank and how it ended."""
    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except mp.ProcessExitedException as e:
        how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        hint = f": {GLOO_MISMATCH}" if e.signal_name == "SIGABRT" else ""
        pytest.fail(f"{what}: rank {e.error_index} of {nprocs} died with {how}{hint}")
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1]
        pytest.fail(f"{what}: rank {e.error_index} of {nprocs} raised {last}\n{e}")


def free_port() -> int:
    """A TCP port free on this host now (a spawned world's rendezvous, a test's server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_world(rank: int, world: int, port: int) -> None:
    """In a spawned process: torch's env:// variables for rank `rank` of `world` on this host."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
