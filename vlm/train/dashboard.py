"""The live per-modality compression dashboard (TensorBoard, rank 0 only).

Legend: H height, W width, X histogram bins, Y kinds of sample.

Scalars: every number a step logs in metrics.jsonl, under the same name (losses by term and by
sample kind, compression ratio and mean p per modality with their targets, throughput, learning
rate, expert-load imbalance, data counters, held-out evaluation). Histograms: p per modality,
expert load per layer. At eval steps: an image with its merged patches outlined by concept and a
text sample with '|' at its concept boundaries.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from configs.batch import IMAGE, TEXT


class Dashboard:
    def __init__(self, log_dir: Path, resume_step: int | None, targets: dict[str, float]):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events an interrupted run logged after its last checkpoint (all of them
        # when a run starts afresh in a directory that has old event files).
        self.writer = SummaryWriter(
            str(log_dir), purge_step=0 if resume_step is None else resume_step + 1
        )
        self.targets = targets

    def scalars(self, rec: dict) -> None:
        """Every number of the step's metrics.jsonl line, under its own name (the names group
        themselves by their first part: loss/, compression/, boundary_p/, val/, ...), and the
        compression targets next to them."""
        step = rec["step"]
        for key, val in rec.items():
            if key != "step" and isinstance(val, (int, float)) and val is not None:
                self.writer.add_scalar(key, float(val), step)
        for name, target in self.targets.items():
            self.writer.add_scalar(f"target/{name}", target, step)

    def histograms(
        self,
        step: int,
        chunking: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        loads: dict[str, torch.Tensor],
    ) -> None:
        """p per modality from (p, boundary, modality) of one micro-batch; expert load shares per layer."""
        w = self.writer
        if chunking is not None:
            p, _, mod = chunking
            valid = p > 0  # padding has p = 0; a real token has p > 0 almost surely
            for name, m in (("text", TEXT), ("image", IMAGE)):
                vals = p[(mod == m) & valid].float().cpu()
                if vals.numel():
                    w.add_histogram(
                        f"boundary_p_hist/{name}", vals.numpy(), step, bins=np.linspace(0, 1, 41)
                    )
        for k, load in loads.items():
            total = float(load.sum())
            if total > 0:
                frac = (load / total).numpy()
                # One "sample" per expert at its load share, so the histogram shows how
                # loads spread.
                w.add_histogram(f"expert_load/{k[len('load/') :]}", frac, step)

    def document_histograms(
        self, step: int, hist_Y2X: torch.Tensor, loss_Y2: torch.Tensor, names: list[str]
    ) -> None:
        """Per kind (and source) and modality: the distribution of the step's documents' realized
        ratios (`doc_ratio_hist/KIND/MOD`, log2 of tokens per concept; documents with no concept on
        the modality sit at log2 = 8), next to the p10 / p50 / p90 scalars of metrics.jsonl."""
        from vlm.model.doc_stats import EDGES, MODS

        # upper edge of each bin; overflow, no concept
        limits = [math.log2(e) for e in EDGES[1:]] + [6.5, 8.0]
        mids = [math.log2(e) + 1 / 16 for e in EDGES[:-1]] + [6.25, 8.0]
        for g in range(min(hist_Y2X.shape[0], len(names))):
            for j, m in enumerate(MODS):
                counts = hist_Y2X[g, j].double()
                n = float(counts.sum())
                if n <= 0:
                    continue
                vals = torch.tensor(mids, dtype=torch.float64)
                self.writer.add_histogram_raw(
                    f"doc_ratio_hist/{names[g]}/{m}",
                    min=0.0,
                    max=max(v for v, c in zip(mids, counts) if c > 0),
                    num=n,
                    sum=float((vals * counts).sum()),
                    sum_squares=float((vals**2 * counts).sum()),
                    bucket_limits=limits,
                    bucket_counts=counts.tolist(),
                    global_step=step,
                )

    def pictures(self, step: int, image_HW3: np.ndarray | None, text: str | None) -> None:
        if image_HW3 is not None:
            self.writer.add_image("concepts/image", image_HW3, step, dataformats="HWC")
        if text is not None:
            self.writer.add_text("concepts/text", "    " + text.replace("\n", "\n    "), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
