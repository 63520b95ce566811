"""Step metrics, accumulated: sums kept by name on the device, one all-reduce per optimizer step,
one `StepRecord` per step that every sink receives (the sinks: vlm.train.metrics_sinks).

Legend: B rows, T tokens, E experts, S documents, Y statistics groups (kinds of sample, then
sources), X bins; the 2 of `hist_Y2X` is the modality (text, image).

A logged value is added in one place, `StepAccumulator.add_output`, as a sum by name: a plain sum
(`add`), a count (`add_count`, logged as an int), or a mean (`add_mean(name, total, weight)`, logged
as total / weight over the global batch: every micro-batch of every rank, whatever the split of
rows across ranks; None where the weight is 0). `reduce` all-reduces every sum in one collective,
by sorted key; `record` derives the means and hands one `StepRecord` to every sink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from configs.batch import IGNORE_INDEX, KINDS, PackedBatch
from vlm.model.doc_stats import MODS as DOC_MODS
from vlm.model.doc_stats import (
    NBINS,
    document_counts,
    document_labels,
    group_histogram,
    histogram_quantiles,
)
from vlm.model.moe import expert_overflow, mean_adjugate_per_token
from vlm.model.output import ModelOutput
from vlm.model.stats import chunk_stats, lm_labels, lm_token_losses, sample_has_image
from vlm.train.losses import LossResult

MODS = ("all", "text", "image")
WEIGHT = "#weight"  # suffix of a mean's weight among the sums
HISTOGRAMS, GROUP_LOSS = "groups/doc_ratio_hist", "groups/loss"  # [Y, 2, X], [Y, 2] sums


def labelled_counts(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions with an LM loss overall, in text-only samples and in image-text samples."""
    labelled = lm_labels(batch) != IGNORE_INDEX
    mm = sample_has_image(batch.doc_ids, batch.modality)
    return labelled.sum(), (labelled & ~mm).sum(), (labelled & mm).sum()


