"""`vlm scaling sweep [--out DIR] [--jobs J] [--budget-minutes M] [--dry-run] [key=value ...]`: the
small runs that DLCM's compression-aware scaling law (eq. 22, eval/scaling.py) is fitted to. They
are text-only ConceptMoE runs of configs/experiment_text.yaml, trained by the experiment runner
(eval/experiments/runner.py: one `vlm train` per run, finished runs reused). The command, registered
in eval/scaling.py, then fits the law to all of them as `vlm scaling fit` does (DIR/fit.json,
DIR/fit.png, the best R and P under the median run's FLOPs).

The grid has 18 runs instead of the 108 of a full factorial. It varies the law's four variables:
  N  width 48 / 64 / 96 (16-wide heads, experts as wide as the model), times the concept depth below;
  P  1 / 2 / 4 concept layers between one encoder and one decoder layer (P ~ 0.27 / 0.44 / 0.61);
  D  S / 2S / 4S optimizer steps of 4 x 256 tokens, with S the largest that fits the sweep in --budget-minutes;
  R  model.chunk.target_ratio 1.5 / 2 / 3 / 4 (the fit reads the ratio each run realized).
Each (width, depth) pair is trained twice. The two runs of a pair take different step counts (a
Latin square: every width and every depth meets every step count twice) and different ratios (R
level = width level + 2 depth level + 3 replicate, mod 4). No two of the four level columns are
correlated, so the fit can tell the variables apart (N itself grows with the concept depth, so N and
P are correlated at about 0.5). The time estimate is the runner's: its calibrated seconds per step
of the text config, two runs side by side, times step_cost(width, depth).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from configs.config import ConfigError
from eval.experiments.core import Recipe, Variant, configs_dir
from eval.experiments.text import HELD_OUT, TEXT_CONFIG

WIDTHS = (48, 64, 96)
CONCEPT_LAYERS = (1, 2, 4)
RATIOS = (1.5, 2.0, 3.0, 4.0)
STEPS_MULT = (1, 2, 4)
COMMON = ["model.encoder_layers=1", "model.decoder_layers=1", "model.head_dim=16"]


def step_cost(width: int, concept_layers: int) -> float:
    """Seconds per step relative to the text config (width 64, 1 + 2 + 1 layers). The formula was
    fitted to 40-step runs of all nine (width, depth) pairs (R = 2, one thread, 2-core machine): t =
    0.0355 + 0.0083 (2 + c) (w / 64)^1.45 s, which gives 0.052 s at (48, 1), 0.069 at (64, 2), 0.125
    at (96, 4)."""

    def t(w: int, c: int) -> float:
        return 0.0355 + 0.0083 * (2 + c) * (w / 64) ** 1.45

    return t(width, concept_layers) / t(64, 2)


def grid() -> list[Variant]:
    """The 18 runs (see the module docstring), longest first so that the job slots finish together."""
    runs = []
    for i, width in enumerate(WIDTHS):
        for j, layers in enumerate(CONCEPT_LAYERS):
            for k in range(2):
                mult = STEPS_MULT[(i + j + k) % 3]
                ratio = RATIOS[(i + 2 * j + 3 * k) % 4]
                heads = width // 16
                overrides = [
                    f"model.hidden_size={width}",
                    f"model.num_heads={heads}",
                    f"model.num_kv_heads={2 if heads % 2 == 0 else 1}",
                    f"model.moe.expert_hidden={width}",
                    f"model.concept_layers={layers}",
                    f"model.chunk.target_ratio={ratio:g}",
                ]
                runs.append(
                    Variant(
                        f"w{width}-c{layers}-r{ratio:g}-x{mult}",
                        overrides,
                        {
                            "width": str(width),
                            "concept_layers": str(layers),
                            "R": f"{ratio:g}",
                            "steps": f"{mult}S",
                        },
                        steps_mult=mult,
                        cost=step_cost(width, layers),
                    )
                )
    return sorted(runs, key=lambda v: -v.steps_mult * v.cost)


def recipe(steps: int, runs: int | None = None) -> Recipe:
    """The sweep as an experiment-runner recipe: one seed, S = `steps`; `runs` keeps the first runs (tests)."""
    return Recipe(
        "scaling-sweep",
        "DLCM 6.2",
        "L(N, D, R, P) follows eq. 22",
        TEXT_CONFIG,
        grid()[:runs],
        [],
        lambda run, same_seed: {},
        lambda table: [],
        steps=steps,
        held_out=HELD_OUT,
        seeds=1,
        common=list(COMMON),
    )


def base_steps(budget_s: float, jobs: int) -> int:
    """The largest S (a multiple of 10 from 100 up) whose sweep the runner's estimate fits within `budget_s`."""
    from eval.experiments.runner import estimate_s

    def fits(s: int) -> bool:
        return estimate_s(recipe(s), jobs) <= budget_s

    if not fits(1):
        raise ConfigError(
            f"--budget-minutes {budget_s / 60:g}: even 1-step runs need "
            f"~{estimate_s(recipe(1), jobs) / 60:.1f} min with --jobs {jobs} ({len(grid())} runs)"
        )
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo // 10 * 10 if lo >= 100 else lo


