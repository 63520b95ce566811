"""`vlm bench gpu`: one command that measures a GPU on `configs/gpu.yaml`'s LLM, in bf16, in
under 8 minutes.

What it measures (the MoE baseline, gpu.yaml's LLM with chunking off, against the FLOPs-matched
reallocations of `vlm.model.reallocate` at R = 2):
- train_eager: tokens/s and MFU of a training step (forward, backward, AdamW) on rows x T tokens,
  one document per row, boundaries forced at T/R (eval/bench/model.py's `boundaries_at_ratio`).
- launches_eager: kernels launched per training step (torch.profiler's CUDA kernel activities; on
  CPU, the operators per step of eval.bench.common.count_operators as a proxy) and the host
  synchronisations per step (cudaStreamSynchronize / EventSynchronize).
- prefill: forward tokens/s under no_grad in eval mode at 4K-32K tokens (one row), boundaries forced
  at T/R and learned (the router's own p >= 0.5 on these random tokens; its realized ratio is
  reported with the row).
- decode_eager: ms per `model.step` at batch 1 and 8 after a 2K-token prompt
  (`model.prefill`), boundaries firing at rate 1/R (forced, as eval/bench/decode.py does); and
  the kernels per decode step.
- memory: the peak memory a training step adds (torch.cuda.max_memory_allocated over the step, minus
  what was allocated before it: activations, gradients, temporaries), per token, with
  `activation_checkpoint` none and selective. CPU: null, with the reason.
- train_compiled: the training step with `vlm.model.compile.compile_blocks` (per-block, fullgraph)
  for the baseline and the fastest reallocation: tokens/s, MFU and kernels per step; a candidate
  that does not compile is listed under `unavailable` with the reason (and the model line that
  raised it).
- decode_compiled: the decode step compiled with fullgraph (`compiled_step`: `model.decode_step`,
  after the eager `cache.make_room(1)` that `model.step` does first), ms per step: the fastest
  ConceptMoE, then the baseline, batch 8 before batch 1.
- train_compiled_rest: the other reallocations' training steps compiled, when time is left.
- expert_exchange: expert parallelism's token exchange on one MoE layer of the LLM
  (eval/bench/alltoall.py) at train_rows x train_len tokens: one process has no peer, so a loopback
  of 2 expert ranks times the packing, sorting and unpacking around the all-to-all, and the rows
  state the bytes 2 ranks would send; the all-to-all between GPUs and the exchanged layer's step:
  `torchrun --nproc_per_node N -m eval.bench alltoall`.
- targets: the issue's goals as PASS / FAIL / n/a lines next to the figures (never assertions), and
  eager against compiled for every step measured both ways.

MFU = model FLOPs per token x tokens/s / the device's dense bf16 peak (devices.py). Model FLOPs come
from `vlm.model.flops.flops_per_token(cfg, R)['total']` (the paper's convention: every matmul a
token goes through with its activated parameters, attention map excluded; the concept model at 1/R);
a training step counts 3x the forward. `mfu_incl_attn_map` adds `attention_map_flops` (QK^T and AV
of each row's causal T x T map). Both are *model* FLOPs: the static concept capacity's padding and
any recomputation do not count.

A time budget (Settings.budget_s) bounds the run: each section checks what is left before it starts
(and a compile starts only with `compile_reserve_s` left), skips with a note when it runs out, and
the JSON is written after every section, so a run stopped from outside still leaves its results. On
CUDA a hard stop (Settings.hard_stop_s) ends a run whose step does not return (a compile that never
ends): the JSON is written, the section marked `killed`, and the process exits with 3. `--smoke`
runs every section at toy width on whatever device there is (CPU here), compiling with the aot_eager
backend (Dynamo's tracing, fullgraph checks and AOT autograd, without inductor's code generation,
which takes minutes on 2 CPU cores), so a test can check the plumbing; its figures say nothing.

The files: settings.py (modes, budget), device.py and devices.py (the device and its peak), rig.py
(models, batches, steps), compiling.py, launches.py, state.py (what the sections share: the result,
the section runner, the hard stop), one file per section group (train, prefill, decode, memory,
targets) and report.py (table, figure).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from eval.bench import common
from eval.bench.gpu import decode, memory, prefill, targets, train
from eval.bench.gpu.device import Device
from eval.bench.gpu.launches import launch_counts
from eval.bench.gpu.report import plot, table
from eval.bench.gpu.settings import PART, SETTINGS, Settings
from eval.bench.gpu.state import Run

__all__ = [
    "PART",
    "SECTIONS",
    "SETTINGS",
    "Device",
    "Settings",
    "launch_counts",
    "plot",
    "run",
    "table",
]


def _device(r: Run) -> None:
    g = r.res["gpu"]
    r.log(f"  gpu: {g['name']} ({g['device']}), {g['peak_note']}")
    if not r.peak:
        r.res["notes"].append(g["peak_note"])
    if not r.dev.cuda:
        r.res["notes"].append(
            f"launches on a CPU: eager steps count {common.OPERATORS_METRIC} (count_operators); "
            "compiled ones cannot run under its dispatch mode and count the profiler's aten "
            "leaf ops, views included: compare eager and compiled launches on CUDA"
        )


def _expert_exchange(r: Run) -> None:
    from eval.bench import alltoall
    from eval.bench.gpu.rig import llm_config
    from vlm.model.expert_parallel import LoopbackExchange

    s = alltoall.Settings(
        tokens=[r.s.train_rows * r.s.train_len], repeats=r.s.train_repeats, warmup=r.s.warmup
    )
    cfg = llm_config(r.s)
    moe = replace(cfg.moe, loss_free_balancing=False)
    layer = alltoall.Layer(r.s.config, "moe", moe, cfg.hidden_size, 1.0)
    skipped: dict[str, str] = {}
    rows = alltoall.measure(
        s,
        layer,
        2,
        lambda P, cf, variable: LoopbackExchange(P, 0, cf, variable),
        0,
        1,
        r.dev.device,
        None,
        r.log,
        skipped,
    )
    for row in rows:
        row["setting"]["section"] = "expert_exchange"
    r.res["rows"] += rows
    r.res["notes"].append(f"expert_exchange: {alltoall.LOOPBACK_NOTE}")
    r.dev.free()


# in order: two training compiles before the decode step's, the rest of them after it with what time
# is left
_MEASURED = (
    ("device", _device),
    ("train_eager", train.eager),
    ("launches_eager", train.launches_eager),
    ("prefill", prefill.prefill),
    ("decode_eager", decode.eager),
    ("memory", memory.memory),
    ("train_compiled", train.compiled),
    ("decode_compiled", decode.compiled),
    ("expert_exchange", _expert_exchange),
    ("train_compiled_rest", train.compiled_rest),
)
SECTIONS = tuple(name for name, _ in _MEASURED) + ("targets",)


def run(s: Settings, log=print) -> dict:
    torch.manual_seed(0)
    r = Run(s, log)
    for name, fn in _MEASURED:
        r.section(name, fn)
    # summaries of whatever was measured, even past it
    r.section("targets", targets.summarise, budgeted=False)
    return r.close()
