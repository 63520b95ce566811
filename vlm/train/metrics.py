"""Step metrics: sums kept by name on the device, one all-reduce per optimizer step, one JSON line
per logged step that every sink receives.

Legend: B rows, T tokens, E experts, S documents, Y statistics groups (kinds of sample, then
sources), X bins; the 2 of `hist_Y2X` is the modality (text, image).

A logged value is added in one place, `StepAccumulator.add_output`, as a sum by name: a plain sum
(`add`), a count (`add_count`, logged as an int), or a mean (`add_mean(name, total, weight)`, logged
as total / weight over the global batch: every micro-batch of every rank, whatever the split of
rows across ranks; None where the weight is 0). `reduce` all-reduces every sum in one collective,
by sorted key; `record` derives the means and hands one `StepRecord` to every sink.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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
from vlm.train.config import LoggingConfig
from vlm.train.dashboard import Dashboard
from vlm.train.losses import LossResult
from vlm.train.tracking import WandbTracker

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
    ) -> None:
        """What one micro-batch adds to the step's metrics: every loss term (`loss/NAME`, and the
        weighted total `loss`), the LM loss by kind of sample and in bits per byte, tokens,
        boundaries, realized compression and mean p per modality, expert loads, the Grove adjugate
        rate, concept overflow, and per kind and source the documents' ratios and LM loss. Without
        `loss` (a model scored, not trained: held-out batches, `vlm eval ppl`), `token_loss_BT`
        gives the LM loss, `loss/lm`, as the mean over every batch's labelled tokens."""
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
            self._add_lm_split(batch, token_loss_BT)
        self._add_groups(batch, b_BT, valid_BT, token_loss_BT)

    def _add_lm_split(self, batch: PackedBatch, token_loss_BT: torch.Tensor) -> None:
        """The LM loss of text-only and image-text samples (the paper's textloss / mmloss), and the
        text-only samples' bits per UTF-8 byte they predict."""
        labelled = lm_labels(batch) != IGNORE_INDEX
        mm = sample_has_image(batch.doc_ids, batch.modality)
        text_only = labelled & ~mm
        for name, sel in (("loss/text_only", text_only), ("loss/image_text", labelled & mm)):
            self.add_mean(name, (token_loss_BT * sel).sum(), sel.sum())
        if self.bytes_per_id is not None:
            ids = batch.labels.clamp(0, len(self.bytes_per_id) - 1)
            per_pos = self.bytes_per_id.to(batch.labels.device)[ids]
            text_bytes = torch.where(text_only, per_pos, torch.zeros_like(per_pos)).sum()
            bits = (token_loss_BT.double() * text_only).sum() / math.log(2)
            self.add_mean("bpb/text", bits, text_bytes)

    def _add_groups(self, batch, b_BT, valid_BT, token_loss_BT) -> None:
        """Per kind of sample and per source: each document's realized ratio per modality into the
        histograms, and the LM loss sums."""
        hist_Y2X = torch.zeros(self.n_groups, 2, NBINS, dtype=torch.float64, device=self.device)
        loss_Y2 = torch.zeros(self.n_groups, 2, dtype=torch.float64, device=self.device)
        counts = document_counts(b_BT, batch.doc_ids, batch.modality)
        nk = len(KINDS)
        labels = [(batch.kind, 0, nk), (batch.source, nk, self.n_groups - nk)]
        lab_BT = lm_labels(batch) != IGNORE_INDEX
        for label_BT, offset, n in labels:
            if label_BT is None or n == 0:
                continue
            group_S = document_labels(label_BT, batch.doc_ids)
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


# wall-clock figures: they differ between an uninterrupted and a resumed run
TIMING_KEYS = (
    "tokens_per_s",
    "step_time_s",
    "data/wait_s",
    "data/wait_share",
    "time/slowest_rank",
    "data/wait_slowest_rank",
)
# ... and whole families of them: a save's and a resume's times by rank (vlm.train.ckpt_save), in the
# line of the step logged after the save finished or the run resumed
TIMING_PREFIXES = ("checkpoint/", "resume/")


def is_timing(key: str) -> bool:
    """A metrics.jsonl key that measures the machine, not the training (differs from run to run)."""
    return key in TIMING_KEYS or key.startswith(TIMING_PREFIXES)


def finite_or_none(rec: dict) -> dict:
    """JSON has no NaN/inf: write them as null (a skipped step still gets its line)."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()
    }


class MetricsFile:
    """RUN_DIR/metrics.jsonl. On resume, lines past the resumed step (written after the last
    checkpoint by the interrupted run, and logged again by this one) are dropped so the file reads
    as one uninterrupted run. A line that is not a JSON object (the half-written last line of a run
    stopped by a full disk or a kill) is moved, as it was, to `metrics.jsonl.cut-<time>` beside
    it, with a warning naming both: nothing is deleted."""

    def __init__(self, path: Path, resume_step: int | None, warn=None):
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            keep, bad, cut = [], [], []
            lines = path.read_bytes().split(b"\n")
            for n, raw in enumerate(lines, 1):
                line = raw.decode("utf-8", "replace")
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if not isinstance(rec, dict):
                    bad.append(n)
                    cut.append(raw)
                elif _step_of(rec) <= resume_step:
                    keep.append(line)
            if bad:
                aside = path.with_name(f"{path.name}.cut-{time.strftime('%Y%m%d-%H%M%S')}")
                while aside.exists():  # a second resume within the same second
                    aside = aside.with_name(aside.name + "+")
                aside.write_bytes(b"".join(raw + b"\n" for raw in cut))
                last = " (the last one: cut short when the run stopped)" if bad[-1] >= n - 1 else ""
                (warn or _stderr)(
                    f"warning: {path}: {len(bad)} line(s) that are not a JSON record, line "
                    f"{', '.join(map(str, bad[:5]))}{last}, moved as they were to {aside.name}"
                )
            path.write_text("".join(line + "\n" for line in keep))
        self.fh = open(path, "a")

    def write(self, rec: dict) -> None:
        self.fh.write(json.dumps(finite_or_none(rec)) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


# Names earlier versions wrote into metrics.jsonl, and today's (a reader of an older run's file sees
# today's names)
LEGACY_KEYS = {"lm_loss": "loss/lm", "aux_loss": "loss/ratio", "balance_loss": "loss/balance"}


def current_names(rec: dict) -> dict:
    """A metrics.jsonl record with today's names (`val/lm_loss` -> `val/loss/lm`, ...)."""
    out = {}
    for k, v in rec.items():
        base = k[len("val/") :] if k.startswith("val/") else k
        if base in LEGACY_KEYS:
            k = ("val/" if k.startswith("val/") else "") + LEGACY_KEYS[base]
        out.setdefault(k, v)
    return out


def _step_of(rec: dict) -> int | float:
    step = rec.get("step", 0)
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def read_metrics(path: Path) -> list[dict]:
    """RUN_DIR/metrics.jsonl's records, in today's names. ValueError (one line naming the file and
    the line) on a line that is not a JSON record: a run stopped mid-write leaves its last line
    cut short, and resuming the run repairs the file."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            rec, why = None, f"{type(e).__name__}: {e}"
        else:
            why = f"a JSON {type(rec).__name__}, not a record"
        if not isinstance(rec, dict):
            raise ValueError(
                f"{path} line {n} is not a JSON record ({why}); a run stopped while writing it "
                "leaves it cut short: resuming the run (the same command) moves it aside"
            )
        out.append(current_names(rec))
    return out


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
