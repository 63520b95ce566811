"""Step metrics: per-micro-batch sums, one all-reduce per optimizer step, one JSON line
per logged step.

Everything that is a mean over tokens is carried as (sum, count) so that the logged value is the
mean over the GLOBAL batch (all ranks, all micro-batches), whatever the split of rows across ranks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from configs.batch import IGNORE_INDEX, IMAGE, KINDS, PackedBatch
from vlm.model.doc_stats import MODS as DOC_MODS
from vlm.model.doc_stats import (
    NBINS,
    document_counts,
    document_labels,
    group_histogram,
    histogram_quantiles,
)
from vlm.model.moe import mean_adjugate_per_token
from vlm.model.output import ModelOutput, total_loss
from vlm.model.stats import chunk_stats, sample_has_image
from vlm.train.config import LoggingConfig
from vlm.train.dashboard import Dashboard
from vlm.train.tracking import WandbTracker

MODS = ("all", "text", "image")
# Fixed order of the summed scalars.
FIELDS = (
    [
        "n_lab",
        "lm_sum",
        "n_text_only",
        "text_only_sum",
        "n_image_text",
        "image_text_sum",
        "balance_sum",
        "micro",
        "adjugate_sum",
        "bytes_text_only",
        "ratio_weight_sum",
        "overflow_sum",
    ]
    + [f"tokens/{m}" for m in MODS]
    + [f"boundaries/{m}" for m in MODS]
    + [f"psum/{m}" for m in MODS]
)
IDX = {k: i for i, k in enumerate(FIELDS)}


def labelled_counts(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labelled positions overall, in text-only samples and in image-text samples (images carry no loss)."""
    labelled = (batch.labels != IGNORE_INDEX) & (batch.modality != IMAGE)
    mm = sample_has_image(batch.doc_ids, batch.modality)
    return labelled.sum(), (labelled & ~mm).sum(), (labelled & mm).sum()


