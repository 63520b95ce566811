"""Kernel launches per step. CUDA: the device kernels torch.profiler records, and the host
synchronisations. CPU (--smoke): eager steps count the operators they dispatch
(eval.bench.common.count_operators, the project's one definition); a compiled step cannot run under
that dispatch mode, so it counts the profiler's aten leaf ops, which include views: on a CPU the two
are not comparable (eager against compiled is a CUDA figure)."""

from __future__ import annotations

from collections.abc import Callable

from eval.bench import common
from eval.bench.gpu.device import Device

KERNELS = "CUDA kernels per step"
ATEN_LEAVES = "aten leaf ops per step (CPU profiler, views included: a compiled step runs under no dispatch mode)"
HOST_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def launch_counts(events, cuda: bool, steps: int) -> dict:
    """Per-step counts from torch.profiler events. CUDA: kernels (device activities of type kernel),
    memcpys, and host synchronisations (HOST_SYNCS calls, less the one that ends the profiled
    region). CPU: aten ops with no aten op inside them (the ops that run a kernel)."""
    from torch.autograd import DeviceType

    if not cuda:
        aten = [
            e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
        ]
        leaves = sum(not any(c.name.startswith("aten::") for c in e.cpu_children) for e in aten)
        return {"metric": ATEN_LEAVES, "per_step": leaves / steps}
    kinds = [_kind(e) for e in events if e.device_type == DeviceType.CUDA]
    kernels = kinds.count("kernel")
    syncs = sum(e.device_type == DeviceType.CPU and e.name in HOST_SYNCS for e in events)
    out = {
        "metric": KERNELS,
        "per_step": kernels / steps,
        "memcpy_per_step": kinds.count("gpu_memcpy") / steps,
        "host_syncs_per_step": max(0, syncs - 1) / steps,
    }
    if not kernels:
        out.update(
            per_step=None,
            reason="the profiler recorded no CUDA kernel (CUPTI activity tracing unavailable?)",
        )
    return out


def _kind(e) -> str:
    """A device event's activity type; older profilers give none, so it is read off the name."""
    a = getattr(e, "activity_type", None)
    if a:
        return a
    n = e.name
    return (
        "gpu_memcpy"
        if n.startswith("Memcpy")
        else "gpu_memset"
        if n.startswith("Memset")
        else "cuda_sync"
        if "Sync" in n
        else "kernel"
    )


def count_launches(dev: Device, fn: Callable[[], object], steps: int, compiled: bool) -> dict:
    """Launches per step of `fn()`, which runs `steps` steps."""
    if not dev.cuda and not compiled:
        return {"metric": common.OPERATORS_METRIC, "per_step": common.count_operators(fn) / steps}
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    dev.sync()
    with profile(activities=acts) as prof:
        fn()
        dev.sync()
    return launch_counts(prof.events(), dev.cuda, steps)


def repeated(fn: Callable[[], object], calls: int) -> tuple[Callable[[], None], int]:
    """`calls` calls of a one-step `fn` as one counted call: (the call, its steps)."""

    def run():
        for _ in range(calls):
            fn()

    return run, calls
