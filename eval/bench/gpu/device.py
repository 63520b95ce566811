"""The device `vlm bench gpu` runs on (CUDA when there is one, else the CPU under --smoke) and its few device calls."""

from __future__ import annotations

import gc
import importlib.util
import platform
from collections.abc import Callable

import torch

from eval.bench.gpu.devices import peak_bf16


class Device:
    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def step_peak_bytes(self, fn: Callable[[], object]) -> int | None:
        """What `fn` adds to the allocated memory at its peak (bytes); None without CUDA's allocator statistics."""
        if not self.cuda:
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        fn()
        self.sync()
        return torch.cuda.max_memory_allocated(self.device) - before

    def info(self) -> dict:
        """The JSON's `gpu` record: the device, the software that runs on it, and the peak its MFU is taken of."""
        base = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": importlib.util.find_spec("triton") is not None,
            "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        }
        if not self.cuda:
            return {
                **base,
                "device": "cpu",
                "name": platform.processor() or platform.machine(),
                "peak": None,
                "peak_note": "no bf16 peak for a CPU: MFU is null",
            }
        i = self.device.index
        name = torch.cuda.get_device_name(i)
        props = torch.cuda.get_device_properties(i)
        peak = peak_bf16(name)
        note = (
            f"peak: {peak['device']} {peak['tflops']:g} TFLOP/s dense bf16 "
            f"(eval/bench/gpu/devices.py{', approximate' if peak['approximate'] else ''})"
            if peak
            else f"device {name!r} is not in eval/bench/gpu/devices.py's table: MFU is null"
        )
        return {
            **base,
            "device": "cuda",
            "name": name,
            "capability": list(torch.cuda.get_device_capability(i)),
            "memory_GiB": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
            "cudnn": torch.backends.cudnn.version(),
            "peak": peak,
            "peak_note": note,
        }