class StepAccumulator:
    """Sums of one optimizer step on this rank, kept on the device; `reduce()` all-reduces them in
    one call and brings them to the host in one transfer."""

    def __init__(
        self, device: torch.device, bytes_per_id: torch.Tensor | None = None, n_sources: int = 0
    ):
        """bytes_per_id: UTF-8 bytes per token id (the tokenizer's), for bits per byte of the text.
        n_sources: the run's data sources, for per-source statistics next to the per-kind ones."""
        self.device = device
        self.bytes_per_id = bytes_per_id
        self.n_groups = len(KINDS) + n_sources
        # per group (kinds, then sources): document-ratio histograms per modality, and (LM loss
        # sum, labelled)
        self.doc_hist = torch.zeros(self.n_groups, 2, NBINS, dtype=torch.float64, device=device)
        self.group_loss = torch.zeros(self.n_groups, 2, dtype=torch.float64, device=device)
        self.parts: list[torch.Tensor] = []
        self.loads: dict[str, torch.Tensor] = {}
        self.ratio_loss = torch.zeros((), device=device)

    def add(self, out: ModelOutput, batch: PackedBatch) -> None:
        n, n_to, n_it = labelled_counts(batch)
        valid = batch.doc_ids >= 0
        ch = out.chunks
        cs = chunk_stats(
            ch.p_BT if ch is not None else valid.float(),
            ch.b_BT if ch is not None else valid,
            batch.doc_ids,
            batch.modality,
        )
        zero = out.lm_loss.new_zeros(())
        split = {k: m.detach() for k, (m, _) in out.loss_split.items()}
        adj = torch.as_tensor(mean_adjugate_per_token(list(out.moe.values())) if out.moe else 0.0)
        text_bytes = zero_b = torch.zeros((), device=batch.labels.device)
        if self.bytes_per_id is not None:
            labelled = (batch.labels != IGNORE_INDEX) & (batch.modality != IMAGE)
            text_only = labelled & ~sample_has_image(batch.doc_ids, batch.modality)
            per_pos = self.bytes_per_id.to(batch.labels.device)[
                batch.labels.clamp(0, len(self.bytes_per_id) - 1)
            ]
            text_bytes = torch.where(text_only, per_pos, zero_b.long()).sum()
        values = {
            "n_lab": n,
            "lm_sum": out.lm_loss.detach() * n,
            "n_text_only": n_to,
            "bytes_text_only": text_bytes,
            "text_only_sum": split.get("loss/text_only", zero) * n_to,
            "n_image_text": n_it,
            "image_text_sum": split.get("loss/image_text", zero) * n_it,
            "balance_sum": out.balance_loss.detach(),
            "micro": torch.ones(()),
            "adjugate_sum": adj,
            "ratio_weight_sum": torch.tensor(float(out.ratio_weight), dtype=torch.float64),
            "overflow_sum": ch.overflow.detach() if ch is not None else zero,
        }
        for m in MODS:
            values[f"tokens/{m}"] = cs[f"tokens/{m}"]
            values[f"boundaries/{m}"] = cs[f"boundaries/{m}"]
            values[f"psum/{m}"] = cs[f"boundary_p/{m}"] * cs[f"tokens/{m}"]
        self.parts.append(torch.stack([values[k].to(self.device, torch.float64) for k in FIELDS]))
        self.add_groups(out, batch, valid)
        # The last micro-batch's ratio loss is computed on the step's global F and G
        # (global parser).
        self.ratio_loss = out.ratio_loss.detach()
        for k, st in out.moe.items():
            load = st.load_E.detach().double()
            self.loads[k] = self.loads[k] + load if k in self.loads else load

    def add_groups(self, out: ModelOutput, batch: PackedBatch, valid: torch.Tensor) -> None:
        """Per kind of sample and per source: each document's realized ratio per modality into the
        histograms, and the LM loss sums."""
        b_BT = out.chunks.b_BT if out.chunks is not None else valid
        counts = document_counts(b_BT, batch.doc_ids, batch.modality)
        nk = len(KINDS)
        labels = [(batch.kind, 0, nk), (batch.source, nk, self.n_groups - nk)]
        lab_BT = (batch.labels != IGNORE_INDEX) & (batch.modality != IMAGE)
        for label_BT, offset, n in labels:
            if label_BT is None or n == 0:
                continue
            group_S = document_labels(label_BT, batch.doc_ids)
            self.doc_hist[offset : offset + n] += group_histogram(counts, group_S, n).to(
                self.device
            )
            if out.token_loss_BT is not None:
                g = torch.where(lab_BT & (label_BT >= 0) & (label_BT < n), label_BT, n).flatten()
                sums = torch.zeros(n + 1, 2, dtype=torch.float64, device=g.device)
                sums[:, 0].index_add_(0, g, out.token_loss_BT.flatten().double())
                sums[:, 1].index_add_(0, g, lab_BT.flatten().double())
                self.group_loss[offset : offset + n] += sums[:n].to(self.device)

    def reduce(self, across_ranks) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        """(summed fields followed by the per-group histograms and losses, per-layer expert loads,
        the last ratio loss), all on the host, from one all-reduce."""
        keys = sorted(self.loads)
        vec = (
            torch.stack(self.parts).sum(0)
            if self.parts
            else torch.zeros(len(FIELDS), dtype=torch.float64, device=self.device)
        )
        vec = torch.cat([vec, self.doc_hist.flatten(), self.group_loss.flatten()])
        flat = across_ranks(torch.cat([vec] + [self.loads[k].to(self.device) for k in keys]))
        flat = torch.cat([flat, self.ratio_loss.to(flat).reshape(1)]).cpu()
        vec, rest = flat[: len(vec)], flat[len(vec) : -1]
        loads, i = {}, 0
        for k in keys:
            n = self.loads[k].numel()
            loads[f"load/{k}"] = rest[i : i + n]
            i += n
        return vec, loads, float(flat[-1])

    def record(
        self,
        step: int,
        across_ranks,
        ratio_weight: float | None = None,
        groups: list[str] | None = None,
    ) -> StepRecord:
        """The step's record from one all-reduce of its sums (`across_ranks`): global means, the
        experts' load imbalance, and the tensors the dashboard draws. `ratio_weight`, `groups`: as
        in `step_scalars`."""
        vec, loads, ratio_loss = self.reduce(across_ranks)
        scalars = step_scalars(vec, ratio_loss, ratio_weight, groups)
        scalars.update(load_imbalance(loads))
        return StepRecord(step, True, scalars, loads, groups=group_parts(vec))


