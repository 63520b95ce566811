"""Process-group setup for the DeepSpeed engine, with or without a launcher (the collectives a run
makes are in vlm.train.collectives).

A single `vlm train` needs no launcher: the rendezvous variables a launcher would set are filled
in (rank 0 of 1, a free local port). Under `deepspeed`/`torchrun` they are already set and used
as they are.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configs.config import ConfigError


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


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[07-09,12],cpu3" -> "gpu07" (zero padding kept)."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head.strip()
    prefix, rest = head.split("[", 1)
    first = rest.split("]", 1)[0].split(",")[0].split("-")[0]
    return prefix.strip() + first


def _slurm_int(env: dict[str, str], name: str, default: str | None = None) -> int:
    """SLURM variable `name` as a non-negative integer; ConfigError (one line) naming it where it is
    missing or not a number."""
    text = env.get(name, default)
    if text is None:
        raise ConfigError(f"SLURM variable {name} is not set: start every task with srun")
    if not text.strip().isdigit():
        raise ConfigError(f"SLURM variable {name}={text!r} is not a non-negative integer")
    return int(text)


def slurm_port(env: dict[str, str]) -> int:
    """The rendezvous port of a job step (MASTER_PORT, where set, wins): from the job id and the
    step id, so that two jobs on one node, or two srun steps of one job, do not share one (one
    would die with EADDRINUSE). Ports 20000-59999, above the registered services most nodes run
    and below Linux's ephemeral range (32768-60999 overlaps it, as torchrun's own choice does)."""
    job = _slurm_int(env, "SLURM_JOB_ID", "0")
    step = _slurm_int(env, "SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    return 20000 + (job * 7 + step) % 40000


def slurm_rank_env(env: dict[str, str]) -> dict[str, str] | None:
    """The torch.distributed variables of a process SLURM started as one task of several (`srun`,
    no launcher of its own), as Lightning reads them: its rank among the step's tasks, their number,
    its rank on its node, the first node of the job as the rendezvous host and a port derived from the
    job and step ids (MASTER_ADDR / MASTER_PORT, where set, win). None where SLURM started no
    several tasks. ConfigError (one line) for a multi-task allocation whose process srun did not
    start (it would wait for peers that never come), for a task number outside the step's tasks,
    and for a SLURM variable that is missing or not a number."""
    name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    tasks = _slurm_int(env, name, "1")
    if tasks <= 1:
        return None
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        raise ConfigError(
            f"SLURM allocated {tasks} tasks but this process was not started by srun (no "
            "SLURM_STEP_ID): start every task with `srun vlm train ...`, or one torchrun per node "
            "(configs/slurm/train.sbatch); a single process needs WORLD_SIZE=1"
        )
    rank = _slurm_int(env, "SLURM_PROCID")
    if rank >= tasks:
        raise ConfigError(
            f"SLURM_PROCID={rank} is not one of the step's {tasks} tasks ({name}={tasks}): "
            "start every task with srun, which sets both"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": str(_slurm_int(env, "SLURM_LOCALID", "0")),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": env.get("MASTER_PORT") or str(slurm_port(env)),
    }


def fill_launcher_env() -> None:
    """Set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT where no launcher did: from SLURM's
    variables for a task `srun` started (slurm_rank_env), else as one process."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            slurm_rank_env(os.environ) or dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        )
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def quiet_deepspeed() -> None:
    """DeepSpeed logs every config key at INFO; keep warnings and errors only."""
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    for h in ds_logger.handlers:
        h.setLevel(logging.WARNING)


