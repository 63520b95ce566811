"""Optimizer parameter groups: DLCM's decoupled muP, per-part learning rates, freezing
by module prefix.

Parts of the VLM (module names of ConceptMoEVLM):
- token stacks: lm.encoder, lm.chunker, lm.concept_up, lm.dechunk, lm.decoder,
  lm.norm  (width d_token)
- concept model: lm.concept, lm.concept_down                                           (width
  d_concept)
- embeddings: lm.embed; output layer: lm.lm_head
- vision encoder: vision.encoder (except its merger); projector:
  vision.projector and vision.encoder.merger

With muP (DLCM section 6.1) hidden matrices of the token stacks and the concept model get
lr = eta_base / s and AdamW eps = eps / s, with s = width / d_base (eq. 18-20) and init variance
sigma^2 / s; embeddings, vectors (norm gains, biases) and the output layer keep the base rate; the
logits are scaled by 1 / s_token (eq. 21).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from configs.config import ConfigError
from vlm.model.share_init import held, scale_, whole_shape

CONCEPT_PREFIXES = ("lm.concept.", "lm.concept_down.")
TOKEN_PREFIXES = (
    "lm.encoder.",
    "lm.chunker.",
    "lm.concept_up.",
    "lm.dechunk.",
    "lm.decoder.",
    "lm.norm.",
)
PROJECTOR_PREFIXES = ("vision.projector.", "vision.encoder.merger.")


def part_of(name: str) -> str:
    """Which part of the model a parameter belongs to (see the module docstring)."""
    if name.startswith(PROJECTOR_PREFIXES):
        return "projector"
    if name.startswith("vision."):
        return "vision"
    if name.startswith(CONCEPT_PREFIXES):
        return "concept"
    if name.startswith(TOKEN_PREFIXES):
        return "token"
    if name.startswith("lm.embed."):
        return "embed"
    if name.startswith("lm.lm_head."):
        return "head"
    return "other"


def mup_width_multipliers(hidden: int, concept_hidden: int, base: int) -> tuple[float, float]:
    """DLCM eq. 18: s_token = d_token / d_base, s_concept = d_concept / d_base."""
    return hidden / base, concept_hidden / base


def mup_hidden_lr(base_lr: float, s: float) -> float:
    """DLCM eq. 19-20: hidden-layer rate eta = eta_base * s^-1 (token stacks with s_token, concept
    model with s_concept)."""
    return base_lr / s


def mup_logit_scale(s_token: float) -> float:
    """DLCM eq. 21: logits = (1 / s_token) h W_unemb^T."""
    return 1.0 / s_token


def freeze_prefixes(model: nn.Module, prefixes: list[str]) -> int:
    """requires_grad=False for every parameter under a prefix; returns how many tensors were frozen."""
    names = [n for n, _ in model.named_parameters()]
    frozen = 0
    for prefix in prefixes:
        hits = [n for n in names if n == prefix or n.startswith(prefix.rstrip(".") + ".")]
        if not hits:
            tops = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ConfigError(
                f"params.freeze entry {prefix!r} matches no "
                f"parameter; module prefixes: {', '.join(tops)}"
            )
        params = dict(model.named_parameters())
        for n in hits:
            params[n].requires_grad_(False)
            frozen += 1
    return frozen


@dataclass
class GroupSpec:
    name: str
    lr: float
    weight_decay: float
    eps: float


@torch.no_grad()
def apply_mup_init(model: nn.Module, s_token: float, s_concept: float) -> None:
    """Hidden matrices of the token stacks / concept model: variance sigma^2 -> sigma^2 /
    s (DLCM 6.1.1).

    Scales the existing initialisation so zero-initialised projections stay zero; the dechunk's
    identity-initialised residual projection is left alone.
    """
    for name, p in model.named_parameters():
        if len(whole_shape(p)) < 2 or ".dechunk.residual" in name:
            continue
        part = part_of(name)
        if part in ("token", "concept"):  # this rank's share (a ZeRO-3 partition: share_init)
            scale_(p, 1.0 / math.sqrt(s_token if part == "token" else s_concept))


def apply_mup(
    model: nn.Module, params_cfg, hidden: int, concept_hidden: int, fresh_lm: bool
) -> float:
    """params.mup: a fresh LLM gets muP's initialisation; a pretrained one, which computes plain
    logits, has lm_head divided by the logit multiplier so that hook x weights is the same function.
    Installs the multiplier's forward hook and returns it (1.0, and nothing done, without muP)."""
    if not params_cfg.mup:
        return 1.0
    s_tok, s_con = mup_width_multipliers(hidden, concept_hidden, params_cfg.mup_base_width)
    scale = mup_logit_scale(s_tok)
    if fresh_lm:
        apply_mup_init(model, s_tok, s_con)
    else:
        with torch.no_grad():
            held(model.lm.lm_head.weight)[0].div_(scale)  # this rank's share
    install_logit_scale(model, scale)
    return scale


