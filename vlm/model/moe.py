"""Mixture-of-experts feed-forward layer.

Legend: D width, E experts, K experts chosen per token, F expert hidden width, G Grove groups, A
(token, choice) slots sorted by expert, N flat tokens or patches.

Top-k router (softmax or sigmoid scores, routing in fp32), SwiGLU experts dispatched by sorting the
token->expert assignments by expert and running each expert on its contiguous slice (one
`torch._grouped_mm` per projection where it is available, else a loop over experts), optional
always-on shared experts, Grove MoE adjugate experts computed once per token per group (Grove eq.
2-5), a Switch balance loss, a router z-loss and auxiliary-loss-free balancing: a per-expert bias
used only to select experts (Grove eq. 6), moved after each optimizer step from the accumulated
expert loads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlm.model.config import MoEConfig
from vlm.model.context import ROUTER_LOSSES
from vlm.model.expert_parallel import ExpertExchange, exchanged_swiglu, local_slice
from vlm.model.legacy_names import rename_legacy_keys
from vlm.model.moe_dispatch import expert_swiglu, grouped_mm_available, sort_by_group
from vlm.model.sequence_parallel import SequenceShard, row_sum
from vlm.model.share_init import init_normal_, mark_rows
from vlm.model.shares import current, expert_rows


@dataclass
class MoEStats:
    """What one MoE layer's forward counted: the router's auxiliary losses, unweighted (their
    weights are the training config's loss section, applied by the trainer's loss:
    vlm.train.losses), and the routing outcome."""

    # Switch balance loss (0-d, with grad); None where the forward was not asked for it ("balance"
    # not in its `losses`: a weight of 0, not computed)
    balance: torch.Tensor | None
    # router z-loss (0-d, with grad); None where not asked for ("z")
    z: torch.Tensor | None
    # [E] float: token->expert assignments per expert in this call (detached)
    load_E: torch.Tensor
    # 0-d: adjugate-expert evaluations / tokens (None: Grove is off)
    adjugate_per_token: torch.Tensor | None
    cfg: MoEConfig  # the layer's settings
    # 0-d: (token, choice) slots past the expert-parallel capacity, computed by no expert (None:
    # the layer holds every expert, nothing is exchanged; vlm.model.expert_parallel)
    overflow: torch.Tensor | None = None


def expert_overflow(stats: list[MoEStats]) -> torch.Tensor | None:
    """The slots the layers' expert-parallel capacity dropped, summed (None: no layer exchanges)."""
    on = [s.overflow for s in stats if s.overflow is not None]
    return torch.stack(on).sum() if on else None


def mean_adjugate_per_token(stats: list[MoEStats]) -> torch.Tensor | float:
    """The layers' mean adjugate evaluations per token, a layer without Grove counting 0 (a tensor, or 0.0)."""
    on = [s.adjugate_per_token for s in stats if s.adjugate_per_token is not None]
    return torch.stack(on).sum() / len(stats) if on else 0.0


@dataclass
class Routing:
    logits_NE: torch.Tensor  # fp32 router logits
    scores_NE: torch.Tensor  # unbiased scores rho (eq. 10)
    # selected experts (int64), selected with the bias when enabled (eq. 6)
    experts_NK: torch.Tensor
    weights_NK: torch.Tensor  # fp32 combine weights, from the unbiased scores


# ----------------------------------------------------------------------------- routing


def router_scores(logits_NE: torch.Tensor, kind: str) -> torch.Tensor:
    """Grove eq. 10: softmax scores rho^(h) or sigmoid scores rho^(sigma) from the router logits."""
    if kind == "softmax":
        return logits_NE.softmax(dim=-1)
    if kind == "sigmoid":
        return logits_NE.sigmoid()
    raise ValueError(
        f"MoEConfig.router: got {kind!r}, allowed values: 'softmax', 'sigmoid', 'grove'"
    )


