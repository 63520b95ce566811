"""Live tensor memory, measured: every storage torch allocates while a `LiveBytes` is active is
counted from its allocation to its release, with the peak of their sum.

It is a TorchDispatchMode, so it sees every operator torch dispatches on this thread (factory
functions, copies, the autograd engine's backward ops, DeepSpeed's buffers) on any device, the
meta device included: there a storage has a size and no memory, which is how `vlm plan` measures a
model's forward and backward at sizes no machine holds. A storage is counted once (views share it)
and only by the operator that made it (an output whose storage is one of the operator's inputs,
or was made before the mode was entered, is a view or an in-place result, not an allocation). A
tensor subclass that wraps others (torch's AsyncCollectiveTensor, which the functional collectives
return around their output) holds no memory of its own: its storage has a size and no data, and
only the tensors it wraps, counted when they were made, are. A storage is released when its last
tensor goes (a weak reference's callback).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in `tree` that hold memory: a wrapper subclass's inner tensors in its place."""
    out = []
    for t in tree_flatten(tree)[0]:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            out += _tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        else:
            out.append(t)
    return out


def _storages(tree) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in _tensors(tree)]


class LiveBytes(TorchDispatchMode):
    """`now`: bytes of the storages allocated on `device` (a device type: "cpu", "cuda", "meta")
    since entering and not yet released; `peak`: the most `now` has been since entering or the
    last `reset_peak`. Storages on other devices are not counted (DeepSpeed makes meta tensors to
    describe shapes). `ignore(tensors)`: storages that are not to count."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.now = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._ignored: set[int] = set()

    def reset_peak(self) -> None:
        self.peak = self.now

    def ignore(self, tensors) -> None:
        for st in _storages(list(tensors)):
            self._ignored.add(st._cdata)

    def _release(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {st._cdata for st in _storages((args, kwargs))}
        for st in _storages(out):
            key = st._cdata
            if (
                st.device.type != self.device
                or key in seen
                or key in self._live
                or key in self._ignored
            ):
                continue
            seen.add(key)
            size = st.nbytes()
            self._live[key] = size
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._release, key)
        return out
