"""What `vlm bench gpu` prints and draws: common.table's rows, then the device, MFU, memory,
launches, eager against compiled and the targets as PASS / FAIL lines; a four-panel figure."""

from __future__ import annotations

import sys
import textwrap

from eval.bench import common
from eval.bench.gpu.errors import reason


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def table(res: dict) -> str:
    """common.table's rows, then the device, MFU, memory, launches, eager against compiled, and the targets."""
    g = res.get("gpu", {})
    lines = [common.table(res)]
    lines.append(
        f"  device: {g.get('name')} ({g.get('device')}"
        + (
            f", sm {'.'.join(map(str, g['capability']))}, {g.get('memory_GiB')} GiB"
            if g.get("capability")
            else ""
        )
        + f"), torch {g.get('torch')}, CUDA {g.get('cuda')}; {g.get('peak_note')}"
    )
    lines.append(
        "  sections: "
        + ", ".join(
            f"{k} {v['status']}" + (f" ({v['seconds']} s)" if "seconds" in v else "")
            for k, v in res.get("sections", {}).items()
        )
    )
    train = [r for r in res["rows"] if r["setting"].get("section") == "train"]
    if train:
        lines.append(
            "  MFU of the training step (model FLOPs = 3 x vlm.model.flops "
            "forward per token; attention map excluded / included):"
        )
        for n in dict.fromkeys(r["candidate"] for r in train):
            cells = [
                f"{r['setting']['mode']} {_pct(r.get('mfu'))} / {_pct(r.get('mfu_incl_attn_map'))}"
                for r in train
                if r["candidate"] == n
            ]
            lines.append(f"    {n:<22} " + "   ".join(cells))
    for m in res.get("memory", []):
        v = m.get("MiB_per_token")
        lines.append(
            f"  memory {m['candidate']:<22} activation_checkpoint={m['activation_checkpoint']:<9} "
            + (
                f"{v:.3f} MiB/token (peak {m['peak_step_bytes'] / 2**30:.2f} GiB over the step)"
                + (f", x{m['vs_none']:.2f} of none" if "vs_none" in m else "")
                if v is not None
                else f"n/a: {m.get('reason')}"
            )
        )
    for x in res.get("launches", []):
        per = x.get("per_step")
        lines.append(
            f"  launches {x['candidate']:<22} {x['mode']:<8} {x['step']:<12} "
            + (
                f"{per:,.0f} {x['metric']}"
                + (
                    f", {x['host_syncs_per_step']:.1f} host syncs/step"
                    if "host_syncs_per_step" in x
                    else ""
                )
                if per is not None
                else f"n/a: {x.get('reason')}"
            )
        )
    for x in res.get("eager_vs_compiled", []):
        lines.append(
            f"  eager vs compiled: {x['section']} {x['candidate']} "
            + ", ".join(f"{k}={v}" for k, v in x["setting"].items())
            + f": {common._fmt(x['eager'])} -> {common._fmt(x['compiled'])} "
            f"{x['unit']} (compiled: x{x['compiled_speedup']:.2f} the eager speed)"
        )
    for name, why in res.get("errors", {}).items():
        lines.append(f"  ERROR {name}: {why}")
    lines.append(
        "  targets"
        + (" (smoke: toy shapes, not meaningful)" if res.get("mode") == "smoke" else "")
        + ":"
    )
    for t in res.get("targets", []):
        verdict = "n/a " if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        value = (
            "n/a"
            if t["value"] is None
            else (_pct(t["value"]) if "MFU" in t["target"] else f"{t['value']:g}")
        )
        lines.append(f"    {verdict}  {t['target']}: {value} ({t['detail']})")
    return "\n".join(lines)


def plot(res: dict, path) -> None:
    """Four panels: training tokens/s and MFU, prefill tokens/s vs length, decode ms per step,
    memory per token. A figure that fails says so on stderr and leaves the JSON (already written) as
    the result."""
    try:
        _plot(res, path)
    except Exception as e:  # noqa: BLE001
        print(f"vlm bench gpu: no figure: {reason(e)}", file=sys.stderr)


def _plot(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    names = list(res.get("configs", {})) or list(dict.fromkeys(r["candidate"] for r in rows))
    colour = {n: f"C{i % 10}" for i, n in enumerate(names)}

    def empty(ax, title, why="not measured"):
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(
            0.5,
            0.5,
            textwrap.fill(str(why), 40),
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
        )

    def bars(ax, section, key, title, ylabel, label_fn=None):
        rs = [r for r in rows if r["setting"].get("section") == section]
        groups = list(dict.fromkeys(key(r) for r in rs))
        if not rs:
            return empty(ax, title)
        w = 0.8 / max(1, len(groups))
        for j, gname in enumerate(groups):
            labelled = False
            for i, n in enumerate(names):
                r = next((r for r in rs if key(r) == gname and r["candidate"] == n), None)
                if r is None:
                    continue
                ax.bar(
                    i + j * w,
                    r["median"],
                    w,
                    color=colour[n],
                    alpha=1.0 - 0.6 * j / len(groups),
                    label=None if labelled else gname,
                    edgecolor="black",
                    lw=0.4,
                    hatch="//" if j % 2 else None,
                )
                labelled = True
                if label_fn:
                    ax.text(
                        i + j * w, r["median"], label_fn(r), ha="center", va="bottom", fontsize=6
                    )
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))])
        ax.set_xticklabels([n.replace(" ", "\n", 1) for n in names], fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)

    bars(
        axes[0],
        "train",
        lambda r: r["setting"]["mode"],
        "training step (labels: MFU)",
        "tokens/s",
        lambda r: "" if r.get("mfu") is None else f"{100 * r['mfu']:.0f}%",
    )
    pre = [r for r in rows if r["setting"].get("section") == "prefill"]
    if pre:
        ax = axes[1]
        for n in dict.fromkeys(r["candidate"] for r in pre):
            pts = sorted((r["setting"]["seq_len"], r["median"]) for r in pre if r["candidate"] == n)
            base = n.split(" (")[0]
            ax.plot(
                *zip(*pts),
                marker="o",
                color=colour.get(base, "k"),
                label=n,
                ls="--"
                if n.endswith("(learned)")
                else ":"
                if n.endswith("(forced, tight)")
                else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("prefill tokens/s")
        ax.set_title(
            "prefill (solid: forced at T/R, dotted: with the training capacity, dashed: learned)",
            fontsize=8,
        )
        ax.legend(fontsize=6)
    else:
        empty(axes[1], "prefill")
    bars(
        axes[2],
        "decode",
        lambda r: f"{r['setting']['mode']} B={r['setting']['batch']}",
        f"decode after {res['settings']['decode_context']} tokens",
        "ms per step",
    )
    mem = [m for m in res.get("memory", []) if m.get("MiB_per_token") is not None]
    if mem:
        bars(
            axes[3],
            "memory",
            lambda r: r["setting"]["activation_checkpoint"],
            "training step's peak memory per token",
            "MiB per token",
        )
    else:
        empty(
            axes[3],
            "memory per token",
            next((m.get("reason") for m in res.get("memory", [])), "not measured"),
        )
    g = res.get("gpu", {})
    fig.suptitle(
        f"vlm bench gpu: {g.get('name')}, {res['settings']['dtype']}, gpu.yaml's "
        f"LLM vs its reallocations (R = {res['settings']['ratio']:g})"
        + ("  [smoke: toy shapes]" if res.get("mode") == "smoke" else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