def select_experts(
    scores_NE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """Grove eq. 6: argtopk(rho + b). The bias only changes which experts are chosen, never their weights."""
    biased_NE = scores_NE if bias_E is None else scores_NE + bias_E.to(scores_NE.dtype)
    return biased_NE.topk(top_k, dim=-1).indices


def combine_weights(
    scores_NE: torch.Tensor, experts_NK: torch.Tensor, normalise: bool
) -> torch.Tensor:
    """Grove eq. 4 / 6 / 9: rho_i of the selected experts, optionally renormalised to sum to
    1 per token.

    Eq. 9 (router "grove") takes rho^(h)_i, the softmax over all n experts, as it is: the chosen
    weights sum to less than 1. Renormalised softmax weights equal Mixtral's softmax over the
    selected logits.
    """
    w_NK = scores_NE.gather(1, experts_NK)
    if normalise:
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return w_NK


def route(logits_NE: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None) -> Routing:
    """Which experts each token uses and with what weights. softmax / sigmoid routers: argtopk(rho +
    b) weighed by rho (Grove eq. 6). grove router, Grove eq. 9-10: argtopk(rho^(sigma) + b) weighed
    by rho^(h)."""
    logits_NE = logits_NE.float()
    grove = cfg.router == "grove"
    scores_NE = router_scores(logits_NE, "softmax" if grove else cfg.router)
    # Selection is a discrete choice: no gradient flows through it, only through the
    # gathered scores.
    with torch.no_grad():
        chooser_NE = router_scores(logits_NE, "sigmoid") if grove else scores_NE
        experts_NK = select_experts(
            chooser_NE, bias_E if cfg.loss_free_balancing else None, cfg.top_k
        )
    normalise = cfg.grove_weights == "renormalised" if grove else cfg.norm_topk_prob
    weights_NK = combine_weights(scores_NE, experts_NK, normalise)
    return Routing(logits_NE, scores_NE, experts_NK, weights_NK)


def expert_load(experts_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Grove eq. 7 (unnormalised): number of assignments per expert, F_i * k * N. Entries equal
    to `num_experts` (the padding sentinel, see `MoE.forward`) are not counted. index_add avoids
    a host sync."""
    flat = experts_NK.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.float32, device=flat.device).index_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device)
    )
    return counts[:num_experts]


def switch_balance_loss(
    scores_NE: torch.Tensor,
    experts_NK: torch.Tensor | None,
    normalise_scores: bool,
    valid_N: torch.Tensor | None = None,
    load_E: torch.Tensor | None = None,
    shard: SequenceShard | None = None,
) -> torch.Tensor:
    """Switch Transformer balance loss E * sum_i f_i P_i (f_i: share of assignments, P_i:
    mean score), over the `valid_N` tokens (all when None; padding's sentinel assignments
    are not counted in f). `load_E`: the assignment counts when the caller has them (else
    counted from `experts_NK`).

    Equals 1 for a perfectly uniform router. Sigmoid scores do not sum to 1, so they are normalised
    per token first. HF's `load_balancing_loss_func` divides f by tokens rather than assignments (k
    times ours).
    """
    num_experts = scores_NE.shape[-1]
    probs_NE = (
        scores_NE / scores_NE.sum(-1, keepdim=True).clamp_min(1e-20)
        if normalise_scores
        else scores_NE
    )
    load_E = expert_load(experts_NK, num_experts) if load_E is None else load_E
    # sum_i f_i P_i = (load . sum over valid tokens of the scores) / (assignments * valid tokens)
    score_sum_E = probs_NE.sum(0) if valid_N is None else torch.mv(probs_NE.t(), valid_N)
    n = probs_NE.new_tensor(probs_NE.shape[0]) if valid_N is None else valid_N.sum()
    # sequence parallelism: the row's sums, each rank's gradient through its own tokens
    load_E, score_sum_E, n = (row_sum(t, shard) for t in (load_E, score_sum_E, n))
    return num_experts * torch.dot(load_E, score_sum_E) / (load_E.sum() * n).clamp_min(1)


def router_z_loss(
    logits_NE: torch.Tensor,
    valid_N: torch.Tensor | None = None,
    shard: SequenceShard | None = None,
) -> torch.Tensor:
    """ST-MoE router z-loss: mean over (valid) tokens of logsumexp(logits)^2 (`shard`: over the
    row's tokens, as `switch_balance_loss`)."""
    z_N = logits_NE.float().logsumexp(dim=-1).square()
    if valid_N is None:
        valid_N = torch.ones_like(z_N)
    return row_sum((z_N * valid_N).sum(), shard) / row_sum(valid_N.sum(), shard).clamp_min(1)


def loss_free_bias_step(
    bias_E: torch.Tensor, load_E: torch.Tensor, rate: float, kind: str = "sign"
) -> torch.Tensor:
    """One loss-free balancing step from the loads (assignment counts) since the last one, recentred
    to mean 0.

    - "sign" (DeepSeek-V3 / torchtitan): b <- b + rate * sign(mean load - load);
    - "rms" (Grove eq. 8): b <- b - rate * (F - Q) / sqrt(mean((F - Q)^2)), F the load shares,
      Q = 1/n.
    Both move every over-loaded expert down and every under-loaded one up; "rms" in proportion to
    the imbalance.
    """
    load_E = load_E.to(bias_E.dtype)
    if kind == "rms":
        diff_E = load_E / load_E.sum().clamp_min(1e-20) - 1.0 / load_E.numel()
        rms = diff_E.square().mean().sqrt()
        step_E = torch.where(rms > 0, diff_E / rms.clamp_min(1e-20), torch.zeros_like(diff_E))
        new_E = bias_E - rate * step_E
    else:
        new_E = bias_E + rate * torch.sign(load_E.mean() - load_E)
    return new_E - new_E.mean()


# ----------------------------------------------------------------------------- Grove
# adjugate experts


def expert_group(experts_NK: torch.Tensor, experts_per_group: int) -> torch.Tensor:
    """Grove eq. 2: expert i (0-based) belongs to group floor(i / (n/g))."""
    return torch.div(experts_NK, experts_per_group, rounding_mode="floor")


def group_routing_weights(
    groups_NK: torch.Tensor, weights_NK: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grove eq. 5: per token and group, the summed weights (rho_r + rho_s + ...) of its selected
    experts in that group, and for each of the token's K choices whether it is the first one in its
    group (that group's adjugate then runs once, for this choice). Group ids equal to `num_groups`
    (padding) are neither summed nor first."""
    N, K = groups_NK.shape
    rho_NG = weights_NK.new_zeros(N, num_groups + 1).scatter_add(1, groups_NK, weights_NK)[
        :, :num_groups
    ]
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=groups_NK.device).tril(-1)  # k' < k
    repeat_NK = ((groups_NK[:, :, None] == groups_NK[:, None, :]) & earlier_KK).any(-1)
    return rho_NG, ~repeat_NK & (groups_NK < num_groups)


def adjugate_contribution(
    x_ND: torch.Tensor,
    groups_NK: torch.Tensor,
    weights_NK: torch.Tensor,
    num_groups: int,
    lam: float,
    w_gate_GDF: torch.Tensor,
    w_up_GDF: torch.Tensor,
    w_down_GFD: torch.Tensor,
    use_grouped: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grove eq. 3-5: sum over the token's active groups j of lambda * (sum of rho in G_j) * A_j(x),
    each A_j once.

    Static shapes: the N x K (token, choice) slots are sorted by group with repeats and padding
    last, and only the first choice per (token, group) is computed. Returns the [N, D] contribution
    and the number of adjugate evaluations (a 0-d tensor)."""
    rho_NG, first_NK = group_routing_weights(groups_NK, weights_NK, num_groups)
    disp = sort_by_group(groups_NK.masked_fill(~first_NK, num_groups), num_groups)
    a_AD = expert_swiglu(x_ND, disp, w_gate_GDF, w_up_GDF, w_down_GFD, use_grouped)
    g_A = disp.group_A.clamp_max(num_groups - 1)
    scale_A = (lam * rho_NG[disp.tok_A, g_A]).to(a_AD.dtype)
    out_ND = torch.zeros_like(x_ND).index_add_(0, disp.tok_A, a_AD * scale_A[:, None])
    return out_ND, first_NK.sum()


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP with HF names (gate_proj, up_proj, down_proj): the shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up in one matmul (the weights keep their names, concatenated per call)
        gate, up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(
            2, dim=-1
        )
        return self.down_proj(F.silu(gate) * up)


# ----------------------------------------------------------------------------- the layer


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ shared experts, + Grove adjugate experts) on a flat set of tokens."""

    def __init__(self, cfg: MoEConfig, dim: int, init_std: float = 0.02):
        super().__init__()
        cfg.validate()
        if dim < 1:
            raise ValueError(f"MoE: dim must be >= 1, got {dim}")
        self.cfg, self.dim, self.num_experts = cfg, dim, cfg.num_experts
        E, hidden = cfg.num_experts, cfg.expert_hidden  # (F is torch.nn.functional here)
        self.router = nn.Linear(dim, E, bias=False)
        # the routed experts this layer builds and holds: its expert shard when the model is built
        # for expert parallelism (vlm.model.shares.building), else all E
        sharding = current()
        self.expert_rows = (
            expert_rows(E, sharding.expert, sharding.expert_rank) if sharding.expert > 1 else (0, E)
        )
        n = self.expert_rows[1] - self.expert_rows[0]
        self.w_gate_EDF = nn.Parameter(torch.empty(n, dim, hidden))
        self.w_up_EDF = nn.Parameter(torch.empty(n, dim, hidden))
        self.w_down_EFD = nn.Parameter(torch.empty(n, hidden, dim))
        if n != E:
            for p in self.routed_expert_weights():
                mark_rows(p, self.expert_rows, E)
        self.shared = (
            SwiGLU(dim, cfg.num_shared_experts * cfg.shared_hidden)
            if cfg.num_shared_experts
            else None
        )
        if cfg.grove_groups:
            G, adj_hidden = cfg.grove_groups, cfg.grove_hidden
            self.adj_gate_GDF = nn.Parameter(torch.empty(G, dim, adj_hidden))
            self.adj_up_GDF = nn.Parameter(torch.empty(G, dim, adj_hidden))
            self.adj_down_GFD = nn.Parameter(torch.empty(G, adj_hidden, dim))
        self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        self.register_buffer("load_accum", torch.zeros(E), persistent=True)
        # the expert-parallel group (None: this layer holds every routed expert): shard_experts
        self.exchange: ExpertExchange | None = None
        self.reset_parameters(init_std)
        self.register_load_state_dict_pre_hook(rename_legacy_keys)  # older names (legacy_names)

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        # every tensor drawn whole (an expert shard keeps its rows of the whole draw), so that a
        # rank building its share draws what a whole build does (vlm.model.share_init)
        for p in self.parameters():
            init_normal_(p, init_std)
        self.expert_bias.zero_()
        self.load_accum.zero_()

    def _apply(self, fn, recurse=True):
        # Keep the balancing state in fp32 when the model is cast to bf16: 1e-3 bias steps and token
        # counts are not representable there.
        super()._apply(fn, recurse)
        self.expert_bias.data = self.expert_bias.data.float()
        self.load_accum.data = self.load_accum.data.float()
        return self

    @torch.no_grad()
    def shard_experts(self, exchange: ExpertExchange) -> None:
        """Exchange tokens with the ranks that hold the other routed experts from now on, keeping
        only this rank's E/P: a layer built at its shard (vlm.model.shares.building) holds them
        already, a whole one keeps its slice. The router, the shared experts, the Grove adjugate
        experts (small: one per group) and the balancing state stay whole on every rank. Called
        once, when a run is built."""
        if self.exchange is not None:
            raise RuntimeError("MoE.shard_experts: the layer's experts are sharded already")
        keep = local_slice(self.num_experts, exchange.size, exchange.rank)
        if self.expert_rows == (keep.start, keep.stop):  # built at its shard: nothing to cut
            self.exchange = exchange
            return
        if self.expert_rows != (0, self.num_experts):
            raise RuntimeError(
                f"MoE.shard_experts: the layer holds experts {self.expert_rows}, expert rank "
                f"{exchange.rank} of {exchange.size} needs {(keep.start, keep.stop)}"
            )
        for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
            full = getattr(self, name)
            part = nn.Parameter(full[keep].clone(), requires_grad=full.requires_grad)
            mark_rows(part, (keep.start, keep.stop), self.num_experts)
            setattr(self, name, part)
        self.expert_rows = (keep.start, keep.stop)
        self.exchange = exchange

    def routed_expert_weights(self) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """The routed experts' gate, up and down projections ([E or E/P, ...]: what
        `shard_experts` splits)."""
        return self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD

    @property
    def local_experts(self) -> int:
        """The routed experts whose weights this layer holds (all of them without an exchange)."""
        return self.expert_rows[1] - self.expert_rows[0]

    def _use_grouped(self, x_AD: torch.Tensor, *weights: torch.Tensor) -> bool:
        if self.cfg.dispatch == "loop":
            return False
        ok = grouped_mm_available(x_AD, *weights)
        if self.cfg.dispatch == "grouped_mm" and not ok:
            raise RuntimeError(
                f"moe.dispatch='grouped_mm' but torch._grouped_mm cannot run dtype {x_AD.dtype} "
                f"on {x_AD.device.type} with dim={self.dim} (needs 16-byte aligned rows)"
            )
        return ok

    def forward(
        self,
        x_ND: torch.Tensor,
        valid_N: torch.Tensor | None = None,
        accumulate_load: bool = True,
        losses: frozenset[str] = ROUTER_LOSSES,
        shard: SequenceShard | None = None,
    ) -> tuple[torch.Tensor, MoEStats]:
        """[N, D] -> [N, D] and the layer's statistics. `valid_N` (bool): the rows that are real
        tokens; the others (padding, unused concept capacity) are routed nowhere, computed by no
        expert, counted in no load and no loss, and come out as 0. Static shapes throughout (no host
        synchronisation on the grouped_mm path).

        In training the loads are added to `load_accum` for the next balancing step; a
        transformer block passes `accumulate_load=False` and its stack adds them
        (vlm.model.block.run_stack) outside the block, so that activation checkpointing's
        recomputation does not count them twice. `losses`: the router losses to compute (a layer
        used alone: both; in a model, those its forward's context asks for, vlm.model.context).
        `shard` (sequence parallelism): the tokens are this rank's part of rows split over its
        group; the balance and z losses are the rows'."""
        if x_ND.dim() != 2 or x_ND.shape[-1] != self.dim:
            raise ValueError(
                f"MoE expects x_ND of shape [tokens, {self.dim}], got {tuple(x_ND.shape)}"
            )
        cfg, E = self.cfg, self.num_experts
        dev_type = x_ND.device.type
        # the meta device (where `vlm plan` runs the model at sizes no machine holds) has no autocast
        autocast = torch.amp.is_autocast_available(dev_type)
        with torch.autocast(dev_type, enabled=False) if autocast else contextlib.nullcontext():
            logits_NE = F.linear(x_ND.float(), self.router.weight.float())
        r = route(logits_NE, cfg, self.expert_bias)
        pad_N1 = None if valid_N is None else ~valid_N[:, None]
        experts_NK = r.experts_NK if pad_N1 is None else r.experts_NK.masked_fill(pad_N1, E)
        # Sort the (token, choice) slots by expert so each expert reads one contiguous slice; its
        # counts are the loads
        slots = sort_by_group(experts_NK, E)
        load_E = slots.counts_G.float()
        if accumulate_load and self.training and cfg.loss_free_balancing:
            self.load_accum.add_(load_E)
        valid_f = None if valid_N is None else valid_N.float()

        N = x_ND.shape[0]  # a shape: static, no synchronisation
        balance = z = None  # computed where the loss weighs them (`losses`)
        if "balance" in losses:
            balance = (
                switch_balance_loss(
                    r.scores_NE, None, cfg.router == "sigmoid", valid_f, load_E, shard
                )
                if N
                else logits_NE.new_zeros(())
            )
        if "z" in losses:
            z = router_z_loss(logits_NE, valid_f, shard) if N else logits_NE.new_zeros(())

        dtype = (
            torch.get_autocast_dtype(dev_type)
            if autocast and torch.is_autocast_enabled(dev_type)
            else x_ND.dtype
        )
        x_c = x_ND.to(dtype)
        experts = (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD)
        use_grouped = self._use_grouped(x_c, self.w_gate_EDF, self.w_down_EFD)
        overflow = None
        if self.exchange is None:
            y_AD = expert_swiglu(x_c, slots, *experts, use_grouped)
        else:  # the experts live on several ranks: vlm.model.expert_parallel
            y_AD, overflow = exchanged_swiglu(x_c, slots, *experts, self.exchange, use_grouped)
        y_AD = y_AD * r.weights_NK.reshape(-1)[slots.order_A].to(dtype)[:, None]
        out_ND = torch.zeros_like(x_c).index_add_(0, slots.tok_A, y_AD)

        adj_per_token = None
        if cfg.grove_groups:
            G = cfg.grove_groups
            groups_NK = expert_group(experts_NK, E // G)  # padding's sentinel E lands on group G
            adj_ND, evals = adjugate_contribution(
                x_c,
                groups_NK,
                r.weights_NK,
                G,
                cfg.grove_lambda,
                self.adj_gate_GDF,
                self.adj_up_GDF,
                self.adj_down_GFD,
                self._use_grouped(x_c, self.adj_gate_GDF, self.adj_down_GFD),
            )
            out_ND = out_ND + adj_ND
            n = (
                x_ND.new_tensor(x_ND.shape[0], dtype=torch.float32)
                if valid_f is None
                else valid_f.sum()
            )
            adj_per_token = evals.float() / n.clamp_min(1)
        if self.shared is not None:
            shared_ND = self.shared(x_c)
            out_ND = out_ND + (shared_ND if pad_N1 is None else shared_ND.masked_fill(pad_N1, 0))
        adj = None if adj_per_token is None else adj_per_token.detach()
        stats = MoEStats(balance, z, load_E.detach(), adj, cfg, overflow)
        return out_ND.to(x_ND.dtype), stats

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor | None = None) -> None:
        """One loss-free balancing step (after an optimizer step) from `load_E` or the loads
        accumulated since the last step; resets the accumulator. No-op on the bias when
        loss_free_balancing is off."""
        load = self.load_accum if load_E is None else load_E.to(self.load_accum)
        if load.shape != (self.num_experts,):
            raise ValueError(
                f"update_bias: load_E must have shape [{self.num_experts}], got {tuple(load.shape)}"
            )
        if self.cfg.loss_free_balancing:
            self.expert_bias.copy_(
                loss_free_bias_step(
                    self.expert_bias, load, self.cfg.bias_update_rate, self.cfg.bias_update
                )
            )
        self.load_accum.zero_()

    def extra_repr(self) -> str:
        c = self.cfg
        held = "" if self.exchange is None else f" ({self.local_experts} here)"
        return (
            f"dim={self.dim}, experts={c.num_experts}{held}, top_k={c.top_k}, "
            f"hidden={c.expert_hidden}, router={c.router}, "
            f"shared={c.num_shared_experts}x{c.shared_hidden}, grove_groups={c.grove_groups}"
        )


def update_moe_biases(
    model: nn.Module, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Loss-free balancing step for every MoE in `model`: sum the accumulated loads over ranks with
    `all_reduce` (one call for all layers; an in-place all-reduce that returns None also works),
    then update each layer's bias. Call after each optimizer step, not each micro-batch."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        return
    if all_reduce is None:
        for m in moes:
            m.update_bias()
        return
    flat = torch.cat([m.load_accum for m in moes])
    reduced = all_reduce(flat)
    reduced = flat if reduced is None else reduced
    for m, load in zip(moes, reduced.split([m.num_experts for m in moes])):
        m.update_bias(load)
