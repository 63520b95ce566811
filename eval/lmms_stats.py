"""Per-task compression statistics of an lmms-eval run, written beside lmms-eval's results.

lmms-eval writes `OUTPUT/<model name>/<date>_results.json`, where `<model name>` is the sanitized
`pretrained=` path (its last two components joined by `__`). It never tells the model OUTPUT, so the
directory comes from, in order: the `stats_path=FILE` model arg (exact file), the `stats_dir=DIR`
model arg, or the `--output_path` of the running lmms-eval command line. The file is
`OUTPUT/<model name>/<timestamp>_compression.json`:

    {"model": ..., "tasks": {task: {request_type: {"requests": n, "compression": {modality: ratio}}}}}

with the model's `compression_stats()` of exactly that task's requests (reset before each task).
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

from loguru import logger


def sanitize_model_name(name: str) -> str:
    """lmms-eval's directory name for a model (`lmms_eval.utils.sanitize_model_name`, full_path=False)."""
    try:
        from lmms_eval.utils import sanitize_model_name as _lmms_sanitize

        return _lmms_sanitize(name)
    except ImportError:  # pragma: no cover - same rule, kept for use without lmms-eval
        parts = name.split("/")
        return re.sub(
            r"[\"<>:/\|\\?\*\[\]]+", "__", "/".join(parts[-2:]) if len(parts) > 1 else parts[-1]
        )


def _datetime_str() -> str:
    """lmms-eval's timestamp format (and default time zone), so our file sorts beside its results."""
    try:
        from lmms_eval.utils import get_datetime_str

        return get_datetime_str()
    except Exception:  # noqa: BLE001 - pragma: no cover
        return datetime.datetime.now().strftime("%Y%m%d_%H%M%S")


def output_path_from_argv(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--output_path" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--output_path="):
            return a.split("=", 1)[1]
    return None


class CompressionLog:
    def __init__(
        self,
        pretrained: str,
        stats_dir: str | None = None,
        stats_path: str | None = None,
        argv: list[str] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """With several processes each writes its own share (`..._compression.rankR.json`):
        lmms-eval hands every rank different requests, so the shares add up to the whole run."""
        self.pretrained = pretrained
        self.tasks: dict[str, dict[str, dict]] = {}
        stamp = _datetime_str()
        out_dir = stats_dir or output_path_from_argv(sys.argv if argv is None else argv)
        if stats_path:
            self.path: Path | None = Path(stats_path)
        elif out_dir:
            base = Path(out_dir)
            # lmms-eval accepts a file path and uses its folder
            if base.suffix in (".json", ".jsonl"):
                base = base.parent
            self.path = base / sanitize_model_name(pretrained) / f"{stamp}_compression.json"
        else:
            self.path = None
        if self.path is not None and world_size > 1:
            self.path = self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")

    def record(self, task: str, request_type: str, requests: int, stats: dict[str, float]) -> None:
        self.tasks.setdefault(task, {})[request_type] = {
            "requests": int(requests),
            "compression": {k: float(v) for k, v in stats.items()},
        }

    def summary(self) -> dict:
        return {"model": self.pretrained, "tasks": self.tasks}

    def write(self) -> Path | None:
        if self.path is None:
            logger.warning(
                "conceptmoe: no --output_path, stats_dir or stats_path; compression stats not saved"
            )
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.summary(), indent=2))
        return self.path
