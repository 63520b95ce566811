"""Per-document compression: each document's realized ratio per modality, and its
distribution per group.

Legend: B rows, T tokens, S documents.

A batch aggregate (all tokens / all concepts) lets the router meet its target with all-or-nothing
documents: a caption merged into one concept and a chat prompt left unmerged average to R = 2. So
compression is judged per document: a document's ratio for a modality is its tokens of that modality
over its concepts that end on one of them (infinite when none does: every such token sits in a
concept that closes elsewhere). Distributions are kept per group (the kind of sample, the data
source) as fixed log-spaced histograms, which sum over micro-batches and ranks in the step's one
all-reduce; exact per-document values are for evaluation (`document_ratios`).
"""

from __future__ import annotations

import math

import torch

from configs.batch import IMAGE, KINDS, TEXT

MODS = ("text", "image")
# Histogram bins over a document's ratio: [2^(i/8), 2^((i+1)/8)) for i < 48 (1 to 64, 9 % wide),
# [64, inf), and a last bin for documents with tokens of the modality but no concept ending on one
# (ratio infinite).
EDGES = [2 ** (i / 8) for i in range(49)]
NBINS = len(EDGES) + 1
OVERFLOW, NO_CONCEPT = len(EDGES) - 1, len(EDGES)


def document_slots(doc_BT: torch.Tensor, row_tokens: int | None = None) -> tuple[torch.Tensor, int]:
    """A slot per (row, document): [B, T] slot index (row * (T + 1) + doc; padding goes to the row's
    spare slot T) and the number of slots. `row_tokens`: T where `doc_BT` is part of longer rows (a
    sequence shard's: every shard of a row then numbers its documents' slots alike)."""
    B, T = doc_BT.shape
    T = T if row_tokens is None else row_tokens
    rows = torch.arange(B, device=doc_BT.device)[:, None] * (T + 1)
    return rows + torch.where(doc_BT >= 0, doc_BT, torch.full_like(doc_BT, T)), B * (T + 1)


def document_counts(
    b_BT: torch.Tensor, doc_BT: torch.Tensor, modality_BT: torch.Tensor
) -> torch.Tensor:
    """[S, 2, 2]: per document slot and modality (text, image), (tokens, concepts ending on them)."""
    slot_BT, S = document_slots(doc_BT)
    valid = doc_BT >= 0
    out = torch.zeros(S, 2, 2, device=doc_BT.device)
    for j, m in enumerate((TEXT, IMAGE)):
        sel = (valid & (modality_BT == m)).flatten().float()
        out[:, j, 0].index_add_(0, slot_BT.flatten(), sel)
        out[:, j, 1].index_add_(0, slot_BT.flatten(), sel * b_BT.flatten().float())
    return out


def document_labels(label_BT: torch.Tensor | None, doc_BT: torch.Tensor) -> torch.Tensor:
    """[S] the label (kind or source index) of each document slot; -1 for empty slots or unknown labels."""
    slot_BT, S = document_slots(doc_BT)
    out = torch.full((S,), -1, dtype=torch.long, device=doc_BT.device)
    if label_BT is None:
        return out
    lab = torch.where(doc_BT >= 0, label_BT, torch.full_like(label_BT, -1))
    return out.scatter_reduce(0, slot_BT.flatten(), lab.flatten(), reduce="amax")


def ratio_bins(counts_S22: torch.Tensor) -> torch.Tensor:
    """[S, 2] histogram bin of each document's ratio per modality (-1 where it has no token of the modality)."""
    n, c = counts_S22[..., 0], counts_S22[..., 1]
    ratio = n / c.clamp_min(1)
    edges = torch.tensor(EDGES, device=n.device, dtype=ratio.dtype)
    b = (torch.bucketize(ratio, edges, right=True) - 1).clamp(0, OVERFLOW)
    b = torch.where(c > 0, b, torch.full_like(b, NO_CONCEPT))
    return torch.where(n > 0, b, torch.full_like(b, -1))


