"""The prefill section: forward tokens/s of one row at each length, with boundaries forced at T/R
and learned.

Legend: B rows, T tokens.

Eval mode sizes the concept stack by `chunk.eval_capacity_slack`, null by default: all T positions,
so that inference is exact whatever a prompt's ratio, at the cost of the unused positions' dense
projections (the experts and the attention skip them). A third row per ConceptMoE, "forced, tight",
runs with the training capacity (`chunk.capacity_slack`) instead: what a deployment that sets
`eval_capacity_slack` gets."""

from __future__ import annotations

import dataclasses
import time

import torch

from configs.batch import PackedBatch
from eval.bench import common
from eval.bench.gpu.rig import forward_fn, make_batch, model_flops, timed
from eval.bench.gpu.state import Run
from eval.bench.model import BASELINE


def prefill(r: Run) -> str | None:
    """Lengths from the shortest up, while the budget (and the section's own limit) leaves room for
    the next one: a length takes about twice the one before it, and compiles (FlexAttention's graph
    per shape) need time."""
    s = r.s
    last, skipped, t_start = 0.0, [], time.perf_counter()
    for T in s.prefill_lens:
        if (
            skipped
            or r.budget.left() < max(20.0, 2.5 * last)
            or time.perf_counter() - t_start > s.prefill_max_s
        ):
            skipped.append(T)
            continue
        t0 = time.perf_counter()
        try:
            _at(r, T)
        except Exception as e:  # noqa: BLE001
            r.error(f"prefill T={T}", e)
        last = time.perf_counter() - t0
    return f"time budget: lengths {skipped} not measured" if skipped else None


def _at(r: Run, T: int) -> None:
    s, dev = r.s, r.dev
    batch, force = make_batch(1, T, r.cfgs[BASELINE].vocab_size, dev, seed=2), r.force(1, T)
    fns, extra, of = {}, {}, {}  # of: the candidate a row's model is
    for n, m in r.models.items():
        if not r.cfgs[n].chunk.enabled:
            fns[n], extra[n], of[n] = (
                timed(dev, forward_fn(m, batch, None)),
                {"boundaries": "none", "R": 1.0},
                n,
            )
            continue
        for kind, f in (("forced", force), ("learned", None)):
            k = f"{n} ({kind})"
            fns[k], of[k] = timed(dev, forward_fn(m, batch, f)), n
            extra[k] = (
                {"boundaries": kind, "R": s.ratio}
                if f is not None
                else {"boundaries": kind, **_realized(m, batch)}
            )
        k = f"{n} (forced, tight)"
        fns[k], of[k] = timed(dev, _with_eval_capacity(m, forward_fn(m, batch, force))), n
        extra[k] = {
            "boundaries": "forced",
            "R": s.ratio,
            "eval_capacity_slack": m.cfg.chunk.capacity_slack,
        }
    fns = r.warm(fns, 1, f"prefill T={T}")
    secs = common.measure(fns, s.prefill_repeats, warmup=0)
    rs = r.rows(
        common.per_second(secs, T),
        {"section": "prefill", "rows": 1, "seq_len": T},
        "prefill tokens/s",
        "tok/s",
        {k: v for k, v in extra.items() if k in fns},
    )
    for row in rs:  # learned rows: the model FLOPs at the router's own ratio
        f, a = model_flops(r.cfgs[of[row["candidate"]]], row["R"], T)
        row["mfu"], row["mfu_incl_attn_map"] = (
            r.mfu(f * row["median"]),
            r.mfu((f + a) * row["median"]),
        )
    r.log(
        f"  prefill T={T}: "
        + ", ".join(f"{row['candidate']} x{row['ratio_vs_baseline']:.2f}" for row in rs)
    )
    del batch
    dev.free()


def _with_eval_capacity(model, fn):
    """`fn` with the chunk module's eval capacity set to its training one for the call."""

    def call():
        ch = model.chunker
        before = ch.cfg
        ch.cfg = dataclasses.replace(before, eval_capacity_slack=before.capacity_slack)
        try:
            return fn()
        finally:
            ch.cfg = before

    return call


def _realized(model, batch: PackedBatch) -> dict:
    """The router's own ratio on this row (eval mode, p >= 0.5), and the concepts past the static capacity."""
    model.eval()
    with torch.no_grad():
        ch = model(batch).chunks
    out = {"R": round(float((batch.doc_ids >= 0).sum()) / max(1.0, float(ch.b_BT.sum())), 3)}
    overflow = getattr(ch, "overflow", None)
    if overflow is not None:
        out["overflow"] = int(overflow.sum()) if torch.is_tensor(overflow) else overflow
    return out
