"""Host batches to the device, ahead of the step that uses them, and the time the step waited for
data.

On CUDA each micro-batch is copied into pinned host memory and sent with `non_blocking` copies on a
side stream as soon as the loader hands it over, `data.prefetch_to_device` micro-batches ahead, so
the transfer runs while the current step computes; the step's stream waits for the copy only when it
takes the batch. On the CPU the same code runs synchronously (there is nothing to overlap).

`DeviceFeed.take_wait()` is the time spent waiting for the loader since it was last read: the
trainer reports it per step as `data/wait_s` and its share of the step as `data/wait_share`, so a
loader that cannot keep up shows in metrics.jsonl and in the log line.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import fields
from typing import Iterable, Iterator

import torch

from configs.batch import PackedBatch


def prepare(batch: PackedBatch, device: torch.device, float_dtype: torch.dtype) -> PackedBatch:
    """The batch on `device` (a no-op for one already there), normalised float pixels in
    `float_dtype`. uint8 pixels stay uint8: the vision tower normalises them on the device."""
    batch = batch.to(device)
    pixels = batch.pixel_patches
    if pixels is not None and pixels.is_floating_point() and pixels.dtype != float_dtype:
        batch.pixel_patches = pixels.to(float_dtype)
    return batch


def _pinned_copy(batch: PackedBatch, device: torch.device) -> PackedBatch:
    """Pinned host copies of the batch's tensors, sent with non_blocking copies on the current
    stream."""
    out = {}
    for f in fields(batch):
        t = getattr(batch, f.name)
        out[f.name] = None if t is None else t.pin_memory().to(device, non_blocking=True)
    return PackedBatch(**out)


class DeviceFeed:
    """Iterates `batches` (host PackedBatches) as device batches, `depth` ahead on CUDA."""

    def __init__(
        self,
        batches: Iterable[PackedBatch],
        device: torch.device | str,
        float_dtype: torch.dtype = torch.float32,
        depth: int = 2,
    ):
        self.device = torch.device(device)
        self.float_dtype = float_dtype
        self.batches: Iterator[PackedBatch] = iter(batches)
        self.cuda = self.device.type == "cuda"
        self.depth = max(int(depth), 0) if self.cuda else 0
        self.stream = torch.cuda.Stream(self.device) if self.cuda and self.depth else None
        self.ready: deque = deque()  # (device batch, its copy's event)
        self.exhausted = False
        self.waited = 0.0

    def _next_host(self) -> PackedBatch | None:
        t0 = time.perf_counter()
        try:
            return next(self.batches)
        except StopIteration:
            self.exhausted = True
            return None
        finally:
            self.waited += time.perf_counter() - t0

    def _send(self, batch: PackedBatch) -> None:
        with torch.cuda.stream(self.stream):
            moved = _pinned_copy(batch, self.device)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.ready.append((moved, event))

    def __iter__(self) -> "DeviceFeed":
        return self

    def __next__(self) -> PackedBatch:
        if self.stream is None:
            batch = self._next_host()
            if batch is None:
                raise StopIteration
            return prepare(batch, self.device, self.float_dtype)
        while len(self.ready) <= self.depth and not self.exhausted:
            batch = self._next_host()
            if batch is not None:
                self._send(batch)
        if not self.ready:
            raise StopIteration
        batch, event = self.ready.popleft()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for f in fields(batch):
            t = getattr(batch, f.name)
            if t is not None:
                # made on the side stream, used on this one: the allocator must not reuse it early
                t.record_stream(current)
        return prepare(batch, self.device, self.float_dtype)

    def take_wait(self) -> float:
        """Seconds spent waiting for the loader since the last call."""
        waited, self.waited = self.waited, 0.0
        return waited
