"""Configuration of a long-context sweep (a `configs.config` dataclass: YAML + dotted overrides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from configs.config import ValidatedOnInit, check
from eval.longctx.tasks import DEFAULT_TASKS, TASKS


@dataclass
class LongCtxConfig(ValidatedOnInit):
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    num_samples: int = 4  # per task x length x depth cell
    seed: int = 0
    mode: Literal["generate", "loglik", "both"] = "both"
    batch_size: int = 1
    num_distractors: int = 4  # log-likelihood mode: wrong candidates per reference
    # None: each task's RULER budget (grown for byte-level tokenizers)
    max_new_tokens: int | None = None

    def validate(self) -> None:
        check(
            len(self.lengths) > 0 and all(n > 0 for n in self.lengths),
            f"lengths: need positive token counts, got {self.lengths}",
        )
        check(
            len(self.depths) > 0 and all(0.0 <= d <= 100.0 for d in self.depths),
            f"depths: need percentages in [0, 100], got {self.depths}",
        )
        unknown = [t for t in self.tasks if t not in TASKS]
        check(
            len(self.tasks) > 0 and not unknown,
            f"tasks: unknown {unknown or '(none given)'}; allowed: {', '.join(TASKS)}",
        )
        check(self.num_samples >= 1, f"num_samples: must be >= 1, got {self.num_samples}")
        check(self.batch_size >= 1, f"batch_size: must be >= 1, got {self.batch_size}")
        check(
            1 <= self.num_distractors <= 16,
            f"num_distractors: must be in [1, 16], got {self.num_distractors}",
        )
        check(
            self.max_new_tokens is None or self.max_new_tokens >= 1,
            f"max_new_tokens: must be >= 1 or null, got {self.max_new_tokens}",
        )
