"""What the text-only recipes share: the tiny text config, the usual metrics, FLOPs-matched
reallocation as dotted overrides."""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass

from eval.experiments.core import Metric, Run, configs_dir

TEXT_CONFIG = "experiment_text.yaml"
HELD_OUT = (
    "the run's last val/loss/lm (eval mode: boundaries where p >= 0.5) on "
    "the default dataset's val-split text, 12 batches of 4 x 256 tokens"
)

VAL_LOSS = Metric("val_loss", "held-out loss")
TRAIN_LOSS = Metric("train_loss", "train loss (last 10 %)")
VAL_R = Metric("val_R", "held-out R (aggregate)", 2)
# the same held-out text documents one by one: the median document, and the 10th / 90th
# percentile ones
VAL_R_DOC = [
    Metric("val_R_p50", "held-out R, median document", 2),
    Metric("val_R_p10", "held-out R, p10 document", 2),
    Metric("val_R_p90", "held-out R, p90 document", 2),
]
TRAIN_R = Metric("train_R", "train R (last 10 %)", 2)
TRAIN_R_DOC = Metric("train_R_p50", "train R, median document (last 10 %)", 2)


def losses(run: Run) -> dict:
    """Held-out and training LM loss, realized compression (tokens per concept) held out and in training."""
    row = {
        "val_loss": run.last_val("loss/lm"),
        "train_loss": run.tail("loss/lm"),
        "val_R": run.last_val("compression/ratio"),
        "train_R": run.tail("compression/ratio"),
    }
    # a null quantile is a document with no concept: read as 1000 tokens per concept
    for q in ("p10", "p50", "p90"):
        v = run.last_val(f"doc_ratio/text/text/{q}")
        row[f"val_R_{q}"] = (
            v if v is not None or run.last_val("doc_ratio/text/text/docs") is None else 1e3
        )
    row["train_R_p50"] = run.tail("doc_ratio/text/text/p50")
    return row


def model_config(run: Run):
    """The run's model as it trained (for a continual-training run: the converted architecture)."""
    from vlm.model.config import model_config_from

    return model_config_from(run.config()["model"], "model")


def flops_vs(run: Run, baseline: Run, ratio: float) -> float:
    """Per-token FLOPs (attention map excluded) of `run` at its target ratio over `baseline`'s."""
    from vlm.model.flops import flops_per_token

    return (
        flops_per_token(model_config(run), ratio)["total"]
        / flops_per_token(model_config(baseline))["total"]
    )


def _yaml(value) -> str:
    return json.dumps(value)  # JSON is YAML: the override parser reads it back exactly


def model_overrides(base, cfg, skip: tuple[str, ...] = ("chunk",)) -> list[str]:
    """Dotted `model.*` overrides that turn ModelConfig `base` into `cfg` (nested sections field by
    field, a section that was null as a whole mapping)."""
    out = []
    for f in fields(cfg):
        a, b = getattr(base, f.name), getattr(cfg, f.name)
        if f.name in skip or a == b:
            continue
        if is_dataclass(b) and is_dataclass(a):
            out += [
                f"model.{f.name}.{g.name}={_yaml(getattr(b, g.name))}"
                for g in fields(b)
                if getattr(a, g.name) != getattr(b, g.name)
            ]
        elif is_dataclass(b):
            out.append(f"model.{f.name}={_yaml({g.name: getattr(b, g.name) for g in fields(b)})}")
        else:
            out.append(f"model.{f.name}={_yaml(b)}")
    return out


def matched_overrides(
    common: list[str], ratio: float, strategy: str = "more_experts"
) -> tuple[list[str], str]:
    """ConceptMoE section 3.5: overrides that give the chunked model at `ratio` the per-token FLOPs
    and total parameters of the text config's MoE (chunking off), and a description of the match."""
    from vlm.model.reallocate import describe_changes, search_reallocations
    from vlm.train.config import load_train_config

    base = load_train_config(
        configs_dir() / TEXT_CONFIG, [*common, "model.chunk.enabled=false"]
    ).model
    found = search_reallocations(base, ratio)[strategy]
    desc = (
        f"{describe_changes(base, found.config)}: FLOPs "
        f"x{found.flops_ratio:.3f}, params x{found.params_ratio:.3f} of the MoE"
    )
    return model_overrides(base, found.config), desc
