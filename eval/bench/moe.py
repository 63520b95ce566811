"""Our MoE layer (vlm.model.moe.MoE) against transformers' Qwen3MoeSparseMoeBlock and a plain
per-expert loop.

Legend: D width, E experts, K experts chosen per token, F expert hidden width, A (token, choice)
slots sorted by expert, N flat tokens or patches.

All candidates compute the same function at the same shapes (hidden, expert hidden, experts and
top-k of the model part's BASE): the transformers block and the reference loop get a copy of our
weights, and the JSON records each one's largest output difference from ours. Our layer runs with
its auxiliary losses and the loss-free balancing bias off, so that it computes only what the others
do (softmax router, top-k, renormalised weights, SwiGLU experts). Forward runs under no_grad;
forward+backward also computes the weight and input gradients of sum(out * g).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from eval.bench import common
from eval.bench.model import BASE
from vlm.model.moe import MoE, grouped_mm_available

PART = "moe"
BASELINE = "hf Qwen3MoeSparseMoeBlock (eager)"
# transformers' other experts implementations, and why they are not timed here.
NOT_TIMED = {
    "hf experts_implementation='batched_mm'": "gathers a copy of the expert weights for every "
    "(token, expert) pair (T*k x 2H x D floats: 0.5 GB at 1K tokens, 8 GB at 16K), not timed",
    "hf experts_implementation='deepgemm'": "CUDA only (DeepGEMM bf16 kernels)",
    "hf experts_implementation='sonicmoe'": "CUDA only (SonicMoE kernels)",
}


@dataclass
class Settings:
    tokens: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    repeats: int = 5
    warmup: int = 1
    modes: tuple[str, ...] = ("forward", "forward+backward")


SETTINGS = {
    "full": Settings(),
    "quick": Settings(tokens=[1024, 4096, 16384]),
    "smoke": Settings(tokens=[64], repeats=2),
}


class LoopReference(torch.nn.Module):
    """The textbook MoE: for each expert, gather its tokens, run its SwiGLU, scatter back (no sorting)."""

    def __init__(self, ours: MoE):
        super().__init__()
        self.top_k = ours.cfg.top_k
        self.router = torch.nn.Parameter(ours.router.weight.detach().clone())
        self.w_gate_EDF = torch.nn.Parameter(ours.w_gate_EDF.detach().clone())
        self.w_up_EDF = torch.nn.Parameter(ours.w_up_EDF.detach().clone())
        self.w_down_EFD = torch.nn.Parameter(ours.w_down_EFD.detach().clone())

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        w_NK, e_NK = F.linear(x_ND, self.router).softmax(-1).topk(self.top_k, dim=-1)
        w_NK = w_NK / w_NK.sum(-1, keepdim=True)
        out_ND = torch.zeros_like(x_ND)
        for e in range(self.w_gate_EDF.shape[0]):  # over experts, never over tokens
            t_A, k_A = (e_NK == e).nonzero(as_tuple=True)
            x_AD = x_ND[t_A]
            y_AD = (
                F.silu(x_AD @ self.w_gate_EDF[e]) * (x_AD @ self.w_up_EDF[e])
            ) @ self.w_down_EFD[e]
            out_ND = out_ND.index_add(0, t_A, y_AD * w_NK[t_A, k_A, None])
        return out_ND


def hf_block(ours: MoE, implementation: str):
    """transformers' Qwen3-MoE block with our weights (its gate_up_proj is [E, 2H, D], gate rows first)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    c = ours.cfg
    cfg = Qwen3MoeConfig(
        hidden_size=ours.dim,
        moe_intermediate_size=c.expert_hidden,
        num_experts=c.num_experts,
        num_experts_per_tok=c.top_k,
        norm_topk_prob=c.norm_topk_prob,
        hidden_act="silu",
    )
    cfg._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        block.experts.gate_up_proj.copy_(
            torch.cat([ours.w_gate_EDF, ours.w_up_EDF], dim=2).transpose(1, 2)
        )
        block.experts.down_proj.copy_(ours.w_down_EFD.transpose(1, 2))
    return block


NO_LOSSES: frozenset[str] = frozenset()  # the auxiliary losses off (see the module docstring)


