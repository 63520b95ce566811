"""What the sections of `vlm bench gpu` share: the result (written after every section), the models,
the budget, and the rules every section follows (a failure is recorded and the run goes on; a step
that never ends is stopped)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from eval.bench import common
from eval.bench.gpu.compiling import (
    graphs_compiled,
    raise_recompile_limits,
    restore_recompile_limits,
)
from eval.bench.gpu.device import Device
from eval.bench.gpu.errors import reason
from eval.bench.gpu.launches import count_launches
from eval.bench.gpu.report import table
from eval.bench.gpu.rig import candidates, model_flops
from eval.bench.gpu.settings import PART, Budget, Settings
from eval.bench.model import BASELINE, boundaries_at_ratio
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.flops import count_params
from vlm.model.reallocate import describe_changes


class Run:
    def __init__(self, s: Settings, log):
        self.s, self.log = s, log
        self.dev = Device()
        if not self.dev.cuda and not s.tiny:
            raise RuntimeError("vlm bench gpu needs a CUDA device (or --smoke)")
        self.dtype = getattr(torch, s.dtype)
        self.budget = Budget(s.budget_s)
        self.cfgs = candidates(s)
        self.reallocs = [n for n in self.cfgs if n != BASELINE]
        self.models: dict[str, ConceptMoELM] = {}
        self.opts: dict[str, torch.optim.Optimizer] = {}
        # train_eager's, shared by the memory and compiled sections
        self.train_batch = self.train_force = None
        self.compile_s: dict[str, float] = {}
        info = self.dev.info()
        self.peak = info["peak"]["flops"] if info.get("peak") else None
        base_cfg = self.cfgs[BASELINE]
        self.res = common.result(
            PART,
            asdict(s),
            [],
            mode=s.name,
            complete=False,
            gpu=info,
            sections={},
            errors={},
            unavailable={},
            notes=[],
            memory=[],
            launches=[],
            eager_vs_compiled=[],
            targets=[],
            configs={
                n: {
                    "params": count_params(c)["total"],
                    "flops_per_token": model_flops(c, s.ratio, 4096)[0],
                    "changes": describe_changes(base_cfg, c),
                }
                for n, c in self.cfgs.items()
            },
        )
        self.res["machine"]["device"] = f"cuda: {info['name']}" if self.dev.cuda else "cpu"
        self.current = "device"
        # before any compile: the model's FlexAttention's too
        self.dynamo_limits = raise_recompile_limits()
        self.watchdog = None
        if self.dev.cuda and s.hard_stop_s:
            self.watchdog = threading.Timer(s.hard_stop_s, self.hard_stop)
            self.watchdog.daemon = True
            self.watchdog.start()

    def hard_stop(self) -> None:
        """The budget is checked between steps; a step that does not end (a compile) is stopped
        here: what was measured is written, the section is marked, and the process exits with 3."""
        self.res["sections"][self.current] = {
            "status": "killed",
            "why": f"still running {self.s.hard_stop_s:g} s after the start (hard stop)",
        }
        self.res["notes"].append(
            f"hard stop at {self.s.hard_stop_s:g} s in section "
            f"{self.current}: the sections after it did not run"
        )
        try:
            self.save()
            print(table(self.res), flush=True)
        finally:
            print(
                f"vlm bench gpu: stopped after {self.s.hard_stop_s:g} s in section "
                f"{self.current}; what was measured is in {self.s.out}/gpu.json",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)

    def save(self) -> None:
        if self.s.out:
            common.write_json(self.res, self.s.out)

    def error(self, key: str, e: BaseException) -> None:
        self.res["errors"][key] = reason(e)
        self.log(f"  gpu: {key}: {self.res['errors'][key]}")
        self.dev.free()

    def section(self, name: str, fn: Callable[["Run"], str | None], budgeted: bool = True) -> None:
        """Run one section: skipped when the budget is spent, never fatal (an exception is its
        error), and the JSON written after it. `fn` returns why it measured only part of what it
        should (None: all of it)."""
        left = self.budget.left()
        if budgeted and left <= 0:
            self.res["sections"][name] = {
                "status": "skipped",
                "why": f"time budget: {max(left, 0):.0f} s left of {self.s.budget_s:.0f} s",
            }
            self.log(f"  gpu {name}: skipped (budget)")
            self.save()
            return
        t0, n_err = time.perf_counter(), len(self.res["errors"])
        self.current = name
        self.log(f"  gpu {name} (t={self.budget.used():.0f} s)")
        try:
            why = fn(self)
        except Exception as e:  # noqa: BLE001  the command never dies on one section
            self.error(name, e)
            why = None
        status = "error" if len(self.res["errors"]) > n_err else "partial" if why else "done"
        self.res["sections"][name] = {
            "status": status,
            "seconds": round(time.perf_counter() - t0, 1),
            **({"why": why} if why else {}),
        }
        self.save()

    def close(self) -> dict:
        if self.watchdog is not None:
            self.watchdog.cancel()
        restore_recompile_limits(self.dynamo_limits)
        self.res["complete"] = True
        self.res["seconds"] = round(self.budget.used(), 1)
        self.save()
        return self.res

    def warm(
        self, fns: dict[str, Callable], times: int, label: str, compiled: str | None = None
    ) -> dict[str, Callable]:
        """The candidates whose first `times` calls run. The others are errors, or, for a compiled
        step (`compiled` names it), unavailable: a compiled step that fails after its first call is
        still a compile failure."""
        ok = {}
        for name, fn in fns.items():
            try:
                for _ in range(times):
                    fn()
                ok[name] = fn
            except Exception as e:  # noqa: BLE001
                if compiled:
                    self.res["unavailable"][f"{name} ({compiled})"] = reason(e)
                    self.dev.free()
                else:
                    self.error(f"{label}: {name}", e)
        return ok

    def rows(
        self,
        values: dict[str, list[float]],
        setting: dict,
        metric: str,
        unit: str,
        extra: dict[str, dict] | None = None,
    ) -> list[dict]:
        """common.rows, added to the result; without the baseline (a compiled step of one candidate)
        the ratio is nan rather than a ratio to some other candidate."""
        if not values:
            return []
        baseline = BASELINE if BASELINE in values else next(iter(values))
        rs = common.rows(values, baseline, setting, metric, unit, extra)
        if baseline != BASELINE:
            for r in rs:
                r["ratio_vs_baseline"] = float("nan")
        self.res["rows"] += rs
        return rs

    def launches(
        self, mode: str, step: str, jobs: dict[str, Callable[[], tuple[Callable, int]]]
    ) -> None:
        """Launches per step of each candidate. A job does its setup (not counted) and returns what
        to count: a call and the steps it runs."""
        for n, job in jobs.items():
            try:
                fn, steps = job()
                got = count_launches(self.dev, fn, steps, compiled=mode == "compiled")
            except Exception as e:  # noqa: BLE001
                got = {"per_step": None, "reason": reason(e)}
            self.res["launches"].append({"candidate": n, "mode": mode, "step": step, **got})

    def check_recompiles(self, before: int | None, what: str) -> None:
        """A compiled step that compiles again while it is timed (a guard that fails every step) is
        slower than it should be, and its figure includes compile time: say so."""
        after = graphs_compiled()
        if before is not None and after is not None and after > before:
            self.res["notes"].append(
                f"{what}: {after - before} graph(s) compiled while "
                "timed (recompiles: the figure includes compile time)"
            )

    def mfu(self, flops_per_s: float) -> float | None:
        return round(flops_per_s / self.peak, 4) if self.peak else None

    def force(self, B: int, T: int) -> torch.Tensor:
        return boundaries_at_ratio(B, T, self.s.ratio).to(self.dev.device)