def describe(jobs, extra: list[str]) -> list[dict]:
    """Each planned run's N, P (from its validated config), D (its planned tokens), target R and own overrides."""
    from vlm.model.flops import count_params
    from vlm.train.config import load_train_config

    rows = []
    for job in jobs:
        cfg = load_train_config(
            configs_dir() / TEXT_CONFIG, [*COMMON, *job.variant.overrides, *extra]
        )
        counts = count_params(cfg.model)
        n = counts["total"] - counts["embedding"]
        rows.append(
            {
                "name": job.name,
                "N": n,
                "P": counts["concept"] / n,
                "steps": job.steps,
                "D": job.steps
                * cfg.data.rows_per_batch
                * cfg.data.row_tokens
                * cfg.optim.grad_accum,
                "R": cfg.model.chunk.target_ratio,
                "overrides": job.variant.overrides,
            }
        )
    return rows


def format_plan(rows: list[dict]) -> str:
    lines = [f"{'run':<20} {'N':>9} {'P':>5} {'D':>9} {'R':>4}  overrides"]
    for r in rows:
        lines.append(
            f"{r['name']:<20} {r['N']:>9.3g} {r['P']:>5.2f} {r['D']:>9.3g} {r['R']:>4g}  "
            f"{' '.join(o.removeprefix('model.') for o in r['overrides'])}"
        )
    return "\n".join(lines)


DEFAULT_BUDGET_MIN = 50.0


def add_sweep_arguments(p) -> None:
    p.description = __doc__.split("\n\n")[1]
    p.add_argument(
        "--out",
        default="runs/scaling",
        help="runs, points.json, fit.json and fit.png (default: runs/scaling)",
    )
    p.add_argument(
        "--jobs", type=int, default=2, help="job slots, one torch thread each (default 2)"
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=DEFAULT_BUDGET_MIN,
        help="wall-clock budget; S is the most steps whose estimated sweep fits it "
        f"(default {DEFAULT_BUDGET_MIN:g}: the hour with a margin for the estimate's error)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="FLOPs budget for the best (R, P) (default: "
        "the median run's training FLOPs, at its tokens)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the planned runs and the time estimate only"
    )
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)  # tests: S itself
    # tests: the first runs only
    p.add_argument("--runs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides applied to every run"
    )


def train_sweep(args: argparse.Namespace) -> tuple[list[Path], list[str]] | None:
    """Print the plan and its estimate; unless --dry-run (None), train the runs that are not
    finished yet and return every run directory and the names of the runs that failed."""
    from eval.experiments.runner import estimate_s, plan, run_jobs

    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    if not args.budget_minutes > 0:
        raise ConfigError(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    steps = args.steps or base_steps(args.budget_minutes * 60, args.jobs)
    rec = recipe(steps, args.runs)
    out = Path(args.out)
    if not args.dry_run:  # before the first run trains
        from eval.preflight import check_out_dir

        check_out_dir(out, "vlm scaling sweep")
    jobs = plan(rec, out, extra=list(args.overrides))
    rows = describe(jobs, list(args.overrides))  # validates every run's config once
    print(format_plan(rows))
    mults = sorted({v.steps_mult for v in rec.variants})
    print(
        f"{len(jobs)} runs of {' / '.join(f'{round(steps * m)}' for m in mults)} "
        f"steps (S = {steps}); estimated {estimate_s(rec, args.jobs) / 60:.0f} "
        f"min with --jobs {args.jobs} (from the runner's step timings)"
    )
    own_data = not any(
        o.split("=", 1)[0] in ("data.default_dir", "data.sources") for o in args.overrides
    )
    docs = text_docs_for(max(r["D"] for r in rows))
    if own_data:
        print(
            f"data: {docs} fresh text documents in {out / 'data'}, so that the "
            "longest run reads each token at most once (eq. 22's data term "
            "assumes fresh tokens; the embedded text split is ~156k tokens)"
        )
    if args.dry_run:
        return None
    if own_data:
        from data_pipelines.default_dataset import DefaultDatasetConfig, ensure_default_dataset

        ensure_default_dataset(
            out / "data",
            DefaultDatasetConfig(
                train_scenes=0, val_scenes=0, test_scenes=0, interleaved_docs=0, text_docs=docs
            ),
        )
        jobs = plan(rec, out, extra=[*args.overrides, f"data.default_dir={out / 'data'}"])
    failed = run_jobs(jobs, out, args.jobs)
    return [out / j.name for j in jobs], failed


def text_docs_for(tokens: float) -> int:
    """Text documents of the default corpus that hold `tokens` training tokens: a document is ~265
    bytes and the corpus's own BPE covers ~3.65 bytes per token (measured), so 4.5 over-provisions
    by a fifth (val gets a tenth more)."""
    return int(tokens * 4.5 / 265) + 1
