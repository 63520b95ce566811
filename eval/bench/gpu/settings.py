"""What `vlm bench gpu` measures in each mode (full, quick, smoke), and the time budget that bounds a run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PART = "gpu"


@dataclass
class Settings:
    name: str = "full"
    # its `model` section is the LLM measured (relative to the project root)
    config: str = "configs/gpu.yaml"
    tiny: bool = False  # smoke: the same structure at toy width
    # R the reallocations are matched at and boundaries are forced at
    ratio: float = 2.0
    dtype: str = "bfloat16"
    train_rows: int = 2
    train_len: int = 4096
    train_repeats: int = 5
    warmup: int = 2
    prefill_lens: list[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768])
    prefill_repeats: int = 3
    # no new length starts after this long in the section (compiles need time)
    prefill_max_s: float = 90.0
    decode_context: int = 2048
    decode_batches: list[int] = field(default_factory=lambda: [1, 8])
    decode_steps: int = 16  # decode steps per timed round
    decode_repeats: int = 3
    decode_max_s: float = 60.0  # no new batch size starts after this long in the section
    memory_ac: tuple[str, ...] = ("none", "selective")
    launch_steps: int = 1  # steps profiled for kernel counts
    compile_backend: str = "inductor"
    # training steps compiled first: the baseline, then by eager speed
    compile_train: int = 2
    # the others compiled after the decode step's compile, if time is left
    compile_train_rest: bool = True
    # candidates whose decode step is compiled: the fastest ConceptMoE, baseline
    compile_decode: int = 2
    # the sections' time budget (the whole command stays under 8 minutes)
    budget_s: float = 400.0
    # CUDA: past this (a compile that does not end), write the JSON and exit 3
    hard_stop_s: float | None = 450.0
    compile_reserve_s: float = 90.0  # a training compile starts only with this much budget left
    decode_compile_reserve_s: float = 120.0
    # where the JSON is written after every section (the CLI sets it)
    out: str | None = None


SETTINGS = {
    "full": Settings(),
    "quick": Settings(
        name="quick",
        train_repeats=3,
        prefill_lens=[4096, 16384],
        decode_steps=8,
        decode_repeats=2,
        compile_train=1,
        compile_train_rest=False,
        compile_decode=1,
        budget_s=240.0,
        hard_stop_s=270.0,
    ),
    # aot_eager: Dynamo's tracing, fullgraph checks and AOT autograd without inductor's code
    # generation, which takes minutes on 2 CPU cores
    "smoke": Settings(
        name="smoke",
        tiny=True,
        train_len=128,
        train_repeats=2,
        warmup=1,
        prefill_lens=[64, 128],
        prefill_repeats=2,
        decode_context=32,
        decode_steps=3,
        decode_repeats=2,
        launch_steps=1,
        compile_backend="aot_eager",
        compile_train=2,
        compile_train_rest=False,
        compile_decode=1,
        budget_s=300.0,
        hard_stop_s=None,
        compile_reserve_s=0.0,
        decode_compile_reserve_s=0.0,
    ),
}


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.perf_counter()

    def used(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.used()
