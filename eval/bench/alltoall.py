"""Expert parallelism's token exchange (vlm.model.expert_parallel), variable and static, at the
MoE layers of `configs/gpu.yaml` and the paper's 90B configs: the bytes each rank sends and the
time, of the exchange alone and of the exchanged layer against the same layer holding every expert.

Legend: A (token, choice) slots sorted by expert, D width, K experts chosen per token, N tokens of a
rank, R rows an expert rank received.

    torchrun --nproc_per_node N -m eval.bench alltoall [--quick]   # N ranks: N expert ranks
    vlm bench alltoall [--quick]                                   # one process: see below

Each rank routes its own `tokens` tokens (random, as a training step's would be) at a config's
token-level MoE layer (the ConceptMoE-top15 config's concept-level layer too, at tokens / R
concepts, top-15; a layer an earlier config has is measured once); P ranks hold E/P experts
each. Per exchange (variable: each block's real rows
after an all-to-all of the counts and one host read; static: [P, C] buffers, no host read) and
capacity (dropless, nothing can be dropped; `capacity_factor`, slots past it counted as overflow):
- exchange: the model's round trip (rows out, sorted by local expert, results home) with the
  identity for the experts, forward + backward; the bytes each rank sends through the all-to-alls
  in both (counted by the exchange from the sizes it sends: the block a rank keeps included),
  against the rows it routed;
- layer: the exchanged layer's forward + backward against the whole layer (every expert on every
  rank, no exchange: `parallel.expert: 1`) on the same tokens, where the whole layer fits (on a
  CPU, up to `layer_params` routed-expert parameters: gpu.yaml's).
Rank 0 reports; each figure is the largest over the ranks (a collective ends when its last rank
does; the most loaded rank sends the most).

On CUDA (nccl) the layers run in bf16, on a CPU (gloo) in fp32. One process (no torchrun): a
loopback exchange for each P of `loopback_ranks`, which sends nothing: it times the packing,
the host read, sorting and unpacking around the all-to-all, and its bytes are what one of P ranks
would send (a loopback receives what it sent: a balanced group). `vlm bench gpu` on one GPU has no
peer to exchange with: run this part under torchrun on the GPUs. Routing is uniform random: a
trained router's imbalance makes a variable exchange's largest block larger (never past the static
buffer), which only a real run's `moe/` loads show.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

import torch

from eval.bench import common

PART = "alltoall"
BASELINE = "whole layer (every expert, no exchange)"
EXCHANGE_BASELINE = "static exchange (dropless)"
CONFIGS = ("configs/gpu.yaml", "configs/paper_moe_90b.yaml", "configs/paper_ct_90b_top15.yaml")


@dataclass
class Settings:
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    tokens: list[int] = field(default_factory=lambda: [4096, 8192])  # per rank
    capacity_factors: list[float | None] = field(default_factory=lambda: [None, 1.25])
    # one process: the expert ranks whose exchange a loopback stands in for
    loopback_ranks: list[int] = field(default_factory=lambda: [2, 4, 8])
    # on a CPU: the layer comparison runs where a layer's routed experts have at most this many
    # parameters, and a static buffer of more than this many GB is not built (on CUDA: every one)
    layer_params: int = 100_000_000
    cpu_buffer_gb: float = 2.0
    repeats: int = 5
    warmup: int = 1
    tiny: bool = False


SETTINGS = {
    "full": Settings(),
    "quick": Settings(tokens=[1024], loopback_ranks=[2, 4], repeats=3),
    "smoke": Settings(
        configs=["configs/gpu.yaml"], tokens=[64], loopback_ranks=[2, 4], repeats=2, tiny=True
    ),
}


@dataclass
class Layer:
    config: str  # the config file
    name: str  # "moe" (token level) or "concept_moe" (concept level)
    moe: object  # its MoEConfig
    dim: int
    token_share: float  # its tokens per token of the row (1 / R at the concept level)


def layers_of(s: Settings) -> list[Layer]:
    """The distinct MoE layers of each config: the token-level one, and a concept-level one with
    other settings (the CT configs' top-15) at its tokens / R."""
    from eval.bench.gpu.errors import ROOT
    from vlm.train.config import load_train_config

    out, seen = [], set()
    for path in s.configs:
        cfg = load_train_config(ROOT / path).model
        moe = replace(cfg.moe, loss_free_balancing=False)
        if s.tiny:
            moe = replace(moe, num_experts=8, top_k=2, expert_hidden=32, shared_hidden=32)
            out.append(Layer(path, "moe", moe, 64, 1.0))
            continue
        layers = [Layer(path, "moe", moe, cfg.hidden_size, 1.0)]
        concept = cfg.concept_moe
        if concept is not None and concept != cfg.moe and cfg.chunk.enabled:
            concept = replace(concept, loss_free_balancing=False)
            share = 1 / cfg.chunk.target_ratio
            layers.append(Layer(path, "concept_moe", concept, cfg.hidden_size, share))
        for ly in layers:  # a layer an earlier config has (the CT configs' token level) once
            key = (repr(ly.moe), ly.dim, ly.token_share)
            if key not in seen:
                seen.add(key)
                out.append(ly)
    return out


def _group():
    """(exchange maker: (P, capacity factor, variable) -> exchange, rank, ranks, device,
    largest-over-ranks) under torchrun; loopbacks in one process (on the GPU where there is
    one)."""
    from vlm.model.expert_parallel import LoopbackExchange

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return (lambda P, cf, v: LoopbackExchange(P, 0, cf, v)), 0, 1, dev, None
    from vlm.train import collectives
    from vlm.train.distributed import init_distributed, make_groups
    from vlm.train.layout import ParallelLayout

    info = init_distributed()
    layout = ParallelLayout(info.world_size, info.rank, expert=info.world_size)
    group = make_groups(layout).expert

    def make(P, cf, variable):
        return collectives.GroupExchange(group, P, layout.expert_rank, cf, variable)

    return make, info.rank, info.world_size, info.device, collectives.all_reduce_max


LOOPBACK_NOTE = (
    "one process: loopback exchanges (nothing sent; the packing, the variable exchange's host "
    "read, the sorting and unpacking around the all-to-all are timed, and the bytes are what one "
    "of P ranks would send); the exchange itself: torchrun --nproc_per_node N -m eval.bench alltoall"
)
ROUTING_NOTE = (
    "routing is uniform random: the variable exchange's bytes are a balanced router's; the static "
    "exchange sends P x C rows whatever the routing"
)


def run(s: Settings, log=print) -> dict:
    make, rank, world, dev, largest = _group()
    ranks = s.loopback_ranks if world == 1 else [world]
    rows, skipped = [], {}
    for layer in layers_of(s):
        for P in ranks:
            rows += measure(s, layer, P, make, rank, world, dev, largest, log, skipped)
    shape = {
        f"{ly.config}:{ly.name}": {
            "hidden": ly.dim,
            "experts": ly.moe.num_experts,
            "top_k": ly.moe.top_k,
            "expert_hidden": ly.moe.expert_hidden,
            "token_share": round(ly.token_share, 3),
        }
        for ly in layers_of(s)
    }
    notes = ([LOOPBACK_NOTE] if world == 1 else []) + [ROUTING_NOTE]
    res = common.result(PART, {**asdict(s), "shape": shape, "device": str(dev)}, rows, notes=notes)
    if skipped:
        res["unavailable"] = skipped
    res["rank"] = rank  # the CLI reports rank 0's
    return res


def _name(what: str, variable: bool, cf) -> str:
    how = "variable" if variable else "static"
    return f"{how} {what} ({'dropless' if cf is None else f'capacity {cf:g}'})"


def measure(s: Settings, layer: Layer, P: int, make, rank, world, dev, largest, log, skipped):
    """The rows of one layer at P expert ranks, every token count: the exchange alone (variable
    and static, per capacity; the baseline the static dropless one) and, where the whole layer
    fits, the exchanged layers against it; in ms per forward + backward, with the MB sent."""
    from vlm.model.expert_parallel import capacity, static_round_trip, variable_round_trip
    from vlm.model.moe_dispatch import sort_by_group

    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    E, K, D = layer.moe.num_experts, layer.moe.top_k, layer.dim
    if E % P:
        skipped[f"{layer.config}:{layer.name} P={P}"] = f"{E} experts do not split over {P} ranks"
        return []
    expert_params = 3 * E * D * layer.moe.expert_hidden
    with_layer = cuda or expert_params <= s.layer_params
    out = []
    for T_row in s.tokens:
        T = max(1, round(T_row * layer.token_share))
        g = torch.Generator().manual_seed(1000 + rank)  # each rank its own tokens
        x = torch.randn(T, D, generator=g).to(dev, dtype)
        # the slots of a uniform random router (the exchange alone does not need its weights)
        experts_NK = torch.randn(T, E, generator=g).topk(K, dim=-1).indices.to(dev)
        slots = sort_by_group(experts_NK, E)
        dy_AD = torch.randn(T * K, D, generator=g).to(dev, dtype)
        timed, extra = {}, {}

        def identity(got_RD, local):
            return got_RD[local.tok_A]

        def trip_call(ex):
            trip = variable_round_trip if ex.variable else static_round_trip

            def call():
                xi = x.detach().requires_grad_()
                y_AD, _ = trip(xi, slots, ex, identity)
                (y_AD * dy_AD).sum().backward()
                sync()

            return call

        for variable in (False, True):
            for cf in s.capacity_factors:
                C = capacity(T * K, P, cf)
                buffer_gb = P * C * D * x.element_size() / 1e9
                name = _name("exchange", variable, cf)
                if not variable and not cuda and buffer_gb > s.cpu_buffer_gb:
                    skipped[f"{layer.config}:{layer.name} T={T} P={P} {name}"] = (
                        f"a [P, C, D] buffer of {buffer_gb:.1f} GB (> cpu_buffer_gb)"
                    )
                    continue
                ex = make(P, cf, variable)
                trip_call(ex)()  # one round for the bytes
                t = ex.traffic
                with torch.no_grad():
                    trip = variable_round_trip if variable else static_round_trip
                    _, overflow = trip(x, slots, make(P, cf, variable), identity)
                sent = torch.tensor([t.forward + t.backward, t.forward], dtype=torch.float64)
                if largest is not None:
                    sent = largest(sent)
                # the forward sends the rows out and the results home: twice the routed rows'
                # bytes where nothing is padded (and a little for the counts)
                routed = 2 * T * K * D * x.element_size()
                extra[name] = {
                    "MB_sent_per_rank_fwd_bwd": round(float(sent[0]) / 1e6, 3),
                    "MB_fwd": round(float(sent[1]) / 1e6, 3),
                    "x_routed": round(float(sent[1]) / routed, 2),
                    "overflow_slots": int(overflow),
                }
                timed[name] = trip_call(ex)
        # the static dropless exchange, unless its buffer was too large here
        base = EXCHANGE_BASELINE if EXCHANGE_BASELINE in timed else next(iter(timed), None)
        setting = {
            "config": layer.config.split("/")[-1],
            "layer": layer.name,
            "tokens_per_rank": T,
            "expert_ranks": P,
            "ranks": world,
            "dtype": str(dtype).replace("torch.", ""),
        }
        if base is not None:
            out += _rows(s, timed, base, {**setting, "what": "exchange"}, extra, largest)
        if with_layer:
            out += _layer_rows(s, layer, P, make, x, setting, dev, dtype, sync, largest)
        if rank == 0:
            log(
                f"  alltoall {setting['config']} {layer.name} T={T} P={P}: "
                + ", ".join(
                    f"{r['candidate']} {r['median']:.2f} ms"
                    + (f" {r['MB_sent_per_rank_fwd_bwd']} MB" if "MB_fwd" in r else "")
                    for r in out
                    if r["setting"]["tokens_per_rank"] == T
                )
            )
    return out


def _rows(s, timed, base, setting, extra, largest) -> list[dict]:
    secs = common.measure({base: timed[base], **timed}, s.repeats, s.warmup)
    if largest is not None:  # the slowest rank's time, round by round
        secs = {n: largest(torch.tensor(v, dtype=torch.float64)).tolist() for n, v in secs.items()}
    ms = {n: [1e3 * t for t in v] for n, v in secs.items()}
    return common.rows(ms, base, setting, "ms per fwd+bwd", "ms", extra)


def _layer_rows(s, layer, P, make, x, setting, dev, dtype, sync, largest) -> list[dict]:
    """The whole layer and the exchanged ones (variable and static, every capacity), forward +
    backward on the same tokens."""
    from vlm.model.moe import MoE

    torch.manual_seed(0)
    whole = MoE(layer.moe, layer.dim).to(dev, dtype)
    g = torch.Generator().manual_seed(2000)
    dy = torch.randn(x.shape, generator=g).to(dev, dtype)

    def fwd_bwd(m):
        def call():
            m.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_()
            y, _ = m(xi)
            (y * dy).sum().backward()
            sync()

        return call

    timed, extra = {BASELINE: fwd_bwd(whole)}, {}
    for variable in (False, True):
        for cf in s.capacity_factors:
            m = MoE(layer.moe, layer.dim).to(dev, dtype)
            m.load_state_dict(whole.state_dict())
            m.shard_experts(make(P, cf, variable))
            with torch.no_grad():
                _, st = m(x)
            name = _name("exchanged layer", variable, cf)
            extra[name] = {"overflow_slots": int(st.overflow)}
            timed[name] = fwd_bwd(m)
    return _rows(s, timed, BASELINE, {**setting, "what": "layer"}, extra, largest)


def plot(res: dict, path) -> None:
    common.plot(
        res,
        path,
        x="expert_ranks",
        panels=("config", "layer", "what"),
        y="median",
        ylabel="ms per fwd+bwd",
        title="expert parallelism: the variable and the static exchange",
    )