def group_parts(vec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-group part of a reduced vector: ([Y, 2, NBINS] document-ratio histograms, [Y, 2] loss sums)."""
    tail = vec[len(FIELDS) :]
    Y = tail.numel() // (2 * NBINS + 2)
    return tail[: Y * 2 * NBINS].view(Y, 2, NBINS), tail[Y * 2 * NBINS :].view(Y, 2)


def group_names(source_names: list[str] | None = None) -> list[str]:
    """Names of the statistics groups: the kinds of sample, then `source:NAME` per data source."""
    return list(KINDS) + [f"source:{n}" for n in (source_names or [])]


def group_record(vec: torch.Tensor, names: list[str] | None = None) -> dict:
    """Per kind (and source): the documents' ratio per modality as p10 / p50 / p90
    (`doc_ratio/KIND/MOD/pNN`, with `.../docs` and `.../no_concept` share), and the LM loss
    (`loss/kind/KIND`, `loss/source/NAME`)."""
    hist, loss = group_parts(vec)
    names = names or group_names()
    rec = {}
    for g in range(hist.shape[0]):
        name = names[g] if g < len(names) else f"group{g}"
        for j, m in enumerate(DOC_MODS):
            q = histogram_quantiles(hist[g, j])
            if q is not None:
                for k, v in q.items():
                    rec[f"doc_ratio/{name}/{m}/{k}"] = v
        if loss[g, 1] > 0:
            key = (
                f"loss/source/{name[len('source:') :]}"
                if name.startswith("source:")
                else f"loss/kind/{name}"
            )
            rec[key] = float(loss[g, 0] / loss[g, 1])
    return rec


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def step_scalars(
    vec: torch.Tensor,
    ratio_loss: float,
    ratio_weight: float | None = None,
    groups: list[str] | None = None,
) -> dict:
    """The global means of one step's reduced sums. Absent modalities give null. `loss` is
    `total_loss` of the logged parts, the ratio loss weighted as the model weighted it
    (`ModelOutput.ratio_weight`, carried in `vec`) unless `ratio_weight` says otherwise (0: the LM
    and balance losses only)."""
    v = {k: float(vec[i]) for k, i in IDX.items()}
    lm = _div(v["lm_sum"], v["n_lab"]) or 0.0
    balance = v["balance_sum"] / max(v["micro"], 1)
    if ratio_weight is None:
        ratio_weight = v["ratio_weight_sum"] / max(v["micro"], 1)
    rec = {
        "loss": total_loss(lm, ratio_loss, balance, ratio_weight),
        "lm_loss": lm,
        "aux_loss": ratio_loss,
        "balance_loss": balance,
        "tokens": int(v["tokens/all"]),
        "loss/text_only": _div(v["text_only_sum"], v["n_text_only"]),
        # bits per byte of the text-only samples: their summed loss in bits over the UTF-8 bytes
        # they predict
        "bpb/text": _div(v["text_only_sum"] / math.log(2), v["bytes_text_only"]),
        "loss/image_text": _div(v["image_text_sum"], v["n_image_text"]),
        "compression/ratio": _div(v["tokens/all"], v["boundaries/all"]),
        "compression/text": _div(v["tokens/text"], v["boundaries/text"]),
        "compression/image": _div(v["tokens/image"], v["boundaries/image"]),
        "boundary_p/all": _div(v["psum/all"], v["tokens/all"]),
        "boundary_p/text": _div(v["psum/text"], v["tokens/text"]),
        "boundary_p/image": _div(v["psum/image"], v["tokens/image"]),
        "tokens/text": int(v["tokens/text"]),
        "tokens/image": int(v["tokens/image"]),
        "moe/adjugate_per_token": v["adjugate_sum"] / max(v["micro"], 1),
        # boundaries past their row's static concept capacity (vlm.model.chunking.concept_capacity):
        # concepts the concept model did not compute, over the step
        "chunk/overflow": int(v["overflow_sum"]),
    }
    if vec.numel() > len(FIELDS):
        rec.update(group_record(vec, groups))
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


# wall-clock figures: they differ between an uninterrupted and a resumed run
TIMING_KEYS = ("tokens_per_s", "step_time_s", "data/wait_s", "data/wait_share")


def finite_or_none(rec: dict) -> dict:
    """JSON has no NaN/inf: write them as null (a skipped step still gets its line)."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()
    }