def build_param_groups(
    model: nn.Module, optim, params_cfg, hidden: int, concept_hidden: int
) -> list[dict]:
    """AdamW groups (only trainable tensors), each with a `name`, its own lr, weight decay and eps."""
    s_tok, s_con = mup_width_multipliers(hidden, concept_hidden, params_cfg.mup_base_width)
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part = part_of(name)
        matrix = len(whole_shape(p)) >= 2  # a ZeRO-3 partition is flat: its whole shape says
        lr, eps = optim.lr, optim.eps
        if part == "vision":
            lr *= params_cfg.vision_lr_mult
        elif part == "projector":
            lr *= params_cfg.projector_lr_mult
        elif params_cfg.mup and matrix and part in ("token", "concept"):
            s = s_tok if part == "token" else s_con
            base = (
                params_cfg.mup_token_lr if part == "token" else params_cfg.mup_concept_lr
            ) or optim.lr
            lr, eps = mup_hidden_lr(base, s), eps / s
        elif part == "concept" and not params_cfg.mup:
            lr *= params_cfg.concept_lr_mult
        decay = optim.weight_decay if matrix and part != "embed" else 0.0
        key = (part, matrix, lr, decay, eps)
        if key not in groups:
            groups[key] = {
                "name": f"{part}/{'matrix' if matrix else 'vector'}",
                "params": [],
                "lr": lr,
                "weight_decay": decay,
                "eps": eps,
            }
        groups[key]["params"].append(p)
    if not groups:
        raise ConfigError(
            "no trainable parameters: params.freeze (or vision.freeze_encoder) froze everything"
        )
    return list(groups.values())


@contextlib.contextmanager
def folded_logit_scale(model: nn.Module, scale: float):
    """Fold the muP logit multiplier into lm_head's weights for the duration (an export sees plain logits)."""
    head = model.lm.lm_head
    if scale == 1.0:
        yield
        return
    installed = head.logit_scale
    head.logit_scale = 1.0
    orig = head.weight.detach().clone()  # restore bit for bit, not by dividing back
    with torch.no_grad():
        head.weight.mul_(scale)
    try:
        yield
    finally:
        with torch.no_grad():
            head.weight.copy_(orig)
        head.logit_scale = installed


def install_logit_scale(model: nn.Module, scale: float) -> None:
    """The lm_head multiplies its logits by `scale` (muP eq. 21): its `logit_scale`, which the
    loss's tiles apply as the logits do (vlm.model.tiled_loss.LMHead)."""
    model.lm.lm_head.logit_scale = scale


def held_numel(p: torch.Tensor) -> int:
    """Elements of `p` as this rank counts them: its expert shard, or the whole tensor of a
    ZeRO-3 partition (as once the engine partitioned it)."""
    return getattr(p, "ds_numel", p.numel())


def describe_groups(groups: list[dict]) -> list[str]:
    return [
        f"{g.get('label', g['name'])}: {sum(held_numel(p) for p in g['params']):,} params, lr "
        f"{g['lr']:.3g}, wd {g['weight_decay']:.3g}, eps {g['eps']:.3g}"
        for g in groups
    ]
