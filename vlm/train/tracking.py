"""Weights & Biases next to TensorBoard: the same scalars and pictures, offline
unless told otherwise.

Legend: H height, W width.

The run's id is kept in RUN_DIR/wandb_id, so a resumed run continues the same wandb run
(`resume="allow"`); steps it already logged before the checkpoint it resumed from are sent again and
wandb keeps the later values.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from configs.config import ConfigError


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, mode: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.report_to includes 'wandb' but wandb is not installed: "
                'pip install -e ".[track]"'
            ) from None
        self.wandb = wandb
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        id_file.write_text(run_id)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            name=run_dir.name,
            resume="allow",
            config=config,
        )

    def scalars(self, rec: dict) -> None:
        values = {
            k: v
            for k, v in rec.items()
            if k != "step"
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and np.isfinite(v)
        }
        self.run.log(values, step=int(rec["step"]))

    def pictures(self, step: int, image_HW3: np.ndarray | None, text: str | None) -> None:
        logged = {}
        if image_HW3 is not None:
            logged["concepts/image"] = self.wandb.Image(image_HW3)
        if text is not None:
            escaped = text.replace("&", "&amp;").replace("<", "&lt;")
            logged["concepts/text"] = self.wandb.Html("<pre>" + escaped + "</pre>")
        if logged:
            self.run.log(logged, step=step)

    def close(self) -> None:
        self.run.finish()
