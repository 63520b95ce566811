"""The decode sections: ms per step after a prompt, eager (`model.step`) and compiled
(`model.decode_step`), and the launches per step at the largest batch."""

from __future__ import annotations

import math
import statistics
import time

from eval.bench import common
from eval.bench.gpu.compiling import compiled_step, graphs_compiled
from eval.bench.gpu.errors import reason
from eval.bench.gpu.rig import DecodeRig, build
from eval.bench.gpu.state import Run
from eval.bench.model import BASELINE


def eager(r: Run) -> str | None:
    s, dev = r.s, r.dev
    skipped, t_start = [], time.perf_counter()
    for B in s.decode_batches:
        if r.budget.left() < 15.0 or time.perf_counter() - t_start > s.decode_max_s:
            skipped.append(B)
            continue
        rigs = {}
        for n, m in r.models.items():
            try:
                rigs[n] = DecodeRig(m, B, s.decode_context, s.decode_steps, s.ratio, dev)
            except Exception as e:  # noqa: BLE001
                r.error(f"decode eager B={B}: {n} (prefill)", e)
        fns = r.warm(
            {n: rig.round(r.models[n].step) for n, rig in rigs.items()}, 1, f"decode eager B={B}"
        )
        if fns:
            _rows(r, "eager", B, common.measure(fns, s.decode_repeats, warmup=0))
        if B == max(s.decode_batches):
            r.launches(
                "eager", f"decode B={B}", {n: _counted(rigs[n], r.models[n].step) for n in fns}
            )
        del rigs, fns
        dev.free()
    return f"time budget: batch sizes {skipped} not measured" if skipped else None


def compiled(r: Run) -> str | None:
    """The decode step compiled for the fastest ConceptMoE at the largest batch, then the baseline
    (as many as `compile_decode` allows), largest batch first: a step that does not compile is
    unavailable at every batch."""
    s, dev = r.s, r.dev
    B8 = max(s.decode_batches)
    eager_ms = {
        x["candidate"]: x["median"]
        for x in r.res["rows"]
        if x["setting"].get("section") == "decode"
        and x["setting"].get("mode") == "eager"
        and x["setting"].get("batch") == B8
    }
    concept = sorted(r.reallocs, key=lambda n: eager_ms.get(n, math.inf))
    order = (concept[:1] + [BASELINE] + concept[1:])[: s.compile_decode]
    for n in r.cfgs:
        if n not in order:
            r.res["unavailable"][f"{n} (compiled decode)"] = (
                f"not compiled: the {s.name} settings compile the "
                f"decode step of {s.compile_decode} candidates"
            )
    models, steps, skipped = {}, {}, []  # steps[n] None: n's decode step did not compile
    for n, B in [(n, B) for B in sorted(s.decode_batches, reverse=True) for n in order]:
        key = f"{n} (compiled decode B={B})"
        if n in steps and steps[n] is None:
            r.res["unavailable"][key] = (
                "not tried: the decode step did not compile at a larger batch"
            )
            continue
        if r.budget.left() < s.decode_compile_reserve_s:
            skipped.append(f"{n} B={B}")
            r.res["unavailable"][key] = f"skipped: time budget ({r.budget.left():.0f} s left)"
            continue
        try:
            if n not in models:
                models[n] = build(r.cfgs[n], dev, r.dtype).eval()
                steps[n] = compiled_step(models[n], s.compile_backend)
            rig = DecodeRig(models[n], B, s.decode_context, s.decode_steps, s.ratio, dev)
            t0 = time.perf_counter()
            fn = rig.round(steps[n])
            fn()  # compiles
            r.log(f"  compiled {n}'s decode step at B={B} in {time.perf_counter() - t0:.0f} s")
        except Exception as e:  # noqa: BLE001
            r.res["unavailable"][key] = reason(e)
            r.log(f"  decode compile {n} B={B}: unavailable: {r.res['unavailable'][key]}")
            steps[n] = None  # the other batch sizes would fail the same way
            dev.free()
            continue
        if r.warm({n: fn}, 1, "", f"compiled decode B={B}"):
            g0 = graphs_compiled()
            _rows(r, "compiled", B, common.measure({n: fn}, s.decode_repeats, warmup=0))
            r.check_recompiles(g0, f"decode compiled B={B} ({n})")
            if B == B8:
                r.launches("compiled", f"decode B={B}", {n: _counted(rig, steps[n])})
        del rig, fn
    del models, steps
    dev.free()
    return f"time budget: {skipped} not compiled" if skipped else None


def _rows(r: Run, mode: str, B: int, secs: dict[str, list[float]]) -> list[dict]:
    s = r.s
    ms = {n: [1000 * t / s.decode_steps for t in ts] for n, ts in secs.items()}
    extra = {
        n: {"tokens_per_s": round(B * s.decode_steps / statistics.median(ts), 1)}
        for n, ts in secs.items()
    }
    rs = r.rows(
        ms,
        {"section": "decode", "mode": mode, "batch": B, "context": s.decode_context},
        "decode ms per step",
        "ms",
        extra,
    )
    r.log(
        f"  decode {mode} B={B}: " + ", ".join(f"{x['candidate']} {x['median']:.2f} ms" for x in rs)
    )
    return rs


def _counted(rig: DecodeRig, step):
    """A launches job: a round of `rig.steps` decode steps, on caches copied before the count starts."""

    def job():
        cache = rig.fresh()
        return (lambda: rig.run(step, cache)), rig.steps

    return job
