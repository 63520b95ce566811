"""Process-group setup for the DeepSpeed engine, with or without a launcher (the collectives a run
makes are in vlm.train.collectives).

A single `vlm train` needs no launcher: the rendezvous variables a launcher would set are filled
in (rank 0 of 1, a free local port). Under `deepspeed`/`torchrun` they are already set and used
as they are.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_launcher_env() -> None:
    """Set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT where no launcher did (one process)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def quiet_deepspeed() -> None:
    """DeepSpeed logs every config key at INFO; keep warnings and errors only."""
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    for h in ds_logger.handlers:
        h.setLevel(logging.WARNING)


def init_distributed() -> DistInfo:
    """Initialise the process group through DeepSpeed (gloo on CPU, nccl on GPU) and return who we are."""
    fill_launcher_env()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    quiet_deepspeed()
    if os.environ.get("WORLD_SIZE") == "1":
        # One process has nothing to all-reduce: skip JIT-compiling DeepSpeed's CPU shared-memory
        # collective (about a minute on a fresh machine, before the first step of the README's
        # main job).
        import importlib

        # (by module path: the attribute deepspeed.comm.torch is the torch package itself)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    backend = get_accelerator().communication_backend_name()
    if os.environ.get("WORLD_SIZE") == "1" and not dist.is_initialized():
        # one process: an in-memory store instead of a TCP rendezvous store listening on
        # every interface
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        device = torch.device("cpu")
    else:
        acc.set_device(local_rank)
        device = torch.device(acc.device_name(local_rank))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def leave_process_group() -> None:
    """Several ranks: tear the process group down before the interpreter exits (gloo's threads left
    running at exit abort the process, "terminate called without an active exception", exit -6,
    after its one line was printed). One process keeps its in-memory group (a caller in the same
    process may train again)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
