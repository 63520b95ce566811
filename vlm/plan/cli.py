"""`vlm plan`: what one rank of a run needs, and whether it fits, from the config alone.

    vlm plan --config configs/gpu.yaml --ranks 8 --gpu-memory-gb 80
    vlm plan --config configs/paper_ct_90b_top15.yaml --ranks 512 --gpu-memory-gb 80 \\
        parallel.expert=64 parallel.sequence=8 model.activation_checkpoint=full \\
        data.row_tokens=131072 data.rows_per_batch=1 --json
    vlm plan --config configs/gpu.yaml --ranks 8 --gpu-memory-gb 80 --longest-row \\
        model.activation_checkpoint=full parallel.sequence=2

No weights, data or GPU: the model is built on the meta device with the run's sharding, and one
micro-batch's forward and backward run there at the run's sizes (docs/training.md, "What fits
where"). Overrides are the trainer's (`key=value`, dotted from the config's top level).
"""

from __future__ import annotations

import argparse
import json
import sys

from configs.arg_types import finite_number, whole_number

GiB = 2**30


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_plan(plan) -> str:
    """The plan as the terminal shows it."""
    d = plan.as_dict()
    lay, mem, act = d["layout"], plan.memory, d["activations"]
    kind = f"ZeRO {lay['zero_stage']}{', bf16' if lay['bf16'] else ', fp32'}"
    head = (
        f"vlm plan: {plan.config} on {lay['world']} {plan.device} rank(s): {lay['data']} data x "
        f"{lay['sequence']} sequence; experts split over {lay['expert']}; {kind}"
    )
    batch = (
        f"  a micro-batch: {act['rows']} row(s) x {act['row_tokens_per_rank']} tokens per rank; "
        f"{plan.micro_batches} micro-batch(es) per step; activation checkpointing "
        f"{act['checkpointing']}"
    )
    n = d["parameters"]
    lines = [head, batch, f"  parameters: {n['total']:,} ({n['this_rank']:,} on this rank)"]
    lines += [f"  needs: {n}" for n in plan.needs]
    lines.append("per rank (GiB)")
    rows = [
        ("weights", mem["weights"]),
        ("gradients", mem["gradients"]),
        ("optimizer state (AdamW moments, fp32 master)", mem["optimizer"]),
        ("activations (forward + backward peak)", mem["activations"]),
        ("the sequence split's whole-row buffers", mem["sequence_row_buffers"]),
        ("vision tower", mem["vision"]),
        ("engine buffers (reduce buckets, gathered params)", mem["engine_buffers"]),
    ]
    lines += [f"  {name:<52}{_gib(v)}" for name, v in rows]
    moment = max(plan.moments, key=plan.moments.get)
    lines.append(f"  {'peak (' + moment + ')':<52}{_gib(plan.peak)}")
    if plan.gpu_memory_gb is not None:
        need = plan.per_rank_gb * (1 + d["headroom"]["fragmentation"]) + plan.reserved_gb
        verdict = "fits" if plan.fits else "does NOT fit"
        reserve = (
            f" + {plan.reserved_gb:g} GiB (CUDA context, NCCL, cuBLAS)" if plan.reserved_gb else ""
        )
        lines.append(
            f"  {verdict} in {plan.gpu_memory_gb:g} GiB: peak x 1.10 (allocator fragmentation)"
            f"{reserve} = {need:.2f} GiB"
        )
    lines.append("activations held at the end of the forward, bytes per token, by part")
    per = act["bytes_per_token_by_part"]
    lines += [f"  {k:<52}{v:>12,.0f}" for k, v in per.items()]
    lines.append(
        f"  loss: tiles of {act['loss_tile_tokens']:,} tokens (untiled [T, V] logits would hold "
        f"{act['loss_untiled_bytes'] / GiB:.2f} GiB)"
    )
    v = act["vision"]
    if v.get("images"):
        lines.append(
            f"  vision: {v['images']} image(s) of {v['patches_per_image']} patches per "
            f"micro-batch ({v['image_share']:.0%} of the tokens), {v['per_image'] / 2**20:.1f} "
            "MiB each"
        )
    lines.append("communication per optimizer step, bytes this rank sends (GiB)")
    lines += [f"  {k:<52}{_gib(v)}" for k, v in d["communication_bytes_per_step"].items()]
    ck = d["checkpoint_bytes"]
    lines.append(
        f"checkpoint: rank 0 writes {ck['rank0'] / GiB:.2f} GiB (weights "
        f"{ck['weights'] / GiB:.2f}, optimizer {ck['optimizer'] / GiB:.2f})"
    )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def format_longest(found) -> str:
    """`--longest-row` as the terminal shows it: the row, how it was found, and its plan."""
    a, b = found.fit
    lines = [
        f"longest row: {found.row_tokens:,} tokens"
        if found.row_tokens
        else "longest row: none fits (not even the shortest row planned)",
        (
            f"  the backward's peak along the row: {a / 2**30:.2f} GiB + {b / 2**20:.3f} MiB per "
            "token (two plans), then planned at the row itself"
        ),
    ]
    lines += [
        f"  planned {t:>10,} tokens: {g:8.2f} GiB, {'fits' if f else 'does not fit'}"
        for t, g, f in found.tried
    ]
    if found.plan is not None:
        lines.append(format_plan(found.plan))
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    from configs.config import ConfigError
    from vlm.plan.plan import make_plan

    if args.longest_row:
        return _run_longest(args)
    try:
        plan = make_plan(
            args.config,
            args.ranks,
            args.overrides,
            gpu_memory_gb=args.gpu_memory_gb,
            device=args.device,
            image_share=args.image_share,
        )
    except (ConfigError, OSError) as e:
        print(f"vlm plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def _run_longest(args: argparse.Namespace) -> int:
    from configs.config import ConfigError
    from vlm.plan.longest import longest_row

    if args.gpu_memory_gb is None:
        print("vlm plan: --longest-row needs --gpu-memory-gb (the memory to fit)", file=sys.stderr)
        return 2
    try:
        found = longest_row(
            args.config,
            args.ranks,
            args.overrides,
            args.gpu_memory_gb,
            device=args.device,
            image_share=args.image_share,
        )
    except (ConfigError, OSError) as e:
        print(f"vlm plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(found.as_dict(), indent=2) if args.json else format_longest(found))
    return 0


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object; the handler is `args.func(args) -> int`."""
    p = subparsers.add_parser(
        "plan",
        help="per-rank memory, communication and checkpoint of a run; whether it fits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="the run's config YAML")
    p.add_argument("--ranks", required=True, type=whole_number("ranks"), help="ranks of the run")
    p.add_argument(
        "--gpu-memory-gb",
        type=finite_number("GiB of memory per GPU", 0.0, strict=True),
        help="memory of one GPU (GiB): say whether the run fits",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="what the ranks train on (cpu: the host is the device; the loss's tile size)",
    )
    p.add_argument(
        "--image-share",
        type=finite_number("a share of a row's tokens", 0.0),
        help="image tokens' share of a row in the worst micro-batch (default 1: all of it)",
    )
    p.add_argument(
        "--longest-row",
        action="store_true",
        help="find the longest row (one per micro-batch) that fits --gpu-memory-gb",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, as for `vlm train`"
    )
    p.set_defaults(func=run_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    """`vlm plan ARGV...` with this command alone (python -m vlm.plan)."""
    from configs.config import parse_args_anywhere

    parser = argparse.ArgumentParser(prog="vlm")
    add_plan_command(parser.add_subparsers(dest="command", required=True))
    args = parse_args_anywhere(parser, ["plan", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)
