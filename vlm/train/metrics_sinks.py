"""Where a step's metrics go (the accumulation that makes them: vlm.train.metrics): on rank 0
RUN_DIR/metrics.jsonl (repaired on resume, read back in today's names), the TensorBoard dashboard,
W&B and the progress bar, each step's `StepRecord` handed to every sink by `MetricsLogger`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from vlm.train.config import LoggingConfig
from vlm.train.dashboard import Dashboard
from vlm.train.metrics import StepRecord, group_names
from vlm.train.tracking import WandbTracker

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
