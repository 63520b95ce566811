"""Step metrics: per-micro-batch sums, one all-reduce per optimizer step, one JSON line per logged step.

Everything that is a mean over tokens is carried as (sum, count) so that the logged value is the
mean over the GLOBAL batch (all ranks, all micro-batches), whatever the split of rows across ranks.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from configs.batch import IGNORE_INDEX, IMAGE, PackedBatch
from vlm.model.output import ModelOutput
from vlm.model.stats import sample_has_image

MODS = ("all", "text", "image")
# Fixed order of the summed scalars.
FIELDS = (["n_lab", "lm_sum", "n_text_only", "text_only_sum", "n_image_text", "image_text_sum", "balance_sum",
           "micro", "adjugate_sum"]
          + [f"tokens/{m}" for m in MODS] + [f"boundaries/{m}" for m in MODS] + [f"psum/{m}" for m in MODS])
IDX = {k: i for i, k in enumerate(FIELDS)}


def labelled_counts(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labelled positions overall, in text-only samples and in image-text samples (images carry no loss)."""
    labelled = (batch.labels != IGNORE_INDEX) & (batch.modality != IMAGE)
    mm = sample_has_image(batch.doc_ids, batch.modality)
    return labelled.sum(), (labelled & ~mm).sum(), (labelled & mm).sum()


def load_keys(out: ModelOutput) -> list[str]:
    return sorted(k for k in out.extras if k.startswith("load/"))


class StepAccumulator:
    """Sums of one optimizer step on this rank; `reduce()` all-reduces them in one call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.vec = torch.zeros(len(FIELDS), dtype=torch.float64)
        self.loads: dict[str, torch.Tensor] = {}
        self.ratio_loss = 0.0

    def add(self, out: ModelOutput, batch: PackedBatch) -> None:
        s = out.stats
        n, n_to, n_it = (float(x) for x in labelled_counts(batch))
        v = self.vec
        v[IDX["n_lab"]] += n
        v[IDX["lm_sum"]] += s["lm_loss"] * n
        v[IDX["n_text_only"]] += n_to
        v[IDX["text_only_sum"]] += s.get("loss/text_only", 0.0) * n_to
        v[IDX["n_image_text"]] += n_it
        v[IDX["image_text_sum"]] += s.get("loss/image_text", 0.0) * n_it
        v[IDX["balance_sum"]] += s["balance_loss"]
        v[IDX["micro"]] += 1
        v[IDX["adjugate_sum"]] += s.get("moe/adjugate_per_token", 0.0)
        for m in MODS:
            tok = s.get(f"tokens/{m}", 0.0)
            v[IDX[f"tokens/{m}"]] += tok
            v[IDX[f"boundaries/{m}"]] += s.get(f"boundaries/{m}", 0.0)
            v[IDX[f"psum/{m}"]] += s.get(f"boundary_p/{m}", 0.0) * tok
        # The last micro-batch's ratio loss is computed on the step's global F and G (global parser).
        self.ratio_loss = s["ratio_loss"]
        for k in load_keys(out):
            load = out.extras[k].detach().double().cpu()
            self.loads[k] = self.loads[k] + load if k in self.loads else load

    def reduce(self, all_reduce) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        keys = sorted(self.loads)
        flat = torch.cat([self.vec] + [self.loads[k] for k in keys])
        flat = all_reduce(flat.to(self.device)).cpu()
        vec, rest = flat[: len(FIELDS)], flat[len(FIELDS):]
        loads, i = {}, 0
        for k in keys:
            n = self.loads[k].numel()
            loads[k] = rest[i:i + n]
            i += n
        return vec, loads


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def step_record(step: int, vec: torch.Tensor, ratio_loss: float, ratio_weight: float, lr: float,
                seconds: float) -> dict:
    """The metrics.jsonl object of one optimizer step (global means). Absent modalities give null."""
    v = {k: float(vec[i]) for k, i in IDX.items()}
    lm = _div(v["lm_sum"], v["n_lab"]) or 0.0
    balance = v["balance_sum"] / max(v["micro"], 1)
    rec = {
        "step": step,
        "loss": lm + ratio_weight * ratio_loss + balance,
        "lm_loss": lm,
        "aux_loss": ratio_loss,
        "balance_loss": balance,
        "lr": lr,
        "tokens": int(v["tokens/all"]),
        "tokens_per_s": v["tokens/all"] / seconds if seconds > 0 else 0.0,
        "step_time_s": seconds,
        "loss/text_only": _div(v["text_only_sum"], v["n_text_only"]),
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
    }
    return rec


def load_imbalance(loads: dict[str, torch.Tensor]) -> dict[str, float]:
    """max / mean expert load per MoE layer over the step (1 = perfectly balanced)."""
    out = {}
    for k, load in loads.items():
        mean = float(load.mean())
        if mean > 0:
            out[f"moe/max_over_mean/{k[len('load/'):]}"] = float(load.max()) / mean
    return out


TIMING_KEYS = ("tokens_per_s", "step_time_s")


def finite_or_none(rec: dict) -> dict:
    """JSON has no NaN/inf: write them as null (a skipped step still gets its line)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


class MetricsFile:
    """RUN_DIR/metrics.jsonl. On resume, lines past the resumed step (written after the last checkpoint by the
    interrupted run) are dropped so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
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