def _ours(dispatch: str) -> MoE:
    torch.manual_seed(0)
    cfg = replace(BASE.moe, loss_free_balancing=False)
    return MoE(replace(cfg, dispatch=dispatch), BASE.hidden_size)


def candidates() -> tuple[dict[str, callable], dict[str, str]]:
    """name -> function of x_ND giving y_TD, for every candidate that runs here; and the ones that do not."""
    ours = _ours("auto")
    loop = _ours("loop")
    loop.load_state_dict(ours.state_dict())
    unavailable = dict(NOT_TIMED)
    hf = hf_block(ours, "eager")
    fns = {BASELINE: (hf, lambda x: hf(x[None])[0])}
    try:
        hf_g = hf_block(ours, "grouped_mm")
        hf_g(torch.randn(8, ours.dim)[None])
        fns["hf Qwen3MoeSparseMoeBlock (grouped_mm)"] = (hf_g, lambda x: hf_g(x[None])[0])
    except Exception as e:  # noqa: BLE001 - an older transformers or torch without a CPU grouped_mm
        unavailable["hf experts_implementation='grouped_mm'"] = f"{type(e).__name__}: {e}"[:200]
    probe = torch.zeros(1, ours.dim)
    auto = "grouped_mm" if grouped_mm_available(probe, ours.w_gate_EDF, ours.w_down_EFD) else "loop"
    fns[f"ours MoE (dispatch auto: {auto})"] = (ours, lambda x: ours(x, losses=NO_LOSSES)[0])
    if auto != "loop":
        fns["ours MoE (dispatch loop)"] = (loop, lambda x: loop(x, losses=NO_LOSSES)[0])
    ref = LoopReference(ours)
    fns["per-expert loop reference"] = (ref, ref)
    return fns, unavailable


def _timed(module: torch.nn.Module, fn, x_ND: torch.Tensor, g_ND: torch.Tensor, backward: bool):
    def call():
        if not backward:
            with torch.no_grad():
                fn(x_ND)
            return
        module.zero_grad(set_to_none=True)
        x = x_ND.detach().requires_grad_()
        (fn(x) * g_ND).sum().backward()

    return call


def run(s: Settings, log=print) -> dict:
    fns, unavailable = candidates()
    ours_name = next(n for n in fns if n.startswith("ours MoE (dispatch auto"))
    out = []
    for T in s.tokens:
        gen = torch.Generator().manual_seed(T)
        x_ND = torch.randn(T, BASE.hidden_size, generator=gen)
        g_ND = torch.randn(T, BASE.hidden_size, generator=gen)
        with torch.no_grad():
            ref_ND = fns[ours_name][1](x_ND)
            diff = {
                n: {"max_abs_diff_vs_ours": float((f(x_ND) - ref_ND).abs().max())}
                for n, (_, f) in fns.items()
            }
        for mode in s.modes:
            timed = {
                n: _timed(m, f, x_ND, g_ND, mode == "forward+backward") for n, (m, f) in fns.items()
            }
            secs = common.measure(timed, s.repeats, s.warmup)
            rs = common.rows(
                common.per_second(secs, T),
                BASELINE,
                {"mode": mode, "tokens": T},
                "tokens/s",
                "tok/s",
                diff,
            )
            out += rs
            log(
                f"  moe {mode} T={T}: "
                + ", ".join(f"{r['candidate']} x{r['ratio_vs_baseline']:.2f}" for r in rs)
            )
    shape = {
        "hidden": BASE.hidden_size,
        "expert_hidden": BASE.moe.expert_hidden,
        "experts": BASE.moe.num_experts,
        "top_k": BASE.moe.top_k,
        "dtype": "float32",
    }
    return common.result(
        PART,
        {**asdict(s), "shape": shape},
        out,
        unavailable=unavailable,
        notes=[
            (
                "same weights in every candidate (max_abs_diff_vs_ours); "
                "our aux losses and balancing bias off"
            )
        ],
    )


def plot(res: dict, path) -> None:
    common.plot(
        res,
        path,
        x="tokens",
        panels=("mode",),
        ylabel="tokens/s vs transformers eager",
        title="MoE layer: ours vs transformers Qwen3-MoE vs a per-expert loop",
    )
