"""`vlm scaling fit RUN_DIR... [--out DIR] [--budget FLOPS --tokens D]`: DLCM's compression-aware
scaling law.

DLCM eq. 22 (section 6.2):

    L(N, D, R, P) = E0 + A_tok / (N (1 - P) + t_tok)^d1 + A_con R^g / (N P + t_con)^d2 + A_dat / (D + t_dat)^a

N: non-embedding parameters, D: training tokens, R: compression ratio (tokens per concept), P: share
of N in the concept model. Each finished run gives one point (N and P from its config, D from its
metrics, R its realized training ratio, L its last held-out LM loss). The fit prints the constants
with R^2 and RMSE, draws predicted against observed loss, and, under a FLOPs budget C = 6 D N (1 - P
+ P / R) (the concept model runs on D / R positions), the R and P that minimise the predicted loss.

`vlm scaling sweep` (eval/scaling_sweep.py) trains the grid of small runs this fit needs,
then fits it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

NAMES = ("E0", "A_tok", "t_tok", "d1", "A_con", "gamma", "t_con", "d2", "A_dat", "t_dat", "alpha")


@dataclass
class Point:
    N: float
    D: float
    R: float
    P: float
    L: float


def law(c: dict[str, float], N, D, R, P):
    """DLCM eq. 22."""
    N, D, R, P = (np.asarray(v, dtype=float) for v in (N, D, R, P))
    return (
        c["E0"]
        + c["A_tok"] / (N * (1 - P) + c["t_tok"]) ** c["d1"]
        + c["A_con"] * R ** c["gamma"] / (N * P + c["t_con"]) ** c["d2"]
        + c["A_dat"] / (D + c["t_dat"]) ** c["alpha"]
    )


def _unpack(theta: np.ndarray) -> dict[str, float]:
    """Fit space -> constants: amplitudes and offsets as logs (positive), exponents as they are."""
    e0, la_t, lt_t, d1, la_c, g, lt_c, d2, la_d, lt_d, a = theta
    return {
        "E0": e0,
        "A_tok": np.exp(la_t),
        "t_tok": np.exp(lt_t),
        "d1": d1,
        "A_con": np.exp(la_c),
        "gamma": g,
        "t_con": np.exp(lt_c),
        "d2": d2,
        "A_dat": np.exp(la_d),
        "t_dat": np.exp(lt_d),
        "alpha": a,
    }


def fit(points: list[Point], starts: int = 24, seed: int = 0) -> dict:
    """Least squares from several starts (the law is not convex); the constants, R^2 and RMSE of the best."""
    from scipy.optimize import least_squares

    if len(points) < len(NAMES):
        raise ValueError(
            f"the law has {len(NAMES)} constants: fit it to "
            f"at least {len(NAMES)} runs, got {len(points)}"
        )
    arr = {k: np.array([getattr(p, k) for p in points], dtype=float) for k in "NDRPL"}
    rng = np.random.default_rng(seed)
    lo = np.array([0.0, -5, -5, 0.05, -5, -1.0, -5, 0.05, -5, -5, 0.05])
    hi = np.array([arr["L"].min(), 15, 15, 1.5, 15, 2.0, 15, 1.5, 15, 25, 1.5])

    def residual(theta):
        return law(_unpack(theta), arr["N"], arr["D"], arr["R"], arr["P"]) - arr["L"]

    best = None
    for _ in range(starts):
        x0 = lo + (hi - lo) * rng.uniform(0.2, 0.8, size=len(lo))
        sol = least_squares(residual, x0, bounds=(lo, hi), x_scale="jac", max_nfev=4000)
        if best is None or sol.cost < best.cost:
            best = sol
    c = _unpack(best.x)
    pred = law(c, arr["N"], arr["D"], arr["R"], arr["P"])
    ss_res = float(((pred - arr["L"]) ** 2).sum())
    ss_tot = float(((arr["L"] - arr["L"].mean()) ** 2).sum())
    return {
        "constants": {k: float(v) for k, v in c.items()},
        "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "rmse": (ss_res / len(points)) ** 0.5,
        "points": len(points),
    }


def train_flops(N, D, R, P):
    """Training FLOPs C = 6 D N (1 - P + P / R): the concept model's share of N runs on D / R positions."""
    N, D, R, P = (np.asarray(v, dtype=float) for v in (N, D, R, P))
    return 6.0 * D * N * (1 - P + P / R)


def best_allocation(
    c: dict[str, float],
    budget: float,
    tokens: float,
    ratios=np.linspace(1.25, 8, 55),
    shares=np.linspace(0.05, 0.95, 91),
) -> dict:
    """The (R, P) with the lowest predicted loss when C = 6 D N (1 - P + P / R) is fixed (N follows)."""
    R, P = np.meshgrid(ratios, shares, indexing="ij")
    N = budget / train_flops(1.0, tokens, R, P)
    L = law(c, N, tokens, R, P)
    i = np.unravel_index(np.argmin(L), L.shape)
    return {"R": float(R[i]), "P": float(P[i]), "N": float(N[i]), "loss": float(L[i])}