def group_histogram(counts_S22: torch.Tensor, group_S: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[Y, 2, X] document counts per kind, modality and ratio bin (documents of group -1 are left out)."""
    bins_S2 = ratio_bins(counts_S22)
    ok = (bins_S2 >= 0) & (group_S[:, None] >= 0) & (group_S[:, None] < n_groups)
    flat = (
        group_S[:, None].clamp(0, max(n_groups - 1, 0)) * 2 + torch.arange(2, device=group_S.device)
    ) * NBINS + bins_S2.clamp_min(0)
    hist = torch.zeros(max(n_groups, 1) * 2 * NBINS, device=counts_S22.device, dtype=torch.float64)
    hist.index_add_(0, flat.flatten(), ok.flatten().to(torch.float64))
    return hist.view(max(n_groups, 1), 2, NBINS)[:n_groups]


def bin_value(i: int) -> float:
    """A representative ratio for bin i: the geometric middle of a finite bin, 64 for the overflow, inf for none."""
    if i == NO_CONCEPT:
        return math.inf
    if i == OVERFLOW:
        return EDGES[-1]
    return math.sqrt(EDGES[i] * EDGES[i + 1])


def histogram_quantiles(hist, qs=(0.1, 0.5, 0.9)) -> dict[str, float] | None:
    """Quantiles (nearest rank) of the documents a histogram counts, plus their number and the share
    with no concept; None when it counts none."""
    counts = [float(x) for x in hist]
    total = sum(counts)
    if total <= 0:
        return None
    out = {}
    for q in qs:
        rank, cum = max(math.ceil(q * total), 1), 0.0
        for i, c in enumerate(counts):
            cum += c
            if cum >= rank:
                out[f"p{round(q * 100)}"] = bin_value(i)
                break
    out["docs"] = total
    out["no_concept"] = counts[NO_CONCEPT] / total
    return out


def document_ratios(
    b_BT: torch.Tensor,
    doc_BT: torch.Tensor,
    modality_BT: torch.Tensor,
    kind_BT: torch.Tensor | None = None,
) -> list[dict]:
    """Exact per-document figures (host side, for evaluation): one dict per document with
    its kind and, per modality it has, tokens, concepts and ratio (inf when no concept ends
    on that modality)."""
    counts = document_counts(b_BT, doc_BT, modality_BT).cpu()
    kinds = document_labels(kind_BT, doc_BT).cpu()
    present = counts[..., 0].sum(1) > 0
    out = []
    for s in present.nonzero().flatten().tolist():
        rec = {"kind": KINDS[kinds[s]] if kinds[s] >= 0 else None}
        for j, m in enumerate(MODS):
            n, c = float(counts[s, j, 0]), float(counts[s, j, 1])
            if n > 0:
                rec[m] = {"tokens": n, "concepts": c, "ratio": n / c if c > 0 else math.inf}
        out.append(rec)
    return out


def summarize_documents(docs: list[dict], qs=(0.1, 0.5, 0.9)) -> dict:
    """{kind: {modality: {p10, p50, p90, mean, docs, no_concept}}} over exact per-document figures,
    plus "all" (every kind). "mean" is the aggregate (tokens / concepts over the group): shown next
    to the distribution, never alone."""
    out: dict = {}
    groups: dict[str, list[dict]] = {"all": docs}
    for d in docs:
        groups.setdefault(d["kind"] or "unknown", []).append(d)
    for g, ds in groups.items():
        per = {}
        for m in MODS:
            vals = sorted(d[m]["ratio"] for d in ds if m in d)
            if not vals:
                continue
            rec = {
                f"p{round(q * 100)}": vals[min(max(math.ceil(q * len(vals)), 1), len(vals)) - 1]
                for q in qs
            }
            tokens = sum(d[m]["tokens"] for d in ds if m in d)
            concepts = sum(d[m]["concepts"] for d in ds if m in d)
            rec["aggregate"] = tokens / concepts if concepts else math.inf
            rec["docs"] = len(vals)
            rec["no_concept"] = sum(1 for v in vals if math.isinf(v)) / len(vals)
            per[m] = rec
        if per:
            out[g] = per
    return out


def format_distribution(summary: dict, indent: str = "  ") -> list[str]:
    """Lines of a per-kind table: p10 / median / p90 of the documents' ratios next to the aggregate."""
    f = lambda v: "inf" if math.isinf(v) else f"{v:.2f}"  # noqa: E731
    w = max([12] + [len(g) + 2 for g in summary])
    head = f"{'kind':<{w}}{'modality':<9}{'docs':>6}{'p10':>8}{'median':>8}{'p90':>8}"
    lines = [f"{indent}{head}{'aggregate':>10}{'no concept':>12}"]
    for g, per in summary.items():
        for m, r in per.items():
            agg = f(r["aggregate"]) if "aggregate" in r else "-"
            quantiles = f"{f(r['p10']):>8}{f(r['p50']):>8}{f(r['p90']):>8}"
            lines.append(
                f"{indent}{g:<{w}}{m:<9}{int(r['docs']):>6}{quantiles}{agg:>10}"
                f"{100 * r['no_concept']:>11.0f}%"
            )
    return lines
