"""The last section, computed from whatever was measured (even past the budget): every compiled step
measured or unavailable with a reason, eager against compiled, and issue 35's targets as verdicts
(never assertions)."""

from __future__ import annotations

from eval.bench.gpu.state import Run
from eval.bench.model import BASELINE

MFU_TARGET, TRAIN_RATIO_TARGET, PREFILL_RATIO_TARGET, DECODE_MS_TARGET = 0.25, 1.0, 1.25, 10.0


def summarise(r: Run) -> None:
    _fill_unreached(r)
    r.res["eager_vs_compiled"] = _eager_vs_compiled(r.res["rows"])
    _targets(r)


def _fill_unreached(r: Run) -> None:
    """Every candidate's compiled training and decode steps are measured or unavailable
    with a reason (a section the budget skipped names none); every compiled training step
    has a launches record."""
    measured = {
        (x["candidate"], x["setting"]["section"], x["setting"].get("batch"))
        for x in r.res["rows"]
        if x["setting"].get("mode") == "compiled"
    }
    skipped = {k for k, v in r.res["sections"].items() if v["status"] == "skipped"}
    why = "not reached: " + (
        f"the time budget skipped {sorted(skipped)}" if skipped else "an earlier error"
    )
    un = r.res["unavailable"]
    for n in r.cfgs:
        if (n, "train", None) not in measured:
            un.setdefault(f"{n} (compiled train)", why)
            if not any(
                x["candidate"] == n and x["mode"] == "compiled" and x["step"] == "train"
                for x in r.res["launches"]
            ):
                r.res["launches"].append(
                    {
                        "candidate": n,
                        "mode": "compiled",
                        "step": "train",
                        "per_step": None,
                        "reason": un[f"{n} (compiled train)"],
                    }
                )
        for B in r.s.decode_batches:
            if (n, "decode", B) not in measured and f"{n} (compiled decode)" not in un:
                un.setdefault(f"{n} (compiled decode B={B})", why)


def _eager_vs_compiled(rows: list[dict]) -> list[dict]:
    """Every compiled training or decode row next to its eager twin (same candidate and setting)."""

    def twin(x):
        return x["candidate"], tuple(sorted((k, v) for k, v in x["setting"].items() if k != "mode"))

    steps = [x for x in rows if x["setting"].get("section") in ("train", "decode")]
    eager = {twin(x): x for x in steps if x["setting"]["mode"] == "eager"}
    out = []
    for c in steps:
        e = eager.get(twin(c))
        if c["setting"]["mode"] != "compiled" or e is None:
            continue
        speedup = c["median"] / e["median"] if c["unit"] == "tok/s" else e["median"] / c["median"]
        out.append(
            {
                "section": c["setting"]["section"],
                "candidate": c["candidate"],
                "setting": {k: v for k, v in c["setting"].items() if k not in ("section", "mode")},
                "eager": e["median"],
                "compiled": c["median"],
                "unit": c["unit"],
                "compiled_speedup": round(speedup, 3),
            }
        )
    return out


def _targets(r: Run) -> None:
    s, rows = r.s, r.res["rows"]

    def pick(section, **setting):
        return [
            x
            for x in rows
            if x["setting"].get("section") == section
            and all(x["setting"].get(k) == v for k, v in setting.items())
        ]

    def target(text, threshold, value, detail, higher=True):
        ok = None if value is None else (value >= threshold if higher else value <= threshold)
        r.res["targets"].append(
            {"target": text, "threshold": threshold, "value": value, "detail": detail, "pass": ok}
        )

    # 1. the baseline's training MFU: compiled when it compiled (what the trainer runs on CUDA),
    #    else eager
    best = next(
        (
            (x["mfu"], mode)
            for mode in ("compiled", "eager")
            for x in pick("train", mode=mode)
            if x["candidate"] == BASELINE and x.get("mfu") is not None
        ),
        None,
    )
    target(
        "MoE baseline trains at >= 25 % MFU (attention map excluded)",
        MFU_TARGET,
        best and best[0],
        best[1] if best else "no MFU (no training step, or no peak for this device)",
    )
    # 2. the best reallocation's training tokens/s against the baseline's, same mode
    best = None
    for mode in ("compiled", "eager"):
        tps = {x["candidate"]: x["median"] for x in pick("train", mode=mode)}
        if BASELINE in tps and len(tps) > 1:
            n = max((k for k in tps if k != BASELINE), key=tps.get)
            best = (round(tps[n] / tps[BASELINE], 3), f"{n}, {mode}")
            break
    target(
        f"ConceptMoE training step >= 1.0x the baseline's tokens/s at {s.train_len}",
        TRAIN_RATIO_TARGET,
        best and best[0],
        best[1] if best else "not measured",
    )
    # 3. prefill at 4K (or the shortest length measured), forced boundaries; the learned row
    #    beside it
    lens = sorted({x["setting"]["seq_len"] for x in pick("prefill")})
    T = 4096 if 4096 in lens else (lens[0] if lens else None)
    at_len = {x["candidate"]: x for x in pick("prefill", seq_len=T)} if T else {}
    forced = {k: v["ratio_vs_baseline"] for k, v in at_len.items() if k.endswith("(forced)")}
    n = max(forced, key=forced.get) if forced else None
    learned = at_len.get(n.replace("(forced)", "(learned)")) if n else None
    tight = at_len.get(n.replace("(forced)", "(forced, tight)")) if n else None
    detail = (
        "not measured"
        if n is None
        else n
        + (
            ""
            if learned is None
            else f"; learned boundaries x{learned['ratio_vs_baseline']:.2f} (R {learned['R']})"
        )
        + (
            ""
            if tight is None
            else f"; with the training capacity x{tight['ratio_vs_baseline']:.2f}"
        )
    )
    target(
        f"ConceptMoE prefill >= 1.25x the baseline's tokens/s at {T or 4096} (forced boundaries)",
        PREFILL_RATIO_TARGET,
        round(forced[n], 3) if n else None,
        detail,
    )
    # 4. decode at batch 8: the fastest ConceptMoE, eager or compiled; the baseline's figure
    #    beside it
    B8 = max(s.decode_batches)
    dec = pick("decode", batch=B8)
    b = min((x for x in dec if x["candidate"] != BASELINE), key=lambda x: x["median"], default=None)
    base = min((x["median"] for x in dec if x["candidate"] == BASELINE), default=None)
    detail = (
        "not measured"
        if b is None
        else f"{b['candidate']}, {b['setting']['mode']}"
        + (f"; baseline best {base:.2f} ms" if base else "")
    )
    target(
        f"decode <= 10 ms per step at batch {B8} (ConceptMoE)",
        DECODE_MS_TARGET,
        round(b["median"], 2) if b else None,
        detail,
        higher=False,
    )
    if s.tiny:
        r.res["notes"].append("smoke settings: toy shapes, the targets' PASS/FAIL say nothing")
