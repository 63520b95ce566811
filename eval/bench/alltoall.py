"""Expert parallelism's token exchange (vlm.model.expert_parallel) on one MoE layer of
`configs/gpu.yaml`'s LLM: the all-to-all's bytes and time, and the exchanged layer against the
same layer holding every expert.

    torchrun --nproc_per_node N -m eval.bench alltoall [--quick]   # N ranks: N expert ranks
    vlm bench alltoall                                             # one process: see below

Each rank routes its own `tokens` tokens (random, as a training step's would be) through the
layer; P = N ranks hold E/P experts each. Per capacity (dropless: every rank's N x top_k slots
per peer, exact; and `capacity_factor`, slots past it counted as overflow):
- all_to_all: one exchange of the [P, C, hidden] rows buffer alone (the layer does two per
  forward, rows out and results back, and two more in the backward; a third, tiny one carries
  the counts), seconds and MB sent per rank;
- moe fwd+bwd: the exchanged layer's forward and backward, against the whole layer (every expert
  on every rank, no exchange: `parallel.expert: 1`) on the same tokens.
Rank 0 reports; each figure is the slowest rank's (a collective ends when its last rank does).

On CUDA (nccl) the layer runs in bf16, on a CPU (gloo) in fp32. One process (no torchrun):
P = 2 with a loopback exchange that sends nothing, which times the packing, sorting and
unpacking around the all-to-all and states the bytes that N = 2 ranks would send. `vlm bench
gpu` on one GPU has no peer to exchange with: run this part under torchrun on the GPUs.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

import torch

from eval.bench import common

PART = "alltoall"
BASELINE = "whole layer (every expert, no exchange)"


@dataclass
class Settings:
    config: str = "configs/gpu.yaml"
    tokens: list[int] = field(default_factory=lambda: [4096, 8192])  # per rank
    capacity_factors: list[float | None] = field(default_factory=lambda: [None, 1.25])
    repeats: int = 5
    warmup: int = 1
    tiny: bool = False


SETTINGS = {
    "full": Settings(),
    "quick": Settings(tokens=[4096], repeats=3),
    "smoke": Settings(tokens=[64], repeats=2, tiny=True),
}


def _layer_config(s: Settings):
    from eval.bench.gpu.errors import ROOT
    from vlm.train.config import load_train_config

    cfg = load_train_config(ROOT / s.config).model
    moe = replace(cfg.moe, loss_free_balancing=False)
    if s.tiny:
        return replace(moe, num_experts=4, top_k=2, expert_hidden=32, shared_hidden=32), 64
    return moe, cfg.hidden_size


def _group():
    """(expert-parallel exchange maker, rank, ranks, device, slowest-over-ranks) under torchrun; a
    loopback of two expert ranks in one process (on the GPU where there is one)."""
    from vlm.model.expert_parallel import LoopbackExchange

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return (lambda cf: LoopbackExchange(2, 0, cf)), 0, 1, dev, None
    from vlm.train import collectives
    from vlm.train.distributed import init_distributed, make_groups
    from vlm.train.layout import ParallelLayout

    info = init_distributed()
    layout = ParallelLayout(info.world_size, info.rank, expert=info.world_size)
    group = make_groups(layout).expert

    def make(cf):
        return collectives.GroupExchange(group, info.world_size, layout.expert_rank, cf)

    return make, info.rank, info.world_size, info.device, collectives.all_reduce_max


LOOPBACK_NOTE = (
    "one process: a loopback exchange of P = 2 (nothing sent; the packing, sorting and unpacking "
    "around the all-to-all are timed, and the bytes are what 2 ranks would send); the exchange "
    "itself: torchrun --nproc_per_node N -m eval.bench alltoall"
)


def run(s: Settings, log=print) -> dict:
    make, rank, world, dev, slowest = _group()
    moe_cfg, D = _layer_config(s)
    out = measure(s, moe_cfg, D, make, rank, world, dev, slowest, log)
    shape = {
        "hidden": D,
        "experts": moe_cfg.num_experts,
        "top_k": moe_cfg.top_k,
        "expert_hidden": moe_cfg.expert_hidden,
        "device": str(dev),
    }
    notes = [LOOPBACK_NOTE] if world == 1 else []
    res = common.result(PART, {**asdict(s), "shape": shape}, out, notes=notes)
    res["rank"] = rank  # the CLI reports rank 0's
    return res


def measure(s: Settings, moe_cfg, D: int, make, rank, world, dev, slowest, log) -> list[dict]:
    """The rows of every token count: the whole layer (the baseline), and per capacity the
    all-to-all alone and the exchanged layer's forward + backward, in ms."""
    from vlm.model.expert_parallel import capacity
    from vlm.model.moe import MoE

    P = max(world, 2)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    for T in s.tokens:
        torch.manual_seed(0)
        whole = MoE(moe_cfg, D).to(dev, dtype)
        g = torch.Generator().manual_seed(1000 + rank)  # each rank its own tokens
        x = torch.randn(T, D, generator=g).to(dev, dtype)
        dy = torch.randn(T, D, generator=g).to(dev, dtype)

        def fwd_bwd(m):
            def call():
                m.zero_grad(set_to_none=True)
                xi = x.detach().requires_grad_()
                y, _ = m(xi)
                (y * dy).sum().backward()
                sync()

            return call

        timed, extra = {BASELINE: fwd_bwd(whole)}, {}
        for cf in s.capacity_factors:
            ex = make(cf)
            m = MoE(moe_cfg, D).to(dev, dtype)
            m.load_state_dict(whole.state_dict())
            m.shard_experts(ex)
            C = capacity(T * moe_cfg.top_k, P, cf)
            rows = torch.randn(P, C, D, generator=g).to(dev, dtype)
            name = "dropless" if cf is None else f"capacity {cf:g}"

            def a2a(ex=ex, rows=rows):
                def call():
                    # reading a value waits for the collective (and the device)
                    float(ex.all_to_all(rows)[-1, -1, -1])

                return call

            with torch.no_grad():
                _, st = m(x)
            sent = rows.numel() * rows.element_size() * (P - 1) / P  # the own block stays
            extra[f"all_to_all ({name})"] = {
                "capacity_rows": C,
                "MB_sent_per_rank": round(sent / 1e6, 3),
            }
            extra[f"exchanged layer ({name})"] = {
                "capacity_rows": C,
                "all_to_alls_fwd_bwd": 4,
                "MB_sent_per_rank_fwd_bwd": round(4 * sent / 1e6, 3),
                "overflow_slots": int(st.overflow),
            }
            timed[f"all_to_all ({name})"] = a2a()
            timed[f"exchanged layer ({name})"] = fwd_bwd(m)
        secs = common.measure(timed, s.repeats, s.warmup)
        if slowest is not None:  # the slowest rank's time, round by round
            secs = {
                n: slowest(torch.tensor(v, dtype=torch.float64)).tolist() for n, v in secs.items()
            }
        ms = {n: [1e3 * t for t in v] for n, v in secs.items()}
        setting = {"tokens_per_rank": T, "expert_ranks": P, "ranks": world, "dtype": str(dtype)}
        rs = common.rows(ms, BASELINE, setting, "ms per call", "ms", extra)
        out += rs
        if rank == 0:
            log(
                f"  alltoall T={T} P={P}: "
                + ", ".join(f"{r['candidate']} {r['median']:.2f} ms" for r in rs)
            )
    return out


def plot(res: dict, path) -> None:
    common.plot(
        res,
        path,
        x="tokens_per_rank",
        y="median",
        ylabel="ms per call",
        title="expert parallelism: the all-to-all and the exchanged MoE layer",
    )
