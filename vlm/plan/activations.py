"""Activation memory of one micro-batch's forward and backward on one rank, measured by running the
model's own code on the meta device at the run's sizes.

Legend: B rows, T tokens, D width, N flat tokens or patches, P patches, Q query heads, J key/value
heads, d head width, A the planned expert exchange's (token, choice) slots, G the layer's experts
(Grove-grouped), L a rank's experts, S sent rows, R received rows.

The LLM is built on the meta device (its parameters have shapes and no memory) with the run's
width, depth, experts, dtype and activation checkpointing, its routed experts sharded as the run
shards them (`MoE.shard_experts` with a loopback exchange of the run's expert degree), and one
micro-batch of `rows x row_tokens / sequence` tokens goes forward, through the tiled loss, and
backward, while `LiveBytes` counts every tensor the code allocates (vlm.plan.tracker). Nothing is
computed and nothing is held, so a 90B model at 16K tokens per rank is measured in seconds on a
laptop. What the meta device cannot run is stood in for, and said here:

- the attention kernel keeps what flash attention keeps for its backward (q, k, v, its output, a
  float32 log-sum-exp per head and query; its backward a float32 dq accumulator), the kernel a GPU
  runs; CPU's per-document SDPA keeps the same. With sequence parallelism (S > 1) the Ulysses
  exchange's copies of q, k, v and the output are kept too (DeepSpeed's DistributedAttention
  exchanges sequence for heads around the kernel: the same bytes as the shard's own);
- the experts run the grouped-matmul path (a GPU's static shapes; the per-expert loop reads counts
  on the host), and the chunk module takes its static concept capacity (`chunk.capacity_slack`:
  what a GPU computes; an eager CPU run computes only the concepts its batch has, fewer);
- the variable-size expert exchange reads its blocks' sizes on the host, which the meta device
  has not: its round trip runs with the sizes the plan assumes (`PlannedExchange`: the rank sends
  its slots within the capacity and receives the rows planned for its experts), every buffer of
  it as the trainer's exchange makes them;
- the engine's gradient buffers that ZeRO 1-2 allocate during the backward (`gradient_buffers`:
  the reduce bucket with the first gradient, ZeRO-2's gradient partition at the bucket's first
  reduction) are counted from where the backward's gradients reach them, so its peak meets them
  only where they exist (not at the loss, where the activations are at their most);
- the row is one document (the shapes do not depend on the documents).

The vision tower reads its images' grids on the host, so it is measured on the CPU, with real
tensors at the config's sizes, on one and two images of `max_patches` patches, and scaled to the
images a rank's rows can hold (`vision_bytes`). Each figure says where it comes from (`source`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from unittest import mock

import torch
from torch import nn

from vlm.model.tiled_loss import tokens_per_tile
from vlm.plan.tracker import LiveBytes

MiB = 2**20


@dataclass
class ActivationMeasure:
    """One micro-batch of one rank, forward and backward."""

    rows: int
    row_tokens: int  # tokens of a row on this rank (row_tokens / sequence)
    held: dict[str, int]  # bytes each part holds at the end of the forward (kept for the backward)
    peak: int  # most bytes alive over the forward and backward (with `keep_gradients`, theirs too)
    # the same with the engine's gradient buffers where they exist (`gradient_buffers`)
    peak_with_gradient_buffers: int
    loss_tile_tokens: int
    loss_untiled: int  # the [T, V] logits' figure: bf16/fp32 logits, their fp32 copy, log-softmax
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.rows * self.row_tokens


# ---------------------------------------------------------------- the stand-ins
class _FlashKeeps(torch.autograd.Function):
    """The attention kernel as flash attention holds memory: it keeps q, k, v, its output and a
    float32 log-sum-exp per head and query; its backward makes dq, dk, dv and a float32 dq
    accumulator. With `exchange` the Ulysses all-to-all's copies are made and kept as well."""

    @staticmethod
    def forward(ctx, q_BQTd, k_BJTd, v_BJTd, exchange: bool):
        if exchange:  # sequence -> heads: the kernel's operands are new tensors of the same bytes
            q_BQTd, k_BJTd, v_BJTd = (torch.empty_like(t) for t in (q_BQTd, k_BJTd, v_BJTd))
        out_BQTd = torch.empty_like(q_BQTd)
        lse = q_BQTd.new_empty(q_BQTd.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q_BQTd, k_BJTd, v_BJTd, out_BQTd, lse)
        return torch.empty_like(out_BQTd) if exchange else out_BQTd.view_as(out_BQTd)

    @staticmethod
    def backward(ctx, g_BQTd):
        q_BQTd, k_BJTd, v_BJTd, _, _ = ctx.saved_tensors
        accum = torch.empty_like(q_BQTd, dtype=torch.float32)
        grads = [torch.empty_like(t) for t in (q_BQTd, k_BJTd, v_BJTd)]
        del accum
        return (*grads, None)