def run_point(run_dir: str | Path) -> Point:
    """One run's point: N and P from its config (non-embedding), D from its metrics, R and L from its end."""
    from vlm.model.flops import count_params
    from vlm.train.config import load_train_config
    from vlm.train.metrics_sinks import read_metrics

    run_dir = Path(run_dir)
    cfg = load_train_config(run_dir / "config.yaml").model
    counts = count_params(cfg)
    recs = read_metrics(run_dir / "metrics.jsonl")
    if not recs:
        raise ValueError(f"{run_dir}: no metrics")
    tail = recs[-max(len(recs) // 10, 1) :]
    ratios = [r["compression/ratio"] for r in tail if r.get("compression/ratio")]
    val = [r["val/loss/lm"] for r in recs if r.get("val/loss/lm") is not None]
    N = float(counts["total"] - counts.get("embedding", 0))
    concept = float(counts.get("concept", 0))
    return Point(
        N=N,
        D=float(sum(r.get("tokens", 0) for r in recs)),
        R=float(np.mean(ratios)) if ratios else 1.0,
        P=concept / N if N else 0.0,
        L=float(val[-1] if val else tail[-1]["loss/lm"]),
    )


def plot(points: list[Point], c: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    obs = np.array([p.L for p in points])
    pred = law(
        c,
        [p.N for p in points],
        [p.D for p in points],
        [p.R for p in points],
        [p.P for p in points],
    )
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    sc = ax.scatter(obs, pred, c=[p.R for p in points], cmap="viridis")
    lims = [min(obs.min(), pred.min()), max(obs.max(), pred.max())]
    ax.plot(lims, lims, color="gray", lw=0.8)
    ax.set_xlabel("observed loss"), ax.set_ylabel("DLCM eq. 22 prediction")
    fig.colorbar(sc, label="R (tokens per concept)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def median_budget(points: list[Point]) -> tuple[float, float]:
    """The training FLOPs and tokens of the run whose FLOPs are the (lower) median of the runs'."""
    flops = sorted((float(train_flops(p.N, p.D, p.R, p.P)), p.D) for p in points)
    return flops[(len(flops) - 1) // 2]


def add_scaling_command(sub) -> None:
    from eval.scaling_sweep import add_sweep_arguments

    p = sub.add_parser("scaling", help="DLCM's compression-aware scaling law over finished runs")
    s = p.add_subparsers(dest="scaling_command", required=True)
    f = s.add_parser(
        "fit", help="fit L(N, D, R, P) (DLCM eq. 22) to the runs; best R, P under a FLOPs budget"
    )
    f.add_argument("runs", nargs="+", help="finished run directories (config.yaml + metrics.jsonl)")
    f.add_argument("--out", default=None, help="write fit.json and fit.png here")
    f.add_argument(
        "--budget", type=float, default=None, help="training FLOPs budget for the best (R, P)"
    )
    f.add_argument(
        "--tokens",
        type=float,
        default=None,
        help="training tokens D for the budget (default: the runs' largest)",
    )
    f.set_defaults(func=_run)
    w = s.add_parser(
        "sweep",
        help="train the grid of small text runs the law needs (N, D, R, P varied), then fit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_sweep_arguments(w)
    w.set_defaults(func=_sweep)


def report(
    points: list[Point],
    out: Path | None,
    budget: float | None,
    tokens: float | None,
    what: str = "vlm scaling fit",
    log=print,
) -> dict:
    """Fit the points, print the constants with R^2 and RMSE (and the best R, P under `budget` at
    `tokens`, default: the runs' largest D), write OUT/fit.json and OUT/fit.png; too few points are
    a one-line error."""
    from configs.config import ConfigError

    try:
        res = fit(points)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None
    log(
        f"DLCM eq. 22 fitted to {res['points']} runs: R^2 "
        f"= {res['r2']:.4f}, RMSE = {res['rmse']:.4f}"
    )
    for k, v in res["constants"].items():
        log(f"  {k:<6} {v:.5g}")
    if budget:
        tokens = tokens or max(p.D for p in points)
        res["best"] = b = {
            **best_allocation(res["constants"], budget, tokens),
            "budget": budget,
            "tokens": tokens,
        }
        log(
            f"under {budget:.3g} FLOPs at {tokens:.3g} tokens: R = {b['R']:.2f}, "
            f"P = {b['P']:.2f} (N = {b['N']:.3g}), predicted loss {b['loss']:.4f}"
        )
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fit.json").write_text(
            json.dumps({**res, "runs": [asdict(p) for p in points]}, indent=1)
        )
        plot(points, res["constants"], out / "fit.png")
        log(f"wrote {out / 'fit.json'} and {out / 'fit.png'}")
    return res


def _run(args: argparse.Namespace) -> int:
    from configs.config import ConfigError
    from eval.preflight import check_out_dir

    if args.out:  # before the fit: a file named as --out is one line
        check_out_dir(args.out, "vlm scaling fit")
    try:
        points = [run_point(r) for r in args.runs]
    except (OSError, ValueError, KeyError) as e:  # a run that is not finished: one line
        raise ConfigError(f"vlm scaling fit: {e}") from None
    report(points, args.out, args.budget, args.tokens)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """`vlm scaling sweep`: train the grid (eval/scaling_sweep.py), then fit all of its runs."""
    from configs.config import ConfigError
    from eval.scaling_sweep import train_sweep

    trained = train_sweep(args)
    if trained is None:  # --dry-run
        return 0
    runs, failed = trained
    if failed:
        print(f"vlm scaling sweep: runs failed: {', '.join(failed)} (see {args.out}/<run>.log)")
        return 1
    try:
        points = [run_point(r) for r in runs]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"vlm scaling sweep: {e}") from None
    (Path(args.out) / "points.json").write_text(
        json.dumps({r.name: asdict(p) for r, p in zip(runs, points)}, indent=1)
    )
    budget, tokens = (args.budget, None) if args.budget else median_budget(points)
    report(points, args.out, budget, tokens, what="vlm scaling sweep")
    return 0
