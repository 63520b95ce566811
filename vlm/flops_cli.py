"""`vlm flops`: parameters, per-token FLOPs, attention map and KV cache, and
the fair-comparison table.

    vlm flops --config configs/paper_moe_90b.yaml --ratio 1.5 --seq-len 32768
    vlm flops --config configs/paper_ct_90b_top15.yaml --baseline configs/paper_moe_90b.yaml

A config file is a trainer config; only its top-level `model:` section (a ModelConfig) is read. If
the model has chunking off it is the MoE baseline and the three section-3.5 strategies are derived
from it at ratio R. If chunking is on, it is shown next to `--baseline` (and the strategies derived
from that), or, without one, next to its own chunk-off twin (same weights; not FLOPs-matched).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from configs.arg_types import finite_number, whole_number
from configs.config import ConfigError, apply_overrides, load_yaml
from configs.folder_lock import folder_problem
from vlm.cli import refuse_set_option
from vlm.model.config import ModelConfig, model_config_from
from vlm.model.reallocate import comparison_table, search_reallocations


def load_model_config(path: str | Path, overrides: list[str] | None = None) -> ModelConfig:
    """The `model:` section of a trainer config file as a validated ModelConfig (other sections ignored)."""
    data = apply_overrides(load_yaml(path), overrides or [])
    if "model" not in data:
        raise ConfigError(
            f"config file {path} has no top-level 'model:' section (a ModelConfig mapping)"
        )
    model = data["model"] or {}
    if not isinstance(model, dict):
        raise ConfigError(f"config file {path}: 'model' must be a mapping, got {model!r}")
    return model_config_from(model, "model")


def _si(x: float, unit: str = "") -> str:
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{p}{unit}"
    return f"{x:.3g}{unit}"


def _bytes(x: float) -> str:
    for div, p in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= div:
            return f"{x / div:.3g} {p}"
    return f"{x:.0f} B"


def _params(x: float) -> str:
    return f"{x / 1e9:.3f}B" if x >= 1e8 else f"{x / 1e6:.3f}M"


def format_tables(
    rows: list[dict],
) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(header, rows) of the matching table and of Table 1 with numbers."""
    h1 = [
        "method",
        "changes",
        "total params",
        "x base",
        "activated",
        "FLOPs/token",
        "x base",
        "match",
    ]
    t1 = [
        [
            r["method"],
            r["changes"],
            _params(r["total_params"]),
            f"{r['params_ratio']:.4f}",
            _params(r["activated_params"]),
            _si(r["flops_per_token"]),
            f"{r['flops_ratio']:.4f}",
            "ok" if r["within_tol"] else "NO",
        ]
        for r in rows
    ]
    h2 = [
        "method",
        "attn map C",
        "reduction",
        "KV cache C",
        "reduction",
        "attn map all",
        "reduction",
        "KV cache all",
        "reduction",
    ]
    t2 = [
        [
            r["method"],
            _si(r["attn_map_flops_concept"]),
            f"{r['attn_reduction_concept']:.3f}x",
            _bytes(r["kv_cache_bytes_concept"]),
            f"{r['kv_reduction_concept']:.3f}x",
            _si(r["attn_map_flops"]),
            f"{r['attn_reduction']:.3f}x",
            _bytes(r["kv_cache_bytes"]),
            f"{r['kv_reduction']:.3f}x",
        ]
        for r in rows
    ]
    return h1, t1, h2, t2


