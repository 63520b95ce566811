"""`vlm bench checkpoint`: what one rank's share of a checkpoint costs the step and the resume
(vlm.train.ckpt_save, vlm.train.ckpt_resume), against the synchronous save with a rank-0 SHA-256
pass it replaces (issue 49 item 2).

A rank's share is its parameters' fp32 weights and two Adam moments (12 bytes a parameter; ZeRO
partitions them, so a rank of N holds 1/N of the model's). For each share size it times, through
the trainer's own Checkpointer on an engine that writes like DeepSpeed's (every file through its
checkpoint engine's `save`):
- `staged (step blocked)`: the state copied to host memory; all the step waits for now;
- `written + hashed (background)`: the writer thread's torch.save, fsync and SHA-256 of the share;
- `verified (resume)`: a resume's read-back and SHA-256 of the share (each rank its own);
- `synchronous save + hash pass` (the baseline): the write, then a second pass reading and hashing
  every byte, as rank 0 did for the whole checkpoint before (at N ranks it hashed N shares).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eval.bench import common

PART = "checkpoint"
BASELINE = "synchronous save + hash pass"


@dataclass
class Settings:
    params: list[int] = field(default_factory=lambda: [10_000_000, 50_000_000])  # per rank
    repeats: int = 3


SETTINGS = {
    "full": Settings(),
    "quick": Settings(params=[10_000_000], repeats=2),
    "smoke": Settings(params=[100_000], repeats=2),
}


class _Engine:
    """DeepSpeed's engine as the save protocol sees it: save_checkpoint writes the module and the
    optimizer state through `checkpoint_engine.save`."""

    class _Writer:
        zipfile_serialization = True

        def save(self, state_dict, path):
            torch.save(state_dict, path)

    def __init__(self, params: int):
        self.module = torch.nn.Linear(params, 1, bias=False)
        self.optimizer = None
        self.moments = [torch.randn(params), torch.randn(params)]
        self.checkpoint_engine = self._Writer()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        d = Path(save_dir, tag)
        d.mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save(
            {"module": self.module.state_dict(), **client_state}, str(d / "model_states.pt")
        )
        self.checkpoint_engine.save(
            {"exp_avg": self.moments[0], "exp_avg_sq": self.moments[1]}, str(d / "optim_states.pt")
        )


def _one(params: int, root: Path) -> dict[str, float]:
    from vlm.train.ckpt_manifest import damaged_share, sha256_of
    from vlm.train.ckpt_save import Checkpointer
    from vlm.train.layout import ParallelLayout

    engine = _Engine(params)
    cp = Checkpointer(engine, root / "bg", 0, 1, ParallelLayout(1, 0))
    t0 = time.perf_counter()
    cp.save(1, {"step": 1})
    staged = time.perf_counter() - t0
    cp.wait()
    m = cp.take_metrics()
    ckpt = root / "bg" / "step_00000001"
    t0 = time.perf_counter()
    assert damaged_share(ckpt) is None
    verified = time.perf_counter() - t0
    # before: the step waited for the write, then rank 0 read and hashed every file again
    sync = root / "sync"
    sync.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    for name, obj in (
        ("model_states.pt", {"module": engine.module.state_dict()}),
        ("optim_states.pt", {"exp_avg": engine.moments[0], "exp_avg_sq": engine.moments[1]}),
    ):
        with open(sync / name, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
    for p in sync.iterdir():
        sha256_of(p)
    before = time.perf_counter() - t0
    return {
        "staged (step blocked)": staged,
        "written + hashed (background)": m["checkpoint/write_s"],
        "verified (resume)": verified,
        BASELINE: before,
    }


def run(s: Settings, log=print) -> dict:
    rows = []
    for params in s.params:
        seconds: dict[str, list[float]] = {}
        for _ in range(s.repeats):
            with tempfile.TemporaryDirectory() as d:
                for k, v in _one(params, Path(d)).items():
                    seconds.setdefault(k, []).append(v)
        gb = params * 12 / 1e9
        setting = {"params": params, "share_GB": round(gb, 3)}
        extra = {n: {"GB_per_s": gb / min(v)} for n, v in seconds.items()}
        rows += common.rows(seconds, BASELINE, setting, "seconds per save", "s", extra)
        log(f"  {params:,} parameters per rank: done")
    return common.result(PART, asdict(s), rows)


def plot(res: dict, path) -> None:
    common.plot(
        res,
        path,
        x="params",
        y="median",
        ylabel="seconds",
        title="one rank's share of a checkpoint: staged, written, verified",
    )