def _attend_keeping(sequence: int):
    def attend(q_BQTd, k_BJTd, v_BJTd, doc_BT, backend, doc_mask=None, causal=True, window=0):
        return _FlashKeeps.apply(q_BQTd, k_BJTd, v_BJTd, sequence > 1)

    return attend


@contextlib.contextmanager
def planning_kernels(sequence: int = 1):
    """Inside: the model's attention is `_FlashKeeps` (no T x T mask is built) and its experts take
    the grouped-matmul path, so that it runs on the meta device as a GPU runs it."""
    from vlm.model import attention, block, cross_attention, moe

    attend = _attend_keeping(sequence)
    with contextlib.ExitStack() as stack:
        for module in (attention, cross_attention):
            stack.enter_context(mock.patch.object(module, "attend", attend))
        for module in (block, cross_attention):
            stack.enter_context(mock.patch.object(module, "packed_mask", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(moe, "grouped_mm_available", lambda *a: True))
        yield


class _Exchanged(torch.autograd.Function):
    """An all-to-all's output of `rows` rows (a new tensor, as the collective's is); its backward,
    the reverse exchange, makes one of the input's rows."""

    @staticmethod
    def forward(ctx, x_SD, rows: int):
        ctx.shape = x_SD.shape
        return x_SD.new_empty((rows, *x_SD.shape[1:]))

    @staticmethod
    def backward(ctx, g_RD):
        return g_RD.new_empty(ctx.shape), None


def _even(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes that differ by at most one."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class PlannedExchange:
    """The variable-size exchange (vlm.model.expert_parallel.variable_round_trip) as the planner
    runs it, with no other rank and no host read: rank 0 of `size` sends its A slots within the
    capacity (min(A, P x C) rows) and receives `received` x A rows (None: the capacity's bound,
    P x C: every peer fills its block for this rank's experts), at most P x C. The collectives'
    outputs are new tensors of those rows; nothing is computed."""

    variable = True

    def __init__(self, size: int, capacity_factor: float | None, received: float | None):
        from vlm.model.expert_parallel import ExchangeTraffic

        self.size, self.rank, self.capacity_factor = size, 0, capacity_factor
        self.received = received
        self.traffic = ExchangeTraffic()

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def all_to_all_v(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return _Exchanged.apply(x, sum(recv))

    def common_slots(self, slots: int, device: torch.device) -> int:
        return slots

    def sizes(self, slots: int) -> tuple[int, int]:
        """(rows sent, rows received) of a layer whose rank has `slots` slots."""
        from vlm.model.expert_parallel import capacity

        bound = self.size * capacity(slots, self.size, self.capacity_factor)
        received = bound if self.received is None else math.ceil(self.received * slots)
        return min(slots, bound), min(received, bound)


def _planned_variable(slots, exchange: PlannedExchange, device: torch.device):
    """`plan_variable`'s answer for a `PlannedExchange`: its sizes, split evenly over the peers and
    the rank's local experts, with no host read."""
    from vlm.model.expert_parallel import VariablePlan

    P, A = exchange.size, slots.tok_A.shape[0]
    L = slots.counts_G.shape[0] // P
    S, R = exchange.sizes(A)
    got_PL = torch.tensor(_even(R, P * L), device=device).view(P, L)
    src_S = torch.arange(S, device=device)
    overflow = torch.zeros((), dtype=torch.long, device=device)
    return VariablePlan(_even(S, P), _even(R, P), src_S, got_PL, overflow)


@contextlib.contextmanager
def _planned_exchanges():
    """Inside: a layer whose exchange is a `PlannedExchange` takes its planned sizes."""
    from vlm.model import expert_parallel

    real = expert_parallel.plan_variable

    def plan_variable(slots, exchange, device):
        if isinstance(exchange, PlannedExchange):
            return _planned_variable(slots, exchange, device)
        return real(slots, exchange, device)

    with mock.patch.object(expert_parallel, "plan_variable", plan_variable):
        yield


class _GradientBuffers(LiveBytes):
    """`LiveBytes` that also follows the engine's gradient buffers, which appear as the backward
    makes gradients and stay to its end without being allocated here: `buffers` is a list of
    (elements, bytes), each buffer there once more than `elements` gradient elements have been
    made (0: with the first gradient). `peak_with_buffers`: the most of the live bytes and the
    buffers there at the time."""

    def __init__(self, device: str, buffers: list[tuple[int, int]]):
        super().__init__(device)
        self.pending = sorted(b for b in buffers if b[1])
        self.made = 0  # gradient elements
        self.extra = 0  # bytes of the buffers there
        self.peak_with_buffers = 0

    def gradient(self, p) -> None:
        """A post-accumulate-grad hook: `p`'s gradient was made."""
        self.made += p.numel()
        while self.pending and self.made > self.pending[0][0]:
            self.extra += self.pending.pop(0)[1]
        self.peak_with_buffers = max(self.peak_with_buffers, self.now + self.extra)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak_with_buffers = max(self.peak_with_buffers, self.now + self.extra)
        return out


# ---------------------------------------------------------------- the loss
def loss_tile_tokens(vocab: int, device: str, setting: int = 0) -> int:
    """Tokens per tile of the LM loss, by the loss's own rule (vlm.model.tiled_loss)."""
    return tokens_per_tile(vocab, torch.device(device), setting)


def untiled_loss_bytes(tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """What the [T, V] loss holds at its peak: the logits in the model's dtype, their float32 copy
    and the log-softmax cross-entropy keeps (float32), then its gradient (float32) in the backward
    while the log-softmax is still held."""
    b = torch.empty((), dtype=dtype).element_size()
    return tokens * vocab * (b + 4 + 4 + 4)


# ---------------------------------------------------------------- the LLM
def _frozen(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def measure_llm(
    model_cfg,
    *,
    rows: int,
    row_tokens: int,
    dtype: torch.dtype,
    expert: int = 1,
    capacity_factor: float | None = None,
    variable: bool = False,
    received: float | None = None,
    sequence: int = 1,
    device: str = "cuda",
    frozen: list[str] = (),
    tile_tokens: int = 0,
    on: str = "meta",
    keep_gradients: bool = False,
    gradient_buffers: list[tuple[int, int]] = (),
) -> ActivationMeasure:
    """The LLM's activations for one micro-batch of `rows` rows of `row_tokens` tokens (this
    rank's shard of each row) on the meta device. `expert`, `capacity_factor`: the experts split
    over that many ranks, C rows per peer (None: dropless, C = every slot); `variable`: the
    exchange sends each block at its real size (`PlannedExchange`, receiving `received` x the
    rank's slots, None: the capacity's P x C), else in static [P, C] buffers (parallel.exchange:
    static). `frozen`: module prefixes of the VLM ("lm.embed") whose
    parameters do not train. `device`: the device the run trains on (the loss's tile size). `on`:
    "meta", or "cpu" to run the same forward and backward with real tensors on the CPU's own kernels
    (small sizes: what the tests compare the meta figures with). `keep_gradients`: the parameters'
    gradients stay where the backward puts them and count (ZeRO 0-1 keep them whole from the
    backward to the step, and the backward's peak is met with those of the layers it has passed);
    else each is dropped as it is made (ZeRO 2-3 move it into their partitioned buffers, planned
    with the model states). `gradient_buffers`: (elements, bytes) of each buffer the engine
    allocates once the backward has made more than that many gradient elements and holds to its
    end (`peak_with_gradient_buffers` counts them)."""
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.expert_parallel import LoopbackExchange
    from vlm.model.moe import MoE

    meta = on == "meta"
    cfg = replace(model_cfg, attn_backend="sdpa" if meta else "auto", compile=False)
    B, T, V = rows, row_tokens, cfg.vocab_size
    with torch.device(on):
        lm = ConceptMoELM(cfg).to(dtype)
    lm.train()
    if expert > 1:
        for m in lm.modules():
            if isinstance(m, MoE):
                m.shard_experts(
                    PlannedExchange(expert, capacity_factor, received)
                    if variable
                    else LoopbackExchange(expert, 0, capacity_factor, variable=False)
                )
    live = _GradientBuffers(on, list(gradient_buffers))
    for name, p in lm.named_parameters():
        p.requires_grad_(not _frozen("lm." + name, list(frozen)))
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(live.gradient)
        if not keep_gradients:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tile = loss_tile_tokens(V, device, tile_tokens)

    parts = _Parts(lm, live)
    kernels = planning_kernels(sequence) if meta else contextlib.nullcontext()
    with kernels, _planned_exchanges(), live:
        with torch.device(on):
            ids_BT = torch.randint(0, V, (B, T))
            doc_BT = torch.zeros(B, T, dtype=torch.long)
            pos_BT = torch.arange(T).expand(B, T)
        x_BTD = lm.embed(ids_BT)
        out_BTD, chunks, stats = lm.hidden(x_BTD, doc_BT, pos_BT)
        with parts.part("final norm and loss"):
            h_ND = lm.norm(out_BTD).flatten(0, 1)
            tok_loss_N = lm.lm_head(h_ND, ids_BT.flatten(), tile)  # the tiled loss itself
            loss = tok_loss_N.sum()
            for s in stats:  # the router's loss terms, as the trainer's loss adds them
                for term in (s.balance, s.z):
                    if term is not None:
                        loss = loss + term
            if chunks is not None:
                loss = loss + chunks.p_BT.float().mean()  # the ratio loss reads p
        held = parts.close()
        loss.backward()
    notes = []
    if cfg.chunk.enabled and cfg.chunk.capacity_slack is None:
        notes.append("chunk.capacity_slack null: the concept model runs on every token's slot")
    return ActivationMeasure(
        rows=B,
        row_tokens=T,
        held=held,
        peak=live.peak,
        peak_with_gradient_buffers=max(live.peak, live.peak_with_buffers),
        loss_tile_tokens=tile,
        loss_untiled=untiled_loss_bytes(B * T, V, dtype),
        notes=notes,
    )


class _Parts:
    """Which part of the model holds what at the end of the forward: the bytes still alive that were
    allocated between each part's start and end (its kept tensors and its output, which the next
    part keeps as its input). Parts: the embedding, every layer (its attention and MoE apart too),
    the chunk module (its merge included), the dechunk (its smoothing included), the final norm and
    the loss; "other" is what runs between them (the stacks' rotary tables and contexts)."""

    def __init__(self, lm: nn.Module, live: LiveBytes):
        self.live, self.held, self.hooks, self.open = live, {}, [], True
        # under full checkpointing a layer keeps its input alone: its parts keep nothing apart
        self.sub = lm.activation_checkpoint != "full"
        self.start = live.now
        named = [("embedding", lm.embed)]
        for stack in ("encoder", "concept", "decoder"):
            for block in getattr(lm, stack):
                named += [(f"{stack} layers", block)]
                if self.sub:
                    named += [(f"{stack} attention", block.attn), (f"{stack} MoE", block.moe)]
        for label, module in named:
            self._hook(label, module)
        for label, owner, method in (
            ("chunk module", lm.chunker, "forward"),
            ("chunk module", lm.chunker, "merge"),
            ("dechunk", lm.dechunk, "forward"),
            ("dechunk", lm.dechunk, "smooth"),
        ):
            if owner is not None:
                self._wrap(label, owner, method)

    def _add(self, label: str, bytes_: int) -> None:
        if self.open:  # the backward's recomputation runs the layers again: not counted
            self.held[label] = self.held.get(label, 0) + bytes_

    def _hook(self, label, module):
        def pre(*a, **k):
            module._plan_start = self.live.now

        def post(*a, **k):
            self._add(label, self.live.now - module._plan_start)

        self.hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _wrap(self, label, owner, method):
        inner = getattr(owner, method)

        def wrapped(*a, **k):
            with self.part(label):
                return inner(*a, **k)

        setattr(owner, method, wrapped)

    @contextlib.contextmanager
    def part(self, label: str):
        start = self.live.now
        yield
        self._add(label, self.live.now - start)

    def close(self) -> dict[str, int]:
        """The parts' figures (stop counting), with "other" the rest of what is alive."""
        self.open = False
        for h in self.hooks:
            h.remove()
        whole = [k for k in self.held if not k.endswith(("attention", "MoE"))]
        self.held["other"] = self.live.now - self.start - sum(self.held[k] for k in whole)
        return self.held


# ---------------------------------------------------------------- the vision tower
@dataclass
class VisionMeasure:
    per_image: int  # bytes one image of `patches` patches holds at the end of the forward
    patches: int  # patches of the largest image the processor makes
    tokens: int  # the LLM tokens it becomes


def measure_vision(
    vision_cfg, llm_hidden: int, dtype: torch.dtype, frozen: list[str], device: str = "cuda"
) -> VisionMeasure:
    """What the vision tower (encoder and projector) holds for the backward per image of the largest
    grid the processor makes (`max_patches`), measured on the CPU with real tensors at the config's
    sizes (its images' grids are read on the host, so the meta device cannot run it): the bytes
    held after one image and after two, their difference. `frozen`: module prefixes of the VLM
    ("vision.encoder") that do not train. For a GPU run (`device` not "cpu") its attention keeps
    what flash attention keeps (`_FlashKeeps`), as on a GPU; the CPU's SDPA over an image keeps
    the n x n attention weights."""
    from dataclasses import replace as dc_replace

    from vision import navit

    proc = vision_cfg.processor
    m = proc.merge
    side = max(m, int(proc.max_patches**0.5) // m * m)
    rows, cols = side, max(m, proc.max_patches // side // m * m)
    with torch.device("meta"):  # the weights' values do not matter here: not initialised
        tower = dc_replace(vision_cfg, timm_checkpoint=None).build(llm_hidden)
    tower = tower.to_empty(device="cpu").to(dtype)
    tower.train()
    for name, p in tower.named_parameters():
        p.requires_grad_(not _frozen("vision." + name, list(frozen)))
    # with flash attention an image's memory is linear in its patches: a small grid measures a
    # patch's share (the CPU's kernel is quadratic in them: measured at the largest grid)
    h, w = (rows, cols) if device == "cpu" else (2 * m, 2 * m)
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    coords_P2 = torch.stack([r.flatten(), c.flatten()], 1)
    held = []

    def flash(q_QPd, k_JPd, v_JPd, layout, kernel, mask_PP=None):
        return _FlashKeeps.apply(q_QPd, k_JPd, v_JPd, False)

    kernels = (
        mock.patch.object(navit, "packed_attention", flash)
        if device != "cpu"
        else contextlib.nullcontext()
    )
    for n in (1, 2):
        live = LiveBytes("cpu")
        with kernels, live:
            patches_PD = torch.rand(n * h * w, 3 * proc.patch_size**2)
            out_ND = tower(patches_PD, coords_P2.repeat(n, 1), torch.tensor([[h, w]] * n))
            held.append(live.now - patches_PD.untyped_storage().nbytes())
            if out_ND.requires_grad:
                out_ND.float().sum().backward()
    per_image = (held[1] - held[0]) * rows * cols // (h * w)
    return VisionMeasure(per_image, rows * cols, (rows // m) * (cols // m))