class StepAccumulator:
    """Sums of one optimizer step on this rank, by name, kept on the device; `reduce()` all-reduces
    them in one call and brings them to the host in one transfer."""

    def __init__(
        self,
        device: torch.device,
        bytes_per_id: torch.Tensor | None = None,
        n_sources: int = 0,
    ):
        """bytes_per_id: UTF-8 bytes per token id (the tokenizer's), for bits per byte of the text.
        n_sources: the run's data sources, for per-source statistics next to the per-kind ones."""
        self.device = device
        self.bytes_per_id = bytes_per_id
        self.n_groups = len(KINDS) + n_sources
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: set[str] = set()

    def add(self, name: str, value) -> None:
        """Add to the sum `name` (a number or a tensor of any shape, summed over the global batch)."""
        v = torch.as_tensor(value).detach().to(self.device, torch.float64)
        self.sums[name] = self.sums[name] + v if name in self.sums else v

    def add_count(self, name: str, value) -> None:
        """A sum of counts, logged as an int."""
        self.counts.add(name)
        self.add(name, value)

    def add_mean(self, name: str, total, weight) -> None:
        """A mean over the global batch: logged as sum(total) / sum(weight) (None where 0)."""
        self.add(name, total)
        self.add(name + WEIGHT, weight)

    def add_output(
        self,
        out: ModelOutput,
        batch: PackedBatch,
        loss: LossResult | None = None,
        token_loss_BT: torch.Tensor | None = None,
        row: tuple | None = None,
    ) -> None:
        """What one micro-batch adds to the step's metrics: every loss term (`loss/NAME`, and the
        weighted total `loss`), the LM loss by kind of sample and in bits per byte, tokens,
        boundaries, realized compression and mean p per modality, expert loads, the Grove adjugate
        rate, concept overflow, and per kind and source the documents' ratios and LM loss. Without
        `loss` (a model scored, not trained: held-out batches, `vlm eval ppl`), `token_loss_BT`
        gives the LM loss, `loss/lm`, as the mean over every batch's labelled tokens. `row`
        (sequence parallelism: `batch` and `out` are this rank's part of their rows): (the whole
        batch, the whole rows' boundaries, the SequenceShard); a sample's kind (image-text or
        text-only) and each document's ratio are then the rows' (the documents counted by the
        group's first rank)."""
        if loss is not None:
            for name, share in loss.shares().items():
                self.add(name, share)
            token_loss_BT = loss.detail.get("token_loss_BT")
        elif token_loss_BT is not None:
            labelled = lm_labels(batch) != IGNORE_INDEX
            self.add_mean("loss/lm", token_loss_BT.sum(), labelled.sum())
        valid_BT = batch.doc_ids >= 0
        ch = out.chunks
        p_BT = ch.p_BT if ch is not None else valid_BT.float()
        b_BT = ch.b_BT if ch is not None else valid_BT
        cs = chunk_stats(p_BT, b_BT, batch.doc_ids, batch.modality)
        for m in MODS:
            n = cs[f"tokens/{m}"]
            self.add_count("tokens" if m == "all" else f"tokens/{m}", n)
            ratio = "compression/ratio" if m == "all" else f"compression/{m}"
            self.add_mean(ratio, n, cs[f"boundaries/{m}"])
            self.add_mean(f"boundary_p/{m}", cs[f"boundary_p/{m}"] * n, n)
        self.add_count("chunk/overflow", ch.overflow if ch is not None else 0)
        if out.moe_passes:
            self.add_mean(
                "moe/adjugate_per_token", mean_adjugate_per_token(list(out.moe.values())), 1
            )
            for k, st in out.moe.items():
                self.add(f"load/{k}", st.load_E)
            overflow = expert_overflow([s for _, s in out.moe_passes])
            if overflow is not None:  # expert parallelism's capacity (vlm.model.expert_parallel)
                self.add_count("moe/overflow", overflow)
        if token_loss_BT is not None:
            self._add_lm_split(batch, token_loss_BT, row)
        self._add_groups(batch, b_BT, valid_BT, token_loss_BT, row)

    def _add_lm_split(self, batch: PackedBatch, token_loss_BT: torch.Tensor, row=None) -> None:
        """The LM loss of text-only and image-text samples (the paper's textloss / mmloss), and the
        text-only samples' bits per UTF-8 byte they predict."""
        labelled = lm_labels(batch) != IGNORE_INDEX
        if row is None:
            mm = sample_has_image(batch.doc_ids, batch.modality)
        else:  # a sample's kind is its whole document's
            whole, _, shard = row
            mm = shard.local(sample_has_image(whole.doc_ids, whole.modality))
        text_only = labelled & ~mm
        for name, sel in (("loss/text_only", text_only), ("loss/image_text", labelled & mm)):
            self.add_mean(name, (token_loss_BT * sel).sum(), sel.sum())
        if self.bytes_per_id is not None:
            ids = batch.labels.clamp(0, len(self.bytes_per_id) - 1)
            per_pos = self.bytes_per_id.to(batch.labels.device)[ids]
            text_bytes = torch.where(text_only, per_pos, torch.zeros_like(per_pos)).sum()
            bits = (token_loss_BT.double() * text_only).sum() / math.log(2)
            self.add_mean("bpb/text", bits, text_bytes)

    def _add_groups(self, batch, b_BT, valid_BT, token_loss_BT, row=None) -> None:
        """Per kind of sample and per source: each document's realized ratio per modality into the
        histograms, and the LM loss sums."""
        hist_Y2X = torch.zeros(self.n_groups, 2, NBINS, dtype=torch.float64, device=self.device)
        loss_Y2 = torch.zeros(self.n_groups, 2, dtype=torch.float64, device=self.device)
        docs, doc_b_BT = batch, b_BT
        if row is not None:  # the whole rows' documents, counted once per group
            docs, doc_b_BT, shard = row
            doc_b_BT = doc_b_BT if doc_b_BT is not None else docs.doc_ids >= 0
        counts = document_counts(doc_b_BT, docs.doc_ids, docs.modality)
        if row is not None and row[2].rank != 0:
            counts = torch.zeros_like(counts)
        nk = len(KINDS)
        labels = [(batch.kind, 0, nk), (batch.source, nk, self.n_groups - nk)]
        doc_labels = [docs.kind, docs.source]
        lab_BT = lm_labels(batch) != IGNORE_INDEX
        for (label_BT, offset, n), doc_label_BT in zip(labels, doc_labels):
            if label_BT is None or n == 0:
                continue
            group_S = document_labels(doc_label_BT, docs.doc_ids)
            hist_Y2X[offset : offset + n] += group_histogram(counts, group_S, n).to(self.device)
            if token_loss_BT is not None:
                g = torch.where(lab_BT & (label_BT >= 0) & (label_BT < n), label_BT, n).flatten()
                sums = torch.zeros(n + 1, 2, dtype=torch.float64, device=g.device)
                sums[:, 0].index_add_(0, g, token_loss_BT.flatten().double())
                sums[:, 1].index_add_(0, g, lab_BT.flatten().double())
                loss_Y2[offset : offset + n] += sums[:n].to(self.device)
        self.add(HISTOGRAMS, hist_Y2X)
        self.add(GROUP_LOSS, loss_Y2)

    def reduce(self, across_ranks) -> dict[str, torch.Tensor]:
        """Every sum over the global batch, on the host, from one all-reduce (`across_ranks`) of
        all of them in sorted key order."""
        keys = sorted(self.sums)
        if not keys:
            return {}
        flat = across_ranks(torch.cat([self.sums[k].flatten() for k in keys])).cpu()
        out, i = {}, 0
        for k in keys:
            n = self.sums[k].numel()
            out[k] = flat[i : i + n].view(self.sums[k].shape)
            i += n
        return out

    def record(self, step: int, across_ranks, groups: list[str] | None = None) -> StepRecord:
        """The step's record from one all-reduce of its sums: every sum and mean by name, the
        documents' ratios and the LM loss per group, the experts' load imbalance, and the tensors
        the dashboard draws."""
        sums = self.reduce(across_ranks)
        scalars = derived_scalars(sums, self.counts)
        loads = {k: v for k, v in sums.items() if k.startswith("load/")}
        scalars.update(load_imbalance(loads))
        parts = None
        if HISTOGRAMS in sums:
            parts = (sums[HISTOGRAMS], sums[GROUP_LOSS])
            scalars.update(group_record(*parts, groups))
        return StepRecord(step, True, scalars, loads, groups=parts)


