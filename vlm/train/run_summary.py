"""What a finished run leaves for its reader (rank 0): report.png, summary.json, and final/'s model card."""

from __future__ import annotations

import json
from pathlib import Path

from configs.config import to_dict
from vlm.train.config import TrainConfig
from vlm.train.export import write_extras
from vlm.train.metrics_sinks import read_metrics
from vlm.train.report import model_card, summary_lines, write_report
from vlm.train.run_config import config_targets


def write_summary(
    run_dir: Path,
    cfg: TrainConfig,
    *,
    steps: int,
    wall: float,
    results: dict,
    nonfinite_total: int,
    data_counters: dict,
    rc: int,
    moe_dropped: int = 0,
) -> list[str]:
    """report.png and summary.json from RUN_DIR/metrics.jsonl; with rc 0 (final/ was exported)
    final/ gets a model card and the report picture. cfg: the run's (resolved) config.
    moe_dropped: the expert choices expert parallelism's capacity dropped over the run (a line and
    `moe_dropped_choices`). Returns the summary's lines."""
    records = read_metrics(run_dir / "metrics.jsonl")
    targets = config_targets(cfg)
    picture = write_report(
        records, run_dir / "report.png", targets, title=f"{run_dir.name}: stage {cfg.train.stage}"
    )
    warm_file = run_dir / "vision_warmup.json"
    try:  # a file damaged since the warm-up wrote it leaves the summary without it
        warmup = json.loads(warm_file.read_text()) if warm_file.is_file() else None
    except (OSError, ValueError):
        warmup = None
    warmup = warmup if isinstance(warmup, dict) else None
    lines = summary_lines(
        records, targets, results["vqa"], run_dir, wall, nonfinite_total, data_counters, warmup
    )
    if moe_dropped:  # expert parallelism's capacity: what the model computed differs
        lines.append(
            f"expert choices dropped by the capacity (parallel.capacity_factor="
            f"{cfg.parallel.capacity_factor}): {moe_dropped:,} over {steps} steps"
        )
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "steps": steps,
                "wall_s": wall,
                **results,
                "vision_warmup": warmup,
                "nonfinite_steps": nonfinite_total,
                "moe_dropped_choices": moe_dropped,
                "last": records[-1] if records else None,
                "exit_code": rc,
            },
            indent=2,
            default=str,
        )
    )
    if rc == 0:
        card = model_card(to_dict(cfg), lines, f"{run_dir.name}: ConceptMoE VLM")
        # a full disk: one line
        write_extras(run_dir / "final", {"report.png": picture, "README.md": card})
    return lines
