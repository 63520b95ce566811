"""Compute reallocation for fair comparison (ConceptMoE section 3.5, Table 1).

Given a MoE baseline and a compression ratio R, the concept model costs 1/R per token; the
freed FLOPs go back in one of three ways, each matched to the baseline's per-token FLOPs
and total parameters:

1. `more_experts`       more activated experts (concept `top_k`, fine-tuned by the
   token stacks' `top_k`);
2. `loop_more_experts`  loop a middle range of concept layers (no parameters) plus
   more activated experts;
3. `wider_concept`      a wider concept model (hidden, heads ~ sqrt(R) as Table 1
   assumes) with fewer,
                        re-sized experts so that total parameters stay.

The chunk module and the joint-decoding projections add parameters and FLOPs of their own;
strategies 1 and 2 may drop a few concept experts to give those parameters back. Each strategy is a
small search over integer knobs: the FLOPs-matching `top_k` / expert size and the parameter-matching
expert count are solved in closed form (they are affine in those knobs) and their integer neighbours
evaluated exactly. Among candidates within tol/4, then within tol, the one closest to the strategy's
intent wins (fewest structural changes; for loops the target loop count; for width sqrt(R)), ties
broken by mismatch. When no candidate is within tol (granularity too coarse, e.g. 2 experts), the
best mismatch is returned with `within_tol = False` and a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vlm.model.config import ModelConfig
from vlm.model.flops import count_params, flops_per_token, summary

STRATEGIES = {
    "more_experts": "Increasing C_moe",
    "loop_more_experts": "Increasing L_C and C_moe",
    "wider_concept": "Increasing C_attn and C_moe",
}


@dataclass
class Reallocation:
    name: str
    config: ModelConfig
    flops_ratio: float  # per-token FLOPs / baseline's
    params_ratio: float  # total parameters / baseline's
    within_tol: bool
    note: str = ""

    @property
    def mismatch(self) -> float:
        return max(abs(self.flops_ratio - 1.0), abs(self.params_ratio - 1.0))


def _totals(cfg: ModelConfig) -> tuple[float, float]:
    return flops_per_token(cfg)["total"], count_params(cfg)["total"]


def _int_candidates(fn, x0: int, target: float, lo: int, hi: int, step: int = 1) -> list[int]:
    """Integer (multiple of `step`) neighbours of the x solving fn(x) = target, fn assumed ~affine."""
    lo = max(lo, step) if step > 1 else lo
    lo = -(-lo // step) * step
    hi = hi // step * step
    if hi < lo:
        return []
    x0 = min(max(x0, lo), hi)
    x1 = x0 + step if x0 + step <= hi else x0 - step
    if x1 < lo:
        return [x0]
    y0, y1 = fn(x0), fn(x1)
    slope = (y1 - y0) / (x1 - x0)
    x = x0 if slope == 0 else x0 + (target - y0) / slope
    x = min(max(x, lo), hi)  # out of reach: the nearest end is the best there is
    base = math.floor(x / step) * step
    cands = {base - step, base, base + step, base + 2 * step}
    return sorted(c for c in cands if lo <= c <= hi)


def _concept_start(base: ModelConfig, ratio: float) -> ModelConfig:
    """The baseline with chunking on at ratio R and an explicit concept MoE (to be edited)."""
    return replace(
        base,
        chunk=replace(base.chunk, enabled=True, target_ratio=float(ratio)),
        concept_moe=replace(base.c_moe),
    )


def _with(cfg: ModelConfig, k_tok: int | None = None, **concept_moe) -> ModelConfig:
    """`cfg` with the token top-k and concept-MoE knobs changed. Configs validate when built, and
    the search evaluates FLOPs and parameters at expert counts where the baseline's Grove lambda is
    out of bounds (lambda <= groups / experts): there lambda, which changes neither, is clamped, and
    `_Search.offer` refuses the result (a reallocation keeps the baseline's lambda). Every config
    built is valid: configs validate when made."""
    moe = cfg.moe if k_tok is None else replace(cfg.moe, top_k=k_tok)
    c = cfg.c_moe
    groups, experts = c.grove_groups, concept_moe.get("num_experts", c.num_experts)
    if groups and experts and groups <= experts and c.grove_lambda > groups / experts:
        concept_moe.setdefault("grove_lambda", groups / experts)
    return replace(cfg, moe=moe, concept_moe=replace(c, **concept_moe))


class _Search:
    """Keeps the best candidate: within tol and on intent first, then tol/4 tier, intent deviation, mismatch."""

    def __init__(self, base: ModelConfig, tol: float):
        self.f0, self.p0 = _totals(base)
        self.grove_lambda = base.c_moe.grove_lambda
        self.tol = tol
        self.best: tuple | None = None

    def offer(self, cfg: ModelConfig, dev: float, off_intent: bool = False) -> None:
        """`off_intent`: the candidate misses what the strategy is about; used only if nothing else fits."""
        # clamped by _with: not the baseline's lambda
        if cfg.c_moe.grove_lambda != self.grove_lambda:
            return
        f, p = _totals(cfg)
        err = max(abs(f / self.f0 - 1), abs(p / self.p0 - 1))
        tier = 0 if err <= self.tol / 4 else 1 if err <= self.tol else 2
        key = (0, off_intent, tier, dev, err) if tier < 2 else (1, err, off_intent, dev, 0)
        if self.best is None or key < self.best[0]:
            self.best = (key, cfg, f / self.f0, p / self.p0)

    def result(self, name: str, note: str = "", off_intent_note: str = "") -> Reallocation:
        if self.best is None:
            raise ValueError(f"strategy {name}: no valid configuration found")
        key, cfg, fr, pr = self.best
        ok = key[0] == 0
        notes = [note] if note else []
        if not ok:
            notes.append(
                f"best mismatch {max(abs(fr - 1), abs(pr - 1)):.1%} exceeds "
                f"{self.tol:.0%}: no integer choice of this strategy's knobs "
                "gets closer (granularity, or top_k capped by num_experts)"
            )
        elif key[1] and off_intent_note:
            notes.append(off_intent_note)
        return Reallocation(name, cfg, fr, pr, ok, "; ".join(notes))


def _expert_counts(s: _Search, cfg: ModelConfig, e0: int, step: int) -> list[int]:
    """Concept expert counts to try: the baseline's and those giving back the chunk/joint parameters."""
    # top_k capped at the count so that every count tried is a valid config (parameters do not
    # depend on top_k)
    fn = lambda e: count_params(_with(cfg, num_experts=e, top_k=min(cfg.c_moe.top_k, e)))["total"]  # noqa: E731
    cands = _int_candidates(fn, e0, s.p0, step, e0, step)
    return sorted(set(cands) | {e0}, reverse=True)


def _fit_topk(s: _Search, cfg: ModelConfig, lo: int, hi: int) -> list[int]:
    fn = lambda k: flops_per_token(_with(cfg, top_k=k))["total"]  # noqa: E731
    return _int_candidates(fn, lo, s.f0, lo, hi)


def _search_setup(base: ModelConfig, ratio: float, tol: float, extra_tok_k: int):
    """The search, the concept model at the target ratio, and the token-level top-k values to try
    (raising the token top-k pays FLOPs back when there are token layers)."""
    k0 = base.moe.top_k
    tok_range = (
        range(k0, min(base.moe.num_experts, k0 + extra_tok_k) + 1)
        if base.encoder_layers + base.decoder_layers
        else [k0]
    )
    return _Search(base, tol), _concept_start(base, ratio), tok_range


def _more_experts(
    base: ModelConfig, ratio: float, tol: float, extra_tok_k: int = 2
) -> Reallocation:
    s, start, tok_range = _search_setup(base, ratio, tol, extra_tok_k)
    k0, kc0, e0 = base.moe.top_k, base.c_moe.top_k, base.c_moe.num_experts
    step = base.c_moe.grove_groups or 1
    for k_tok in tok_range:
        cfg_t = _with(start, k_tok)
        for e_c in _expert_counts(s, cfg_t, e0, step):
            cfg_e = _with(cfg_t, num_experts=e_c, top_k=min(kc0, e_c))
            for k_c in _fit_topk(s, cfg_e, min(kc0, e_c), e_c):
                s.offer(
                    _with(cfg_e, top_k=k_c),
                    dev=(k_tok - k0) + (e0 - e_c) / step,
                    off_intent=k_c <= kc0,
                )
    return s.result(
        "more_experts", off_intent_note="matched only without raising the concept top_k"
    )


def _loop_more_experts(
    base: ModelConfig,
    ratio: float,
    tol: float,
    loop_fraction: float = 0.25,
    loop_layers: int | None = None,
    extra_tok_k: int = 2,
) -> Reallocation:
    lc = base.concept_layers
    target = loop_layers if loop_layers else max(1, round(loop_fraction * lc))
    if not 1 <= target <= lc:
        raise ValueError(f"loop_layers must be in [1, concept_layers={lc}], got {target}")
    s, start, tok_range = _search_setup(base, ratio, tol, extra_tok_k)
    k0, kc0, e0 = base.moe.top_k, base.c_moe.top_k, base.c_moe.num_experts
    step = base.c_moe.grove_groups or 1
    for ell in range(1, lc + 1):
        first = (lc - ell) // 2  # loop the middle ("intermediate") layers
        looped = replace(start, loop_start=first, loop_end=first + ell, loop_times=1)
        for k_tok in tok_range:
            cfg_t = _with(looped, k_tok)
            for e_c in _expert_counts(s, cfg_t, e0, step):
                cfg_e = _with(cfg_t, num_experts=e_c, top_k=min(kc0, e_c))
                for k_c in _fit_topk(s, cfg_e, min(kc0, e_c), e_c):
                    dev = abs(ell - target) + (k_tok - k0) + (e0 - e_c) / step
                    s.offer(_with(cfg_e, top_k=k_c), dev, off_intent=k_c <= kc0)
    return s.result(
        "loop_more_experts",
        note=f"target loop layers {target}",
        off_intent_note="the loops alone spend the freed FLOPs: concept top_k not raised",
    )


def _wider_concept(
    base: ModelConfig,
    ratio: float,
    tol: float,
    concept_heads: int | None = None,
    max_heads: int = 8,
) -> Reallocation:
    s = _Search(base, tol)
    start = _concept_start(base, ratio)
    d, hq, hkv = base.c_hidden, base.c_heads, base.c_kv_heads
    group = hq // hkv
    want = math.sqrt(ratio)
    kc0, e0, he0 = base.c_moe.top_k, base.c_moe.num_experts, base.c_moe.expert_hidden
    step = base.c_moe.grove_groups or 1
    q = math.gcd(he0, 16)
    heads = range(hq + group, max(hq + group, math.ceil(2 * want * hq)) + 1, group)
    heads = sorted(heads, key=lambda h: abs(h / hq - want))[:max_heads]
    if concept_heads is not None:
        if concept_heads % group or concept_heads <= hq:
            raise ValueError(
                f"concept_heads must be a multiple of {group} (num_heads / "
                f"num_kv_heads) above num_heads={hq}, got {concept_heads}"
            )
        heads = [concept_heads]
    for h_c in heads:
        d_c = round(d * h_c / hq)
        wide = replace(
            start, concept_hidden_size=d_c, concept_num_heads=h_c, concept_num_kv_heads=h_c // group
        )
        for k_c in range(max(1, kc0 - 2), kc0 + 3):
            e_c, he, slope = e0, he0, 0.0
            # alternate the FLOPs-matching expert size and the params-matching count
            for _ in range(3):
                cfg = _with(wide, top_k=min(k_c, e_c), num_experts=e_c, expert_hidden=he)
                f_a = flops_per_token(cfg)["total"]
                slope = max(flops_per_token(_with(cfg, expert_hidden=he + 1))["total"] - f_a, 1e-9)
                he = max(1, round(he + (s.f0 - f_a) / slope))
                p_fn = lambda e: count_params(_with(cfg, expert_hidden=he, num_experts=e))["total"]  # noqa: E731
                e_cands = _int_candidates(p_fn, e_c, s.p0, max(k_c, step), 1 << 20, step)
                e_c = e_cands[len(e_cands) // 2] if e_cands else e_c
            q_k = q  # round expert sizes to multiples of q unless one step moves FLOPs by > tol/4
            while q_k > 1 and slope * q_k > s.tol / 4 * s.f0:
                q_k //= 2
            for he_r in {max(q_k, he // q_k * q_k + j * q_k) for j in (-1, 0, 1, 2)}:

                def p_fn(e, he_r=he_r):
                    sized = _with(wide, top_k=k_c, expert_hidden=he_r, num_experts=e)
                    return count_params(sized)["total"]

                for e_r in _int_candidates(p_fn, e_c, s.p0, max(k_c, step), 1 << 20, step):
                    dev = 10 * abs(h_c / hq - want) / want + abs(k_c - kc0)
                    s.offer(_with(wide, top_k=k_c, expert_hidden=he_r, num_experts=e_r), dev)
    return s.result("wider_concept", note=f"width target sqrt(R) = {want:.3f}")


def search_reallocations(
    baseline_cfg: ModelConfig,
    ratio: float,
    tol: float = 0.02,
    loop_fraction: float = 0.25,
    loop_layers: int | None = None,
    concept_heads: int | None = None,
) -> dict[str, Reallocation]:
    """The three section-3.5 strategies for `baseline_cfg` at compression ratio `ratio`,
    with match info.

    Strategy 2 aims at `loop_layers` looped concept layers (default: `loop_fraction` of them);
    strategy 3 at the concept head count nearest sqrt(R) x heads unless `concept_heads` fixes it
    (paper 4.2: 1.5x).
    """
    if baseline_cfg.chunk.enabled:
        raise ValueError(
            "reallocate expects the MoE baseline (chunk.enabled: false); "
            "use cfg.baseline() for the same model without chunking"
        )
    if not ratio > 1.0:
        raise ValueError(f"compression ratio R must be > 1, got {ratio}")
    if baseline_cfg.concept_layers < 1:
        raise ValueError(
            "the baseline has no concept layers (concept_layers = 0): nothing to compress"
        )
    return {
        "more_experts": _more_experts(baseline_cfg, ratio, tol),
        "loop_more_experts": _loop_more_experts(
            baseline_cfg, ratio, tol, loop_fraction, loop_layers
        ),
        "wider_concept": _wider_concept(baseline_cfg, ratio, tol, concept_heads),
    }


def reallocate(
    baseline_cfg: ModelConfig, ratio: float, tol: float = 0.02, **options
) -> dict[str, ModelConfig]:
    """ConceptMoE configs for the three strategies, matched to the baseline's FLOPs and parameters.

    `options` go to `search_reallocations` (loop_fraction, loop_layers, concept_heads).
    """
    return {
        k: r.config for k, r in search_reallocations(baseline_cfg, ratio, tol, **options).items()
    }


def describe_changes(base: ModelConfig, cfg: ModelConfig) -> str:
    """Short human description of how `cfg` differs from `base` in the knobs the strategies turn."""
    out = []
    if cfg.chunk.enabled and not base.chunk.enabled:
        out.append(f"R={cfg.chunk.target_ratio:g}")
    if cfg.moe.top_k != base.moe.top_k:
        out.append(f"E/D top_k {base.moe.top_k}->{cfg.moe.top_k}")
    bm, cm = base.c_moe, cfg.c_moe
    for field, label in (
        ("top_k", "C top_k"),
        ("num_experts", "C experts"),
        ("expert_hidden", "C expert_hidden"),
    ):
        if getattr(cm, field) != getattr(bm, field):
            out.append(f"{label} {getattr(bm, field)}->{getattr(cm, field)}")
    if cfg.c_hidden != base.c_hidden or cfg.c_heads != base.c_heads:
        out.append(
            f"C hidden {base.c_hidden}->{cfg.c_hidden}, heads "
            f"{base.c_heads}/{base.c_kv_heads}->{cfg.c_heads}/{cfg.c_kv_heads}"
        )
    if len(cfg.concept_schedule) != len(base.concept_schedule):
        out.append(f"loop layers [{cfg.loop_start},{cfg.loop_end})x{cfg.loop_times}")
    return "; ".join(out) or "-"


def comparison_table(
    baseline_cfg: ModelConfig,
    ratio: float,
    seq_len: int = 32768,
    bytes_per_el: int = 2,
    causal: bool = True,
    tol: float = 0.02,
    extra: dict[str, ModelConfig] | None = None,
    found: dict[str, Reallocation] | None = None,
    **options,
) -> list[dict]:
    """Rows of Table 1 with numbers: the baseline, the three strategies and any `extra` configs.

    Reductions are baseline / config (concept model alone, as in Table 1, and the whole model).
    `found` reuses a `search_reallocations` result (e.g. when tabulating several sequence lengths).
    """
    base = summary(baseline_cfg, None, seq_len, bytes_per_el, causal)
    rows = [
        dict(
            name="baseline", method="Baseline (MoE)", changes="-", within_tol=True, note="", **base
        )
    ]
    found = (
        found if found is not None else search_reallocations(baseline_cfg, ratio, tol, **options)
    )
    items = [(k, STRATEGIES[k], r.config, r.within_tol, r.note) for k, r in found.items()]
    for k, cfg in (extra or {}).items():
        items.append((k, k, cfg, None, ""))
    for name, method, cfg, ok, note in items:
        row = summary(cfg, None, seq_len, bytes_per_el, causal)
        if ok is None:
            err = max(
                abs(row["flops_per_token"] / base["flops_per_token"] - 1),
                abs(row["total_params"] / base["total_params"] - 1),
            )
            ok = err <= tol
        rows.append(
            dict(
                name=name,
                method=method,
                changes=describe_changes(baseline_cfg, cfg),
                within_tol=ok,
                note=note,
                **row,
            )
        )
    for row in rows:
        row["flops_ratio"] = row["flops_per_token"] / base["flops_per_token"]
        row["params_ratio"] = row["total_params"] / base["total_params"]
        row["attn_reduction_concept"] = base["attn_map_flops_concept"] / max(
            row["attn_map_flops_concept"], 1e-30
        )
        row["kv_reduction_concept"] = base["kv_cache_bytes_concept"] / max(
            row["kv_cache_bytes_concept"], 1e-30
        )
        row["attn_reduction"] = base["attn_map_flops"] / max(row["attn_map_flops"], 1e-30)
        row["kv_reduction"] = base["kv_cache_bytes"] / max(row["kv_cache_bytes"], 1e-30)
    return rows