def token_losses(out: ModelOutput, batch: PackedBatch) -> torch.Tensor:
    """[B, T] the next-token loss at each position with an LM loss (0 elsewhere), detached: for a
    model scored rather than trained (computed in tiles of tokens: vlm.model.stats)."""
    return lm_token_losses(out, lm_labels(batch)).detach()


def derived_scalars(sums: dict[str, torch.Tensor], counts: set[str] = frozenset()) -> dict:
    """The logged scalars of reduced sums: a mean where the sum has a weight (None where it is 0),
    an int for a count, the sum itself otherwise. Tensors that are not scalars (loads, group
    histograms) are not scalars here."""
    out = {}
    for k, v in sums.items():
        if k.endswith(WEIGHT) or v.numel() != 1:
            continue
        if k + WEIGHT in sums:
            w = float(sums[k + WEIGHT])
            out[k] = float(v) / w if w > 0 else None
        else:
            out[k] = int(round(float(v))) if k in counts else float(v)
    return out


def group_names(source_names: list[str] | None = None) -> list[str]:
    """Names of the statistics groups: the kinds of sample, then `source:NAME` per data source."""
    return list(KINDS) + [f"source:{n}" for n in (source_names or [])]


def group_record(
    hist_Y2X: torch.Tensor, loss_Y2: torch.Tensor, names: list[str] | None = None
) -> dict:
    """Per kind (and source): the documents' ratio per modality as p10 / p50 / p90
    (`doc_ratio/KIND/MOD/pNN`, with `.../docs` and `.../no_concept` share), and the LM loss
    (`loss/kind/KIND`, `loss/source/NAME`)."""
    names = names or group_names()
    rec = {}
    for g in range(hist_Y2X.shape[0]):
        name = names[g] if g < len(names) else f"group{g}"
        for j, m in enumerate(DOC_MODS):
            q = histogram_quantiles(hist_Y2X[g, j])
            if q is not None:
                for k, v in q.items():
                    rec[f"doc_ratio/{name}/{m}/{k}"] = v
        if loss_Y2[g, 1] > 0:
            key = (
                f"loss/source/{name[len('source:') :]}"
                if name.startswith("source:")
                else f"loss/kind/{name}"
            )
            rec[key] = float(loss_Y2[g, 0] / loss_Y2[g, 1])
    return rec


def load_imbalance(loads: dict[str, torch.Tensor]) -> dict[str, float]:
    """max / mean expert load per MoE layer over the step (1 = perfectly balanced)."""
    out = {}
    for k, load in loads.items():
        mean = float(load.mean())
        if mean > 0:
            out[f"moe/max_over_mean/{k[len('load/') :]}"] = float(load.max()) / mean
    return out


@dataclass
class StepRecord:
    """Everything one optimizer step logs, in one object from the accumulator to every sink.
    `scalars` is the step's metrics.jsonl line and what TensorBoard and W&B plot; the tensors are
    what the dashboard draws. The step fills it (`StepAccumulator.record`), the trainer adds what
    only it knows (`timed`, `scalars.update` for the gradient norm, data counters and held-out
    eval), and `MetricsLogger.write` hands it to every sink."""

    step: int  # optimizer steps done, this one included
    applied: bool
    scalars: dict = field(default_factory=dict)
    # per MoE layer: routed slots per expert
    loads: dict[str, torch.Tensor] = field(default_factory=dict)
    # the last micro-batch's chunking on this rank: (p, boundary, modality), each [B, T]
    chunking: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    groups: tuple[torch.Tensor, torch.Tensor] | None = None  # group_parts of the reduced sums
    # (image [H, W, 3], text) of the held-out eval, when drawn
    pictures: tuple | None = None

    def __post_init__(self):
        self.scalars = {
            "step": self.step,
            **({} if self.applied else {"skipped": True}),
            **self.scalars,
        }

    def timed(self, lr: float, seconds: float) -> StepRecord:
        """The schedule's lr and the wall time of the step (data loading included), as tokens per second."""
        tokens = self.scalars.get("tokens", 0)
        self.scalars.update(
            lr=lr,
            step_time_s=seconds,
            **({"tokens_per_s": tokens / seconds if seconds > 0 else 0.0} if self.applied else {}),
        )
        return self