class MetricsFile:
    """RUN_DIR/metrics.jsonl. On resume, lines past the resumed step (written after the last
    checkpoint by the interrupted run) are dropped so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            keep = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in keep))
        self.fh = open(path, "a")

    def write(self, rec: dict) -> None:
        self.fh.write(json.dumps(finite_or_none(rec)) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Everything a step leaves behind on rank 0: metrics.jsonl, the TensorBoard dashboard, the
    progress bar. It decides by itself which steps are logged, evaluated and drawn; other ranks get
    a logger that only answers those questions (collectives such as the held-out eval must run on
    every rank)."""

    def __init__(
        self,
        cfg: LoggingConfig,
        max_steps: int,
        run_dir: Path,
        resume_step: int | None,
        targets: dict[str, float],
        is_main: bool,
        start_step: int = 0,
        run_config: dict | None = None,
        groups: list[str] | None = None,
    ):
        self.cfg, self.max_steps = cfg, max_steps
        self.group_names = groups or group_names()
        self.file = MetricsFile(run_dir / "metrics.jsonl", resume_step) if is_main else None
        self.dash = None
        if is_main and "tensorboard" in cfg.report_to:
            self.dash = Dashboard(run_dir / "tb", resume_step, targets)
        self.tracker = None
        if is_main and "wandb" in cfg.report_to:
            self.tracker = WandbTracker(
                run_dir, cfg.wandb_project, cfg.wandb_mode, run_config or {}
            )
        self.bar = None
        if is_main and cfg.progress:
            from tqdm.auto import tqdm

            # disable=None: no bar when stderr is not a terminal (a redirected log gets plain
            # lines instead)
            self.bar = tqdm(
                total=max_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                disable=None,
            )
        plain = self.bar is not None and self.bar.disable
        self.plain_every = max(1, max_steps // 20) if plain else 0
        self.t0, self.start_step = time.time(), start_step
        self.last_applied: dict | None = None

    def should_eval(self, step: int) -> bool:
        return bool(self.cfg.eval_every) and (
            step % self.cfg.eval_every == 0 or step == self.max_steps
        )

    def should_log(self, step: int, applied: bool) -> bool:
        return (
            step % self.cfg.log_every == 0
            or step == self.max_steps
            or self.should_eval(step)
            or not applied
        )

    def write(self, record: StepRecord) -> None:
        """Rank 0: the step's line and scalars when due, its pictures and histograms; the progress bar always."""
        step, rec = record.step, record.scalars
        if record.applied:
            self.last_applied = rec
        if self.bar is not None:
            self.bar.update(1)
            if self.last_applied is not None:
                self.bar.set_postfix(_postfix(self.last_applied), refresh=False)
        if self.plain_every and (step % self.plain_every == 0 or step == self.max_steps):
            pf = _postfix(self.last_applied or {})
            elapsed = time.time() - self.t0
            eta = elapsed / max(step - self.start_step, 1) * (self.max_steps - step)
            print(
                f"train step {step}/{self.max_steps}  "
                + "  ".join(f"{k} {v}" for k, v in pf.items())
                + f"  elapsed {elapsed / 60:.1f} min  eta {eta / 60:.1f} min",
                file=sys.stderr,
                flush=True,
            )
        if self.file is None or not self.should_log(step, record.applied):
            return
        self.file.write(rec)
        for sink in (self.tracker, self.dash):
            if sink is None:
                continue
            sink.scalars(rec)
            if record.pictures is not None:
                sink.pictures(step, *record.pictures)
        if (
            self.dash is not None
            and record.applied
            and self.cfg.histogram_every
            and step % self.cfg.histogram_every == 0
        ):
            self.dash.histograms(step, record.chunking, record.loads)
            if record.groups is not None:
                self.dash.document_histograms(step, *record.groups, self.group_names)

    def close(self) -> None:
        for part in (self.bar, self.dash, self.tracker, self.file):
            if part is not None:
                part.close()


def _postfix(rec: dict) -> dict:
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    return {
        "loss": f(rec.get("loss"), 3),
        "R_text": f(rec.get("compression/text")),
        "R_img": f(rec.get("compression/image")),
        "tok/s": f(rec.get("tokens_per_s"), 0),
        # the share of the step spent waiting for the loader: high means the data is the bottleneck
        "data": "-"
        if rec.get("data/wait_share") is None
        else f"{100 * rec['data/wait_share']:.0f}%",
    }