def skip_deepspeed_shm_build() -> None:
    """One process has nothing to all-reduce: DeepSpeed's torch backend would still JIT-compile its
    CPU shared-memory collective as it starts (about a minute on a fresh machine, before the first
    step of the README's main job). The builder it calls, the module-level
    `deepspeed.comm.torch.build_shm_op`, is replaced by one that builds nothing: a private hook
    (tests/test_deepspeed_internals.py pins the DeepSpeed version this was written for)."""
    import importlib

    # (by module path: the attribute deepspeed.comm.torch is the torch package itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class StartupFailed(Exception):
    """The ranks did not all meet (a peer that never started, a wrong MASTER_ADDR) within the
    timeout, or a signal asked this rank to stop while it waited: one line to print, and the exit
    code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _rendezvous(join, timeout_s: float, stop) -> None:
    """Run `join` (the process group's rendezvous) so that a wait for peers ends: after
    `timeout_s` (torch's store raises then) or, at once, when `stop` (a StopFlag) is set by a
    SIGTERM / SIGINT. torch waits for peers inside C++, where Python runs no signal handler, so
    the wait runs in a thread and this (main) thread polls."""
    box: dict = {}

    def target():
        try:
            join()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e

    thread = threading.Thread(target=target, name="vlm-rendezvous", daemon=True)
    thread.start()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    who = f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}"
    while thread.is_alive():
        thread.join(0.2)
        if stop is not None and stop.requested:
            raise StartupFailed(
                f"vlm train: {who} stopped by {stop.name} while waiting for the other ranks at "
                f"{where}",
                stop.code,
            )
    error = box.get("error")
    if error is not None:
        raise StartupFailed(
            f"vlm train: {who}: the ranks did not all meet at {where} within "
            f"parallel.timeout_s={timeout_s:g} s (a rank that never started, or another "
            f"MASTER_ADDR / MASTER_PORT): {str(error).splitlines()[0]}",
            1,
        )


def init_distributed(timeout_s: float | None = None, stop=None) -> DistInfo:
    """Initialise the process group through DeepSpeed (gloo on CPU, nccl on GPU) and return who we
    are. `timeout_s` (parallel.timeout_s) bounds the start-up's wait for the other ranks and every
    collective after it; StartupFailed (one line) when the ranks do not meet in time or `stop` is
    set while waiting (None: parallel.timeout_s's default)."""
    if timeout_s is None:
        from vlm.train.config import ParallelConfig

        timeout_s = ParallelConfig().timeout_s
    fill_launcher_env()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    quiet_deepspeed()
    if os.environ.get("WORLD_SIZE") == "1":
        skip_deepspeed_shm_build()
    backend = get_accelerator().communication_backend_name()
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("WORLD_SIZE") == "1" and not dist.is_initialized():
        # one process: an in-memory store instead of a TCP rendezvous store listening on
        # every interface
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    _rendezvous(
        lambda: deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout),
        timeout_s,
        stop,
    )
    default_group_timeout(timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        device = torch.device("cpu")
    else:
        acc.set_device(local_rank)
        device = torch.device(acc.device_name(local_rank))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def default_group_timeout(timeout: datetime.timedelta) -> None:
    """Every process group made after this call waits `timeout` in a collective, not torch's default
    30 minutes: DeepSpeed makes its own groups without one (its clone of the world, which reduces the
    gradients; its expert groups), and a rank stalled in one of them would hang the job past
    parallel.timeout_s. torch reads the default from this module global when a group is made without
    a timeout (tests/test_timeouts.py pins the torch version this was written for)."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


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


@dataclass(frozen=True)
class ProcessGroups:
    """A running job's process groups for this rank (vlm.train.layout.ParallelLayout says which
    ranks each holds). None where the group would hold this rank alone."""

    sequence: object | None = None  # the ranks sharing this rank's rows
    expert: object | None = None  # the ranks sharing this rank's MoE layers' experts
    expert_name: str = ""  # DeepSpeed's name of the expert groups (its parameters' group_name)


def make_groups(layout) -> ProcessGroups:
    """Every process group `layout` needs, made once, in the same order on every rank (torch asks
    every rank to take part in making each group, its own or not). The expert groups are
    DeepSpeed's own (its MoE support finds them by name when it reduces expert gradients and
    partitions them): `deepspeed_expert_groups` makes them and checks that DeepSpeed put this
    rank where the layout does."""
    sequence = None
    if layout.sequence > 1:
        for ranks in layout.sequence_groups():
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                sequence = group
    expert, name = None, ""
    if layout.expert > 1:
        name, expert = deepspeed_expert_groups(layout)
    return ProcessGroups(sequence=sequence, expert=expert, expert_name=name)


def deepspeed_expert_groups(layout) -> tuple[str, object]:
    """DeepSpeed's expert-parallel and expert-data-parallel groups for `layout.expert` ranks,
    through its private group API (DeepSpeed offers no public way to make them outside its own MoE
    layer, which our layers are not; tests/test_parallel_layout.py pins the DeepSpeed version this
    was written for). Its legacy layout is the project's: consecutive ranks share a layer's
    experts, ranks r = r' mod P hold the same shard. Returns (the groups' name, this rank's
    expert-parallel group)."""
    from deepspeed.utils import groups

    name = f"ep_size_{layout.expert}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(layout.expert)
    ranks = list(groups._get_expert_parallel_group_ranks(name))
    mine = next(g for g in layout.expert_groups() if layout.rank in g)
    edp = dist.get_world_size(group=groups._get_expert_data_parallel_group(name))
    if ranks != mine or edp != layout.expert_replicas:
        raise RuntimeError(
            f"DeepSpeed put rank {layout.rank} in expert group {ranks} ({edp} replicas); the "
            f"layout says {mine} ({layout.expert_replicas}): its group layout changed"
        )
    return name, groups._get_expert_parallel_group(name)


# ---------------------------------------------------------------- a rank that stalls
def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective (or the store behind it) giving up on a peer: gloo's "Timed
    out waiting ... for recv", "Application timeout caused pair closure", NCCL's watchdog's
    "Watchdog caught collective operation timeout", the store's "Timed out after ... waiting"."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "timed out" in text or "timeout" in text or "pair closure" in text
    )


def _default_store():
    """The job's rendezvous store (torch keeps it with the default group; no public accessor)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def who_fell_behind(grace_s: float) -> tuple[list[int] | None, bool]:
    """After this rank's collective timed out: the ranks that did not time out too, and whether
    this rank is the one to report it (the lowest rank that did). Every rank stuck in the
    collective times out within moments of the others and says so in the job's store; a rank that
    never says so within `grace_s` is the one they all waited for (stopped, hung, dead). (None,
    True) where the store cannot be reached (it lives in rank 0's process: rank 0 is then the one
    that stalled, or is gone)."""
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        store = _default_store()
        store.set(f"vlm/timed_out/{rank}", "1")
        time.sleep(grace_s)
        heard = [store.check([f"vlm/timed_out/{r}"]) for r in range(world)]
    except Exception:  # noqa: BLE001 - the store is gone with its rank: say what is known
        return None, True
    behind = [r for r, h in enumerate(heard) if not h]
    return behind, rank == min(r for r, h in enumerate(heard) if h)


def timeout_line(timeout_s: float, behind: list[int] | None) -> str:
    who = (
        "the rank(s) it waited for could not be told (rank 0, which holds the job's store, is gone)"
        if behind is None
        else "every rank reached it"  # a collective that is itself slower than the timeout
        if not behind
        else f"rank(s) {', '.join(map(str, behind[:8]))}{' ...' if len(behind) > 8 else ''} "
        "did not reach it (stopped, hung or dead)"
    )
    return (
        f"vlm train: a collective waited more than parallel.timeout_s={timeout_s:g} s: {who}; "
        "ending the job on every rank (the last checkpoint is the resume point)"
    )
