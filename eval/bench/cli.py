"""`vlm bench`: run benchmark parts and write DIR/<part>.json and DIR/<part>.png; prints
each part's table.

    vlm bench [model|decode|moe|loader|attention|vision|realized|gpu|alltoall|longrow|checkpoint|all]
              [--quick] [--out DIR] [--ckpt DIR]
    vlm bench loader [--config RUN.yaml] [--data SHARDS] [--tokens-per-s N] [--world-size M --rank R]

`realized` (prefill with the boundaries a trained router draws on real prompts) needs a checkpoint:
`all` runs it when --ckpt is given. `gpu` (MFU, prefill, decode, memory and kernel launches of
configs/gpu.yaml's LLM on one CUDA device, in under 8 minutes) runs only when named, and refuses
without CUDA unless --smoke. `alltoall` (expert parallelism's token exchange on one MoE layer)
runs only when named, under `torchrun --nproc_per_node N -m eval.bench alltoall` for N expert
ranks (CUDA: nccl, else gloo). `longrow` (a training forward and backward of one long row split
over the ranks by sequence parallelism: time and the row's peak memory per rank) likewise, under
`torchrun --nproc_per_node S -m eval.bench longrow` for S sequence ranks (one process: S = 1).
`checkpoint` (one rank's share of a checkpoint: staged, written and hashed in the background,
verified on resume, against the synchronous save) runs only when named.

--quick: fewer lengths and rounds (`all` in under 5 minutes on 2 CPU cores). --smoke (not in
--help): tiny shapes and two rounds, for tests of one part's plumbing; its figures say
nothing about speed.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from dataclasses import replace

PARTS = ("model", "decode", "moe", "loader", "attention", "vision")
CKPT_PARTS = ("realized",)  # parts that measure a trained checkpoint (--ckpt)
GPU_PARTS = ("gpu",)  # parts that measure a CUDA device: never in `all`, only when named
# parts that measure several processes (torchrun --nproc_per_node N -m eval.bench PART): only
# when named; one process measures what it can alone
DIST_PARTS = ("alltoall", "longrow")
# parts that measure the machine's disk: only when named
DISK_PARTS = ("checkpoint",)


def add_bench_command(subparsers) -> None:
    ap = subparsers.add_parser(
        "bench",
        help="speed and memory benchmarks against the MoE baseline",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument(
        "part",
        nargs="?",
        default="all",
        choices=PARTS + CKPT_PARTS + GPU_PARTS + DIST_PARTS + DISK_PARTS + ("all",),
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer lengths and rounds (all parts: < 5 min on 2 cores)",
    )
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--out",
        default="runs/bench",
        help="folder for <part>.json and <part>.png (default runs/bench)",
    )
    ap.add_argument(
        "--data",
        help="loader part: shards to read (a folder, glob or URL) in place of the config's "
        "sources (default: the config's own, or a generated LLaVA-style mix when it names "
        "none); realized part: the checkpoint's default dataset (default data/default)",
    )
    ap.add_argument(
        "--config",
        help="loader part: the run config whose data section and loader path are measured "
        "(default configs/gpu.yaml)",
    )
    ap.add_argument(
        "--tokens-per-s",
        type=float,
        help="loader part: the training rate the cores per GPU are stated at (default 100000)",
    )
    ap.add_argument(
        "--world-size",
        type=int,
        help="loader part: measure the loader of one rank of this many data-parallel ranks "
        "(default 1): per micro-batch of its own, each of which costs planning M of them",
    )
    ap.add_argument(
        "--rank",
        type=int,
        help="loader part: the rank measured, 0 .. world size - 1 (default 0)",
    )
    ap.add_argument(
        "--ckpt",
        help="realized part: a trained checkpoint (RUN_DIR/final) whose "
        "router's boundaries on its own held-out prompts are timed",
    )
    ap.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from eval.bench import common  # torch and the model: imported when a benchmark runs
    from eval.preflight import check_model_dir, check_out_dir

    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    if (problem := loader_args_problem(args)) is not None:
        print(f"vlm bench: {problem}", file=sys.stderr)
        return 2
    # before any part runs: a result that cannot be written is not measured (a part takes minutes)
    out = check_out_dir(args.out, "vlm bench")
    if args.ckpt is not None:
        check_model_dir(args.ckpt, "vlm bench")
    if args.part in GPU_PARTS and not args.smoke and not torch.cuda.is_available():
        print(
            f"vlm bench {args.part}: no CUDA device here (torch "
            f"{torch.__version__}, torch.cuda.is_available() is False); run "
            "it on a GPU machine, or add --smoke for the CPU plumbing check",
            file=sys.stderr,
        )
        return 2
    rc = 0
    t_all = time.perf_counter()
    parts = (PARTS + (CKPT_PARTS if args.ckpt else ())) if args.part == "all" else (args.part,)
    for part in parts:
        mod = importlib.import_module(f"eval.bench.{part}")
        settings = mod.SETTINGS[mode]
        if part == "loader":
            settings = replace(
                settings,
                **({"data": args.data} if args.data else {}),
                **({"config": args.config} if args.config else {}),
                **({"tokens_per_s": args.tokens_per_s} if args.tokens_per_s is not None else {}),
                **({"world_size": args.world_size} if args.world_size is not None else {}),
                **({"rank": args.rank} if args.rank is not None else {}),
            )
        if part == "realized":
            settings = replace(
                settings, ckpt=args.ckpt, **({"data": args.data} if args.data else {})
            )
        # it writes its JSON after every section, so a run stopped from outside leaves results
        if part in GPU_PARTS:
            settings = replace(settings, out=str(out))
        t0 = time.perf_counter()
        res = mod.run(settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        if res.pop("rank", 0):  # under torchrun: rank 0 reports
            continue
        res["mode"], res["wall_seconds"] = mode, round(time.perf_counter() - t0, 1)
        path = common.write_json(res, out)
        mod.plot(res, out / f"{part}.png")
        print(getattr(mod, "table", common.table)(res))
        print(f"  wrote {path} and {out / f'{part}.png'} ({res['wall_seconds']} s)\n", flush=True)
        if res.get("errors"):
            print(
                f"vlm bench {part}: {len(res['errors'])} error(s): {', '.join(res['errors'])}",
                file=sys.stderr,
            )
            rc = 1
    print(f"total {time.perf_counter() - t_all:.1f} s")
    return rc


def loader_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the loader part's numbers, in one line; None when nothing is."""
    tps = args.tokens_per_s
    if tps is not None and not (math.isfinite(tps) and tps > 0):
        return f"--tokens-per-s must be a number of tokens per second > 0, got {tps:g}"
    world = 1 if args.world_size is None else args.world_size
    if world < 1:
        return f"--world-size must be >= 1 (the number of data-parallel ranks), got {world}"
    rank = 0 if args.rank is None else args.rank
    if not 0 <= rank < world:
        return f"--rank must be in 0 .. {world - 1} (--world-size {world}), got {rank}"
    return None


def main(argv: list[str] | None = None) -> int:
    """`vlm bench ARGV...` (what `python -m eval.bench` runs)."""
    from vlm.cli import main as vlm_main

    return vlm_main(["bench", *(sys.argv[1:] if argv is None else argv)])
