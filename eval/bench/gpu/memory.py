"""The memory section: the peak a training step adds (activations, gradients, temporaries) per
token, with `activation_checkpoint` none and selective; on a CPU the step runs and the figure is
null, with the reason."""

from __future__ import annotations

from dataclasses import replace

from eval.bench.gpu.rig import build, optimizer, train_step
from eval.bench.gpu.state import Run


def memory(r: Run) -> str | None:
    s = r.s
    skipped = []
    for n, c in r.cfgs.items():
        for ac in s.memory_ac:
            if r.budget.left() < 15.0:
                skipped.append(f"{n}/{ac}")
                continue
            r.res["memory"].append(_measure(r, n, ac))
    by = {(m["candidate"], m["activation_checkpoint"]): m for m in r.res["memory"]}
    for n in r.cfgs:
        none, sel = by.get((n, "none")), by.get((n, "selective"))
        if none and sel and none["MiB_per_token"] and sel["MiB_per_token"]:
            sel["vs_none"] = round(sel["MiB_per_token"] / none["MiB_per_token"], 3)
            if sel["vs_none"] > 0.98:
                r.res["notes"].append(
                    f"memory: selective checkpointing saved < 2 % for {n}: "
                    "is activation_checkpoint='selective' implemented?"
                )
    for ac in s.memory_ac:
        got = {
            m["candidate"]: [m["MiB_per_token"]]
            for m in r.res["memory"]
            if m["activation_checkpoint"] == ac and m["MiB_per_token"]
        }
        r.rows(
            got,
            {
                "section": "memory",
                "activation_checkpoint": ac,
                "rows": s.train_rows,
                "seq_len": s.train_len,
            },
            "peak step memory per token",
            "MiB/tok",
        )
    return f"time budget: {skipped} not measured" if skipped else None


def _measure(r: Run, n: str, ac: str) -> dict:
    """A fresh model with checkpointing `ac`: one step to create the optimizer's state, then the step measured."""
    s, dev, c = r.s, r.dev, r.cfgs[n]
    rec = {
        "candidate": n,
        "activation_checkpoint": ac,
        "rows": s.train_rows,
        "seq_len": s.train_len,
        "peak_step_bytes": None,
        "MiB_per_token": None,
    }
    try:
        m = build(replace(c, activation_checkpoint=ac), dev, r.dtype)
        opt = optimizer(m, dev)
        fn = train_step(m, opt, r.train_batch, r.train_force if c.chunk.enabled else None)
        fn()
        opt.zero_grad(set_to_none=True)
        peak = dev.step_peak_bytes(fn)
        rec["grad_bytes"] = sum(
            p.numel() * p.element_size() for p in m.parameters() if p.requires_grad
        )
        if peak is None:
            rec["reason"] = (
                "CPU: torch.cuda.max_memory_allocated needs a CUDA device (the step ran)"
            )
        else:
            rec.update(
                peak_step_bytes=peak,
                MiB_per_token=round(peak / (s.train_rows * s.train_len) / 2**20, 4),
            )
        del m, opt, fn
    except Exception as e:  # noqa: BLE001
        key = f"memory: {n} activation_checkpoint={ac}"
        r.error(key, e)
        rec["reason"] = r.res["errors"][key]
    dev.free()
    return rec
