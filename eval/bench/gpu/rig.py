"""The models, batches and steps `vlm bench gpu` times: gpu.yaml's LLM and its reallocations, a
training step, a forward, and decode rounds from a prefilled prompt.

Legend: B rows, T tokens.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from configs.batch import PackedBatch
from eval.bench.gpu.device import Device
from eval.bench.gpu.errors import ROOT
from eval.bench.gpu.settings import Settings
from eval.bench.model import BASELINE
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ModelConfig
from vlm.model.context import ForwardContext
from vlm.model.flops import attention_map_flops, flops_per_token
from vlm.model.reallocate import reallocate
from vlm.train.losses import training_loss


def llm_config(s: Settings) -> ModelConfig:
    """gpu.yaml's LLM through the project's config system; --smoke: the same structure at toy width."""
    from vlm.train.config import load_train_config

    cfg = load_train_config(ROOT / s.config).model  # an absolute s.config replaces ROOT
    # the smallest widths whose reallocations keep grouped_mm's 16-byte rows
    # (wider_concept's experts)
    if s.tiny:
        cfg = replace(
            cfg,
            vocab_size=512,
            hidden_size=128,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            encoder_layers=1,
            concept_layers=2,
            decoder_layers=1,
            moe=replace(cfg.moe, num_experts=16, top_k=2, expert_hidden=32, shared_hidden=64),
        )
    return cfg


def candidates(s: Settings) -> dict[str, ModelConfig]:
    base = llm_config(s).baseline()
    return {BASELINE: base, **reallocate(base, s.ratio)}


def model_flops(cfg: ModelConfig, R: float | None, seq_len: int) -> tuple[float, float]:
    """Forward model FLOPs per token: (attention map excluded, the attention map's share per token
    of a causal row of seq_len). R applies to a ConceptMoE only: the baseline has no concept model
    to shorten."""
    r = R if cfg.chunk.enabled else None
    return flops_per_token(cfg, r)["total"], attention_map_flops(cfg, seq_len, r)["total"] / seq_len


def build(cfg: ModelConfig, dev: Device, dtype: torch.dtype, seed: int = 0) -> ConceptMoELM:
    torch.manual_seed(seed)
    with dev.device:  # parameters initialised on the device: no CPU init of 700M parameters
        model = ConceptMoELM(cfg)
    return model.to(device=dev.device, dtype=dtype)


def optimizer(model: torch.nn.Module, dev: Device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if dev.cuda:
        try:
            return torch.optim.AdamW(params, lr=1e-5, fused=True)
        except (RuntimeError, ValueError, TypeError):
            pass
    return torch.optim.AdamW(params, lr=1e-5)


def make_batch(B: int, T: int, vocab: int, dev: Device, seed: int) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    ids_BT = torch.randint(0, vocab, (B, T), generator=g)
    return PackedBatch.stack(
        [PackedBatch.from_documents([r.tolist()], row_len=T) for r in ids_BT]
    ).to(dev.device)


def train_step(model, opt, batch: PackedBatch, force) -> Callable[[], None]:
    def fn():
        model.train()
        # the trainer's forward: no [B, T, V] logits, the loss makes them in tiles
        out = model(batch, force=force, context=ForwardContext(logits=False))
        opt.zero_grad(set_to_none=True)
        training_loss(out, batch, model.cfg).backward()
        opt.step()

    return fn


def forward_fn(model, batch: PackedBatch, force) -> Callable[[], None]:
    def fn():
        model.eval()
        with torch.no_grad():
            model(batch, force=force)

    return fn


def timed(dev: Device, fn: Callable[[], object]) -> Callable[[], float]:
    """A self-timed call (common.measure takes a returned float as the call's time) with the device
    synchronised on both sides: a CUDA call returns before its kernels end."""

    def run() -> float:
        dev.sync()
        t0 = time.perf_counter()
        fn()
        dev.sync()
        return time.perf_counter() - t0

    return run


class DecodeRig:
    """A prompt of B x P tokens prefilled once; every round decodes `steps` tokens from a copy of
    its caches, so every round decodes the same positions. Boundaries fire at rate 1/R (the same
    pattern every round)."""

    def __init__(
        self, model: ConceptMoELM, B: int, P: int, steps: int, R: float, dev: Device, seed: int = 0
    ):
        self.model, self.steps, self.dev = model, steps, dev
        g = torch.Generator().manual_seed(seed)
        self.batch = make_batch(B, P, model.cfg.vocab_size, dev, seed)
        self.pristine = self.prefill()
        with torch.no_grad():
            self.xs = model.embed(
                torch.randint(0, model.cfg.vocab_size, (steps, B), generator=g).to(dev.device)
            )
        self.fires = None
        if model.cfg.chunk.enabled:
            self.fires = (torch.rand(steps, B, generator=g) < 1.0 / R).to(dev.device)
        self.copyable = True

    def prefill(self):
        with torch.no_grad():
            self.model.eval()
            return self.model.prefill(self.batch, max_new_tokens=self.steps + 1)[1]

    def fresh(self):
        """The prompt's caches, as prefill left them: a deep copy, or (a cache that cannot be copied) a new prefill."""
        if self.copyable:
            try:
                return copy.deepcopy(self.pristine)
            except Exception:  # noqa: BLE001
                self.copyable = False
        return self.prefill()

    def run(self, step, cache) -> None:
        for i in range(self.steps):  # one step per token is what decoding is
            step(self.xs[i], cache, force_B=None if self.fires is None else self.fires[i])

    def round(self, step) -> Callable[[], float]:
        """A self-timed round: the copy of the caches is made before the clock starts."""

        def fn() -> float:
            cache = self.fresh()
            return timed(self.dev, lambda: self.run(step, cache))()

        return fn
