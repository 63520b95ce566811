"""Attention over packed rows (several documents per row): time and the size of the T x T
temporaries, per backend.

Legend: B rows, T tokens, S documents.

Backends (vlm.model.attention): `sdpa` with the dense packed mask (the fallback, and the CPU path
under torch.compile; the mask is built once per stack, so it is built outside the timed call here),
`eager` (scores materialised in fp32), per-document SDPA (one causal call per document: the CPU
default `docs`, and what a varlen kernel does in one launch; the same output), and for reference
plain causal SDPA over the whole row (ignores document borders, so a different output: the cost of
the mask alone). `flash` and FlexAttention (the CUDA defaults: a compiled kernel per shape, no CPU
backward) are measured by `vlm bench gpu`.

Memory: CPU peak memory of torch tensors is not visible to tracemalloc, so the part reports the
analytic size of the tensors that grow as T^2, per call: the bool mask (B*T^2 bytes) plus the fp32
copy SDPA makes of it (aten::where, seen with torch.profiler), the fp32 scores (B*Q*T^2*4) for
eager, and none for the per-document and causal calls (CPU flash kernels work in blocks). A backend
whose temporaries would exceed `max_quadratic_bytes` is skipped at that length and listed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from eval.bench import common
from eval.bench.model import BASE
from vlm.model.attention import attend, packed_mask

PART = "attention"
BASELINE = "sdpa + packed mask"


@dataclass
class Settings:
    seq_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384])
    docs_per_row: int = 4
    repeats: int = 5
    warmup: int = 1
    modes: tuple[str, ...] = ("forward", "forward+backward")
    max_quadratic_bytes: int = 2 * 2**30


SETTINGS = {
    "full": Settings(),
    "quick": Settings(seq_lens=[1024, 2048, 4096]),
    "smoke": Settings(seq_lens=[128], repeats=2),
}


def documents(T: int, n: int, seed: int = 0) -> torch.Tensor:
    """[1, T] document ids 0..n-1 of random lengths, each at least T / (4n)."""
    g = torch.Generator().manual_seed(seed)
    share_S = torch.rand(n, generator=g) + 0.25
    len_S = (share_S / share_S.sum() * T).long()
    len_S[-1] += T - int(len_S.sum())
    return torch.repeat_interleave(torch.arange(n), len_S)[None]


def per_document(q, k, v, doc_BT):
    """One causal SDPA per document of the (single) row: a loop over documents, not tokens."""
    counts = torch.unique_consecutive(doc_BT[0], return_counts=True)[1].tolist()
    parts = zip(q.split(counts, 2), k.split(counts, 2), v.split(counts, 2))
    return torch.cat(
        [
            F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
            for a, b, c in parts
        ],
        2,
    )


def quadratic_bytes(name: str, B: int, Q: int, T: int) -> int:
    return {BASELINE: B * T * T * (1 + 4), "eager": B * T * T + B * Q * T * T * 4}.get(name, 0)


def backends(doc_BT, mask_B1TT):
    return {
        BASELINE: lambda q, k, v: attend(q, k, v, doc_BT, "sdpa", mask_B1TT),
        "eager": lambda q, k, v: attend(q, k, v, doc_BT, "eager", mask_B1TT),
        "per-document sdpa (varlen-style)": lambda q, k, v: per_document(q, k, v, doc_BT),
        "causal sdpa, no document mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
    }


def _timed(fn, q, k, v, g, backward: bool):
    def call():
        if not backward:
            with torch.no_grad():
                fn(q, k, v)
            return
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        (fn(qq, kk, vv) * g).sum().backward()

    return call


def run(s: Settings, log=print) -> dict:
    B, Q, J, d = 1, BASE.num_heads, BASE.num_kv_heads, BASE.head_dim
    skipped, out = {}, []
    unavailable = {
        "flash": "flash-attn varlen kernel: needs the flash-attn package and a CUDA device"
    }
    for T in s.seq_lens:
        gen = torch.Generator().manual_seed(T)
        q, g = torch.randn(B, Q, T, d, generator=gen), torch.randn(B, Q, T, d, generator=gen)
        k, v = torch.randn(B, J, T, d, generator=gen), torch.randn(B, J, T, d, generator=gen)
        doc_BT = documents(T, s.docs_per_row)
        all_fns = backends(doc_BT, packed_mask(doc_BT))
        with torch.no_grad():
            ref = all_fns[BASELINE](q, k, v)
        for mode in s.modes:
            backward = mode == "forward+backward"
            fns, extra = {}, {}
            for name, fn in all_fns.items():
                qb = quadratic_bytes(name, B, Q, T)
                if qb > s.max_quadratic_bytes:
                    skipped[f"{name} at T={T}"] = f"T x T temporaries of {qb / 2**30:.1f} GiB"
                    continue
                with torch.no_grad():
                    diff = float((fn(q, k, v) - ref).abs().max())
                fns[name] = _timed(fn, q, k, v, g, backward)
                extra[name] = {"quadratic_temp_bytes": qb, "max_abs_diff_vs_sdpa": diff}
            secs = common.measure(fns, s.repeats, s.warmup)
            ms = {n: [1000 * t for t in ts] for n, ts in secs.items()}
            rs = common.rows(ms, BASELINE, {"mode": mode, "seq_len": T}, "time", "ms", extra)
            out += rs
            log(
                f"  attention {mode} T={T}: "
                + ", ".join(f"{r['candidate']} x{r['ratio_vs_baseline']:.2f}" for r in rs)
            )
    unavailable["flex"] = (
        "FlexAttention: the CUDA default (compiled per shape, no CPU backward): vlm bench gpu"
    )
    return common.result(
        PART,
        {**asdict(s), "batch": B, "heads": Q, "kv_heads": J, "head_dim": d},
        out,
        unavailable={**unavailable, **skipped},
        memory_method="analytic: bytes of the tensors that grow as T^2 in one call "
        "(quadratic_temp_bytes); tracemalloc does not see torch's CPU allocations",
        notes=[
            "time ratio = median ms / sdpa's (below 1: faster)",
            (
                "causal sdpa without the document mask computes "
                "a different function (cost of the mask alone)"
            ),
        ],
    )


def plot(res: dict, path) -> None:
    # The analytic memory goes in as rows of its own panel; backends without T x T temporaries have
    # no line.
    mem = [
        {
            **r,
            "metric": "T x T temporaries",
            "unit": "MiB",
            "median": r["quadratic_temp_bytes"] / 2**20,
            "spread": None,
            "setting": {**r["setting"], "mode": "per call"},
        }
        for r in res["rows"]
        if r["setting"]["mode"] == "forward" and r["quadratic_temp_bytes"]
    ]
    common.plot(
        {**res, "rows": res["rows"] + mem},
        path,
        x="seq_len",
        panels=("metric", "mode"),
        y="median",
        logy=True,
        title=f"packed attention, {res['settings']['docs_per_row']} documents per row",
    )