def _plain(title: str, header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join(
        [title, line(header), line(["-" * w for w in widths])] + [line(r) for r in body]
    )


def print_tables(rows: list[dict], title: str, plain: bool = False, file=None) -> None:
    file = file or sys.stdout
    h1, t1, h2, t2 = format_tables(rows)
    titles = (
        f"{title}: parameters and per-token FLOPs (attention map excluded)",
        "Table 1 with numbers (C = concept model; reduction = baseline / this)",
    )
    try:
        if plain:
            raise ImportError
        from rich.console import Console
        from rich.table import Table

        console = Console(file=file, width=max(120, Console(file=file).width))
        for t, h, body in ((titles[0], h1, t1), (titles[1], h2, t2)):
            table = Table(title=t, title_justify="left")
            for i, col in enumerate(h):
                table.add_column(col, justify="left" if i < 2 else "right", overflow="fold")
            for r in body:
                table.add_row(*r)
            console.print(table)
    except ImportError:
        print(_plain(titles[0], h1, t1) + "\n\n" + _plain(titles[1], h2, t2), file=file)
    for r in rows:
        if r["note"] or not r["within_tol"]:
            print(
                f"note [{r['method']}]: {r['note'] or 'not within tolerance of the baseline'}",
                file=file,
            )


def plot_scaling(rows_by_len: dict[int, list[dict]], path: str | Path) -> None:
    """Prefill compute (per-token FLOPs x N + attention map) and KV cache relative to the baseline vs N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted(rows_by_len)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r0 in rows_by_len[lens[0]]:
        name = r0["name"]
        pf, kv = [], []
        for n in lens:
            rows = {r["name"]: r for r in rows_by_len[n]}
            b, r = rows["baseline"], rows[name]
            pf.append(
                (b["flops_per_token"] * n + b["attn_map_flops"])
                / (r["flops_per_token"] * n + r["attn_map_flops"])
            )
            kv.append(r["kv_reduction"])
        a1.plot(lens, pf, marker="o", label=r0["method"])
        a2.plot(lens, kv, marker="o", label=r0["method"])
    for ax, t in ((a1, "prefill FLOPs: baseline / config"), (a2, "KV cache: baseline / config")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_problem(plot: str) -> str | None:
    """Why the --plot PNG cannot be written (None: it can), found before any work."""
    path = Path(plot)
    if path.is_dir():
        return f"--plot {path} is a folder; give a file name, e.g. {path / 'flops.png'}"
    problem = folder_problem(path.parent)
    if problem is None and path.exists():
        try:
            open(path, "ab").close()  # an existing file: writable, left as it is
        except OSError as e:
            problem = f"cannot write {path} ({e.strerror or e})"
    return None if problem is None else f"--plot {path}: {problem}"


def run_flops(args: argparse.Namespace) -> int:
    if args.plot and (problem := _plot_problem(args.plot)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        overrides = args.overrides
        if overrides and not args.config:
            raise ConfigError("overrides need --config (they apply to its mapping)")
        cfg = load_model_config(args.config, overrides) if args.config else ModelConfig()
        if args.ratio is not None:
            cfg = replace(cfg, chunk=replace(cfg.chunk, target_ratio=float(args.ratio)))
        base = load_model_config(args.baseline) if args.baseline else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    extra = {}
    if cfg.chunk.enabled:
        extra = {"this config": cfg}
        if base is None:
            base = cfg.baseline()
            print(
                "note: no --baseline given; comparing with this config's "
                "chunk-off twin (same weights, not FLOPs-matched).",
                file=sys.stderr,
            )
    else:
        base = cfg
    if base.chunk.enabled:
        print(
            f"error: --baseline {args.baseline} has chunk.enabled: true; a baseline is a plain MoE",
            file=sys.stderr,
        )
        return 2
    ratio = cfg.chunk.target_ratio
    options = dict(loop_layers=args.loop_layers, concept_heads=args.concept_heads)
    if extra:  # let strategies 2 and 3 aim at the given config's loop count and width
        if options["loop_layers"] is None and cfg.loop_times == 1:
            options["loop_layers"] = cfg.loop_end - cfg.loop_start
        if options["concept_heads"] is None and cfg.c_heads > base.c_heads:
            options["concept_heads"] = cfg.c_heads
    try:
        found = search_reallocations(base, ratio, args.tol, **options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = comparison_table(
        base,
        ratio,
        args.seq_len,
        args.bytes_per_el,
        not args.full_attention,
        args.tol,
        extra,
        found,
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        kind = "ConceptMoE" if cfg.chunk.enabled else "baseline MoE"
        title = (
            f"{args.config or 'default ModelConfig'} ({kind}; R = {ratio:g}, N = "
            f"{args.seq_len}, {'causal' if not args.full_attention else 'full'} "
            f"attention, KV {args.bytes_per_el} B/el)"
        )
        print_tables(rows, title, plain=args.plain)
    if args.plot:
        lens = [2**k for k in range(12, 21)]
        by_len = {
            n: comparison_table(
                base, ratio, n, args.bytes_per_el, not args.full_attention, args.tol, extra, found
            )
            for n in lens
        }
        try:
            plot_scaling(by_len, args.plot)
        except OSError as e:  # the disk filled, the folder went read-only since the check
            print(
                f"error: --plot {args.plot}: cannot write it ({e.strerror or e})", file=sys.stderr
            )
            return 2
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def add_flops_command(subparsers) -> argparse.ArgumentParser:
    """Register `flops` on an argparse subparsers object; the handler is `args.func(args) -> int`."""
    p = subparsers.add_parser(
        "flops",
        help="parameters, FLOPs, attention map, KV cache; fair-comparison table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="trainer config YAML; only its `model:` section is read")
    p.add_argument(
        "--baseline", help="baseline MoE config YAML (its `model:`) for a ConceptMoE --config"
    )
    p.add_argument(
        "--ratio",
        type=finite_number("a compression ratio", 1.0, strict=True),
        help="compression ratio R (default: model.chunk.target_ratio)",
    )
    p.add_argument(
        "--seq-len",
        type=whole_number("tokens"),
        default=32768,
        help="sequence length N for attention map and KV cache",
    )
    p.add_argument(
        "--bytes-per-el",
        type=whole_number("bytes"),
        default=2,
        help="bytes per KV-cache element (2 = bf16)",
    )
    p.add_argument(
        "--full-attention",
        action="store_true",
        help="count N^2 attention pairs, not causal N(N+1)/2",
    )
    p.add_argument(
        "--tol",
        type=finite_number("a tolerance", 0.0),
        default=0.02,
        help="matching tolerance on FLOPs and parameters",
    )
    p.add_argument(
        "--loop-layers",
        type=whole_number("layers"),
        help="strategy 2: target number of looped concept layers",
    )
    p.add_argument(
        "--concept-heads",
        type=whole_number("heads"),
        help="strategy 3: concept head count (default ~ sqrt(R) x heads)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--plain", action="store_true", help="plain-text tables instead of rich")
    p.add_argument(
        "--plot", help="write a PNG of prefill-FLOPs and KV-cache reduction vs sequence length"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides from the file's top level, "
        "e.g. model.moe.top_k=4 (as for `vlm train`)",
    )
    refuse_set_option(p)
    p.set_defaults(func=run_flops)
    return p


def main(argv: list[str] | None = None) -> int:
    """`vlm ARGV...` (ARGV starts with `flops`), kept for callers of this module."""
    from vlm.cli import main as vlm_main

    return vlm_main(argv)
