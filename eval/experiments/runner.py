"""Running a recipe: one `vlm train` process per (variant, seed), `jobs` job slots at a time with
one torch thread each, dependencies first; then the rows, the statistics, the verdict, results.json,
the table and the plot.

Each run's command line is kept in OUT/NAME.json; a finished run (summary.json, exit code 0) is
reused when the recipe asks for the same command again, and refused when it asks for a different one
(a stale table is worse than none).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from configs.config import ConfigError
from data_pipelines.progress import Progress
from eval.experiments.core import Recipe, Run, Variant, configs_dir, overall, stats_table


@dataclass
class Job:
    name: str  # VARIANT-sSEED, also the run directory's name
    variant: Variant
    seed: int
    steps: int
    args: list[str]  # `vlm train` arguments (without the launcher)
    after: str | None  # job name that must finish first

    @property
    def ranks(self) -> int:
        return self.variant.ranks


def job_name(variant: str, seed: int) -> str:
    return f"{variant}-s{seed}"


def plan(
    recipe: Recipe,
    out: Path,
    steps: int | None = None,
    seeds: int | None = None,
    extra: list[str] | None = None,
    only: list[str] | None = None,
) -> list[Job]:
    """Every (variant, seed) run with its full `vlm train` arguments; `only` keeps those variants
    (and what they need)."""
    steps = steps or recipe.steps
    seeds = seeds or recipe.seeds
    names = [v.name for v in recipe.variants]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ConfigError(
                f"--only: {recipe.name} has no variant "
                f"{', '.join(unknown)}; its variants: {', '.join(names)}"
            )
        keep, todo = set(), list(only)
        while todo:  # a kept variant keeps what it runs after
            n = todo.pop()
            keep.add(n)
            dep = next(v.after for v in recipe.variants if v.name == n)
            if dep and dep not in keep:
                todo.append(dep)
    else:
        keep = set(names)
    cfg = configs_dir() / recipe.config
    out = out.resolve()
    jobs = []
    for seed in range(seeds):
        for v in recipe.variants:
            if v.name not in keep:
                continue
            n = max(1, round(steps * v.steps_mult))
            overrides = list(v.overrides)
            # "{run:NAME}": the same seed's run directory of variant NAME
            for w in recipe.variants:
                overrides = [
                    o.replace("{run:%s}" % w.name, str(out / job_name(w.name, seed)))
                    for o in overrides
                ]
            args = [
                "--config",
                str(cfg),
                "--out",
                str(out / job_name(v.name, seed)),
                f"train.max_steps={n}",
                f"train.seed={seed}",
                "train.threads=1",
                "logging.progress=false",
                "checkpoint.save_every=0",
                f"logging.eval_every={max(1, math.ceil(n / recipe.evals))}",
                *recipe.common,
                *overrides,
                *(extra or []),
            ]
            jobs.append(
                Job(
                    job_name(v.name, seed),
                    v,
                    seed,
                    n,
                    args,
                    job_name(v.after, seed) if v.after else None,
                )
            )
    return jobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(job: Job) -> list[str]:
    if job.ranks == 1:
        return [sys.executable, "-m", "vlm.cli", "train", *job.args]
    # the launcher tests/test_train_distributed.py uses: gloo on CPU, one process per rank
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(job.ranks),
        "--master_port",
        str(_free_port()),
        "-m",
        "vlm.train",
        *job.args,
    ]


def _finished(run_dir: Path) -> bool:
    s = run_dir / "summary.json"
    return s.is_file() and json.loads(s.read_text()).get("exit_code", 0) == 0


def _check_reuse(out: Path, job: Job) -> bool:
    """True when the run is finished with this very command; a finished run with another command is an error."""
    run_dir, rec = out / job.name, out / f"{job.name}.json"
    if not _finished(run_dir):
        return False
    if rec.is_file() and json.loads(rec.read_text()).get("args") != job.args:
        raise ConfigError(
            f"{run_dir} was trained with other settings than this recipe now "
            f"asks for (see {rec}); use another --out or delete that run"
        )
    return True


def _steps_done(run_dir: Path) -> int:
    m = run_dir / "metrics.jsonl"
    if not m.is_file():
        return 0
    with m.open() as f:
        return sum(1 for _ in f)


def run_jobs(jobs: list[Job], out: Path, slots: int, log=print) -> list[str]:
    """Launch every job not already finished, `slots` processes at a time (a 2-rank run takes 2;
    one wider than `slots` runs alone); returns the names of the failed runs (their dependents
    are not started)."""
    out.mkdir(parents=True, exist_ok=True)
    pool = _Pool(jobs, out, slots, log)
    try:
        pool.run()
    finally:  # interrupted: the runs it started stop with it
        pool.stop()
    return pool.failed


class _Pool:
    def __init__(self, jobs: list[Job], out: Path, slots: int, log):
        self.out, self.slots, self.log = out, slots, log
        self.done = {j.name for j in jobs if _check_reuse(out, j)}
        if self.done:
            log(f"reusing {len(self.done)} finished run(s) in {out}")
        self.todo = [j for j in jobs if j.name not in self.done]
        self.mine = list(self.todo)
        self.failed: list[str] = []
        self.running: list[tuple[Job, subprocess.Popen, object]] = []
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        # a bar on a terminal, plain periodic lines in a redirected log
        self.bar = Progress(
            sum(j.steps for j in self.todo), f"{len(self.todo)} runs", unit="step", every_s=60
        )

    def run(self) -> None:
        while self.todo or self.running:
            self._launch_ready()
            time.sleep(1)
            self.bar.set(
                min(
                    sum(_steps_done(self.out / j.name) for j in self.mine if j not in self.todo),
                    self.bar.total,
                )
            )
            self._reap()

    def _launch_ready(self) -> None:
        busy = sum(j.ranks for j, _, _ in self.running)
        for job in list(self.todo):
            if job.after in self.failed:
                self.todo.remove(job)
                self.failed.append(job.name)
                self.log(f"run {job.name} not started: {job.after} failed")
                continue
            if (job.after and job.after not in self.done) or (
                busy and busy + job.ranks > self.slots
            ):
                continue
            self.todo.remove(job)
            cmd = command(job)
            (self.out / f"{job.name}.json").write_text(
                json.dumps({"args": job.args, "command": cmd}, indent=1)
            )
            logf = (self.out / f"{job.name}.log").open("w")
            self.running.append(
                (
                    job,
                    subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env),
                    logf,
                )
            )
            busy += job.ranks

    def _reap(self) -> None:
        for item in list(self.running):
            job, proc, logf = item
            if proc.poll() is None:
                continue
            logf.close()
            self.running.remove(item)
            if proc.returncode == 0 and _finished(self.out / job.name):
                self.done.add(job.name)
            else:
                self.failed.append(job.name)
                self.log(
                    f"run {job.name} failed (exit {proc.returncode}); see {self.out / job.name}.log"
                )

    def stop(self) -> None:
        for _, proc, logf in self.running:
            proc.terminate()
            proc.wait()
            logf.close()
        self.running = []
        self.bar.close()


def estimate_s(
    recipe: Recipe, slots: int = 2, steps: int | None = None, seeds: int | None = None
) -> float:
    """Wall seconds for the whole recipe from its calibrated step time, by simulating the scheduler."""
    jobs = plan(recipe, Path("/nonexistent"), steps, seeds)
    dur = {
        j.name: recipe.startup_s + j.variant.extra_s + j.steps * recipe.step_s * j.variant.cost
        for j in jobs
    }
    t, finished, running, todo = 0.0, {}, [], list(jobs)
    while todo or running:
        busy = sum(j.ranks for j, _ in running)
        for job in list(todo):
            if job.after and job.after not in finished:
                continue
            if busy + job.ranks > slots and busy:
                continue
            todo.remove(job)
            running.append((job, t + dur[job.name]))
            busy += job.ranks
        if not running:
            break
        job, end = min(running, key=lambda x: x[1])
        running.remove((job, end))
        t = end
        finished[job.name] = end
    return t


def run_recipe(
    recipe: Recipe,
    out: Path,
    steps: int | None = None,
    seeds: int | None = None,
    jobs: int = 2,
    extra: list[str] | None = None,
    only: list[str] | None = None,
    log=print,
) -> dict:
    """Train every run (reusing finished ones), then write OUT/results.json, results.txt and results.png."""
    from eval.experiments.report import format_table, plot

    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    if seeds is not None and seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    t0 = time.time()
    plan_ = plan(recipe, out, steps, seeds, extra, only)
    failed = run_jobs(plan_, out, jobs, log)
    if failed:
        raise RuntimeError(f"runs failed: {', '.join(failed)} (see {out}/<run>.log)")
    result = collect(recipe, out, plan_, steps or recipe.steps, seeds or recipe.seeds)
    result["wall_s"] = time.time() - t0
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.txt").write_text(format_table(result) + "\n")
    plot(result, out / "results.png")
    return result


def collect(recipe: Recipe, out: Path, jobs: list[Job], steps: int, seeds: int) -> dict:
    """Rows (one per run), statistics over seeds, checks and verdict: the content of results.json."""
    runs = {j.name: Run(out / j.name) for j in jobs}
    rows = []
    for j in jobs:
        same_seed = {k.variant.name: runs[k.name] for k in jobs if k.seed == j.seed}
        row = {
            "variant": j.variant.name,
            "seed": j.seed,
            **j.variant.labels,
            "run": str(out / j.name),
            "steps": runs[j.name].summary.get("steps"),
            "wall_s": runs[j.name].summary.get("wall_s"),
        }
        row.update(recipe.read(runs[j.name], same_seed))
        rows.append(row)
    variants = [v.name for v in recipe.variants if any(j.variant.name == v.name for j in jobs)]
    table = stats_table(rows, recipe.metrics, variants)
    checks = recipe.verdict(table)
    return {
        "recipe": recipe.name,
        "source": recipe.source,
        "claim": recipe.claim,
        "config": f"configs/{recipe.config}",
        "steps": steps,
        "seeds": seeds,
        "held_out": recipe.held_out,
        "note": recipe.note,
        "metrics": [
            {"key": m.key, "label": m.label, "digits": m.digits, "ref": m.ref}
            for m in recipe.metrics
        ],
        "variants": [
            {
                "name": v.name,
                "labels": v.labels,
                "overrides": v.overrides,
                "ranks": v.ranks,
                "steps_mult": v.steps_mult,
            }
            for v in recipe.variants
            if v.name in variants
        ],
        "common": recipe.common,
        "rows": rows,
        "table": {
            v: {k: (s.to_json() if s else None) for k, s in ms.items()} for v, ms in table.items()
        },
        "checks": [c.to_json() for c in checks],
        "verdict": overall(checks),
    }
