"""The training step's sections: tokens/s and MFU eager, its launches, and the same step with compiled blocks."""

from __future__ import annotations

import time

from eval.bench import common
from eval.bench.gpu.compiling import compile_backend, graphs_compiled
from eval.bench.gpu.errors import reason
from eval.bench.gpu.launches import repeated
from eval.bench.gpu.rig import build, make_batch, model_flops, optimizer, timed, train_step
from eval.bench.gpu.state import Run
from eval.bench.model import BASELINE


def eager(r: Run) -> None:
    s = r.s
    for n, c in r.cfgs.items():
        try:
            r.models[n] = build(c, r.dev, r.dtype)
            r.opts[n] = optimizer(r.models[n], r.dev)
        except Exception as e:  # noqa: BLE001
            r.error(f"build: {n}", e)
    r.train_batch = make_batch(
        s.train_rows, s.train_len, r.cfgs[BASELINE].vocab_size, r.dev, seed=1
    )
    r.train_force = r.force(s.train_rows, s.train_len)
    time_train(r, "eager", list(r.models), s.warmup)


def launches_eager(r: Run) -> None:
    r.launches("eager", "train", {n: _counted(r, n) for n in r.models})
    for o in r.opts.values():  # the gradients are not needed again before the compiled steps
        o.zero_grad(set_to_none=True)


def compiled(r: Run) -> str | None:
    """The first `compile_train` candidates in `compile_order`, compiled before the decode step is."""
    return _compile_and_time(r, _compile_order(r)[: r.s.compile_train], again=[])


def compiled_rest(r: Run) -> str | None:
    """The other candidates, with what time is left, timed against the baseline's compiled step again."""
    names = [n for n in _compile_order(r)[r.s.compile_train :] if n in r.models]
    if not r.s.compile_train_rest:
        for n in names:
            r.res["unavailable"][f"{n} (compiled train)"] = (
                f"not compiled: the {r.s.name} settings compile "
                f"the first {r.s.compile_train} candidates only"
            )
        return None
    return _compile_and_time(r, names, again=[BASELINE] if BASELINE in r.compile_s else [])


def time_train(r: Run, mode: str, names: list[str], warmup: int) -> list[dict]:
    s = r.s
    fns = r.warm(
        {n: timed(r.dev, _step(r, n)) for n in names},
        warmup,
        f"train {mode}",
        "compiled train" if mode == "compiled" else None,
    )
    if not fns:
        return []
    tokens = s.train_rows * s.train_len
    g0 = graphs_compiled()
    secs = common.measure(fns, s.train_repeats, warmup=0)
    r.check_recompiles(g0, f"train {mode}")
    flops = {n: model_flops(r.cfgs[n], s.ratio, s.train_len) for n in fns}
    # filled in from the row
    extra = {
        n: {
            "R": s.ratio if r.cfgs[n].chunk.enabled else 1.0,
            "step_ms": None,
            "train_flops_per_token": 3 * flops[n][0],
            "mfu": None,
            "mfu_incl_attn_map": None,
            **(
                {"compile_s": round(r.compile_s[n], 1)}
                if mode == "compiled" and n in r.compile_s
                else {}
            ),
        }
        for n in fns
    }
    rs = r.rows(
        common.per_second(secs, tokens),
        {"section": "train", "mode": mode, "rows": s.train_rows, "seq_len": s.train_len},
        "train tokens/s",
        "tok/s",
        extra,
    )
    for row in rs:
        f, a = flops[row["candidate"]]
        row["step_ms"] = round(1000 * tokens / row["median"], 2)
        row["mfu"], row["mfu_incl_attn_map"] = (
            r.mfu(3 * f * row["median"]),
            r.mfu(3 * (f + a) * row["median"]),
        )
    r.log(
        f"  train {mode}: "
        + ", ".join(
            f"{row['candidate']} {row['median']:,.0f} tok/s"
            + ("" if row["mfu"] is None else f" MFU {100 * row['mfu']:.1f} %")
            for row in rs
        )
    )
    return rs


def _step(r: Run, n: str):
    """Candidate n's training step on train_eager's batch (its blocks compiled once `compiled` has compiled them)."""
    force = r.train_force if r.cfgs[n].chunk.enabled else None
    return train_step(r.models[n], r.opts[n], r.train_batch, force)


def _counted(r: Run, n: str):
    """A launches job: `launch_steps` training steps of candidate n."""
    fn = _step(r, n)
    return lambda: repeated(fn, r.s.launch_steps)


def _compile_order(r: Run) -> list[str]:
    """The baseline (the MFU target), then the reallocations by their eager training speed."""
    eager_tps = {
        row["candidate"]: row["median"]
        for row in r.res["rows"]
        if row["setting"].get("section") == "train" and row["setting"].get("mode") == "eager"
    }
    return [BASELINE] + sorted(r.reallocs, key=lambda n: -eager_tps.get(n, 0.0))


def _compile_and_time(r: Run, names: list[str], again: list[str]) -> str | None:
    """Compile each candidate's blocks while the budget allows, then time the ones that compiled,
    interleaved with `again` (already compiled: its row from this pass is dropped, the earlier
    pass's stays)."""
    from vlm.model.compile import compile_blocks

    s = r.s
    done, skipped = [], []
    for n in (n for n in names if n in r.models):
        reserve = max(s.compile_reserve_s, 1.2 * max(r.compile_s.values(), default=0.0))
        if r.budget.left() < reserve:
            skipped.append(n)
            r.res["unavailable"][f"{n} (compiled train)"] = (
                f"skipped: time budget ({r.budget.left():.0f} "
                f"s left, a compile needs ~{reserve:.0f} s)"
            )
            continue
        t0 = time.perf_counter()
        try:
            with compile_backend(s.compile_backend):
                if not compile_blocks(r.models[n]):
                    raise RuntimeError("compile_blocks found no transformer block to compile")
            _step(r, n)()  # compiles the forward and the backward
            r.dev.sync()
            r.compile_s[n] = time.perf_counter() - t0
            done.append(n)
            r.log(f"  compiled {n} in {r.compile_s[n]:.0f} s ({s.compile_backend})")
        except Exception as e:  # noqa: BLE001
            r.res["unavailable"][f"{n} (compiled train)"] = reason(e)
            r.log(f"  compile {n}: unavailable: {r.res['unavailable'][f'{n} (compiled train)']}")
            r.dev.free()
        r.save()
    if done:
        rows = time_train(r, "compiled", again + done, max(1, s.warmup - 1))
        if again and rows and rows[0]["candidate"] == BASELINE:
            r.res["rows"] = [x for x in r.res["rows"] if x is not rows[0]]
        r.launches("compiled", "train", {n: _counted(r, n) for n in done})
    return f"time budget: {skipped} not compiled" if skipped else None
