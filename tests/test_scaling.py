"""DLCM's compression-aware scaling law (eq. 22): the fit recovers known constants; runs become points."""

import json

import numpy as np
import pytest

from eval.scaling import Point, best_allocation, fit, law, run_point

TRUE = {
    "E0": 1.2,
    "A_tok": 40.0,
    "t_tok": 1e3,
    "d1": 0.35,
    "A_con": 25.0,
    "gamma": 0.3,
    "t_con": 1e3,
    "d2": 0.3,
    "A_dat": 300.0,
    "t_dat": 1e6,
    "alpha": 0.3,
}


def test_fit_recovers_the_constants_of_synthetic_summaries():
    pts = [
        Point(N, D, R, P, float(law(TRUE, N, D, R, P)))
        for N in (1e6, 1e7, 3e7)
        for D in (1e8, 3e8, 1e9, 3e9)
        for R in (2, 4, 8)
        for P in (0.3, 0.7)
    ]
    res = fit(pts)
    assert res["r2"] > 0.9999 and res["rmse"] < 1e-6
    for k, v in TRUE.items():
        assert res["constants"][k] == pytest.approx(v, rel=1e-3), k


def test_best_allocation_spends_a_fixed_budget_where_the_law_is_lowest():
    best = best_allocation(TRUE, 1e17, 1e9)
    # no other point of a coarse grid under the same budget predicts a lower loss
    for R in (1.5, 2, 4, 8):
        for P in (0.2, 0.5, 0.8):
            N = 1e17 / (6 * 1e9 * (1 - P + P / R))
            assert law(TRUE, N, 1e9, R, P) >= best["loss"] - 1e-9


def test_too_few_runs_are_refused():
    with pytest.raises(ValueError, match="at least 11 runs"):
        fit([Point(1e6, 1e8, 2, 0.5, 3.0)] * 5)


def test_a_finished_run_becomes_a_point(
    tiny_data, tiny_config, make_trainer, tmp_path, torch_globals
):
    run = tmp_path / "run"
    assert make_trainer(tiny_config(tiny_data), run).train() == 0
    p = run_point(run)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert (
        p.D == sum(r["tokens"] for r in recs) and p.N > 0 and 0 < p.P < 1 and p.R >= 1 and p.L > 0
    )


def test_the_command_refuses_too_few_runs_in_one_line(tmp_path, subprocess_env):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "vlm.cli", "scaling", "fit", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "vlm scaling fit" in r.stderr


# `vlm scaling sweep`: the grid of small text runs the law is fitted to (eval/scaling_sweep.py)


def _planned(tmp_path):
    from eval.experiments.runner import plan
    from eval.scaling_sweep import DEFAULT_BUDGET_MIN, base_steps, recipe

    rec = recipe(base_steps(DEFAULT_BUDGET_MIN * 60, 2))
    return rec, plan(rec, tmp_path)


def test_the_sweep_varies_N_D_R_P_together_and_fits_an_hour_on_two_jobs(tmp_path):
    from eval.experiments.runner import estimate_s
    from eval.scaling_sweep import describe, recipe
    from vlm.train.config import load_train_config

    rec, jobs = _planned(tmp_path)
    assert len(jobs) >= 12 and len({j.name for j in jobs}) == len(jobs)
    for job in jobs:  # every run is a valid `vlm train` config
        args = list(job.args)
        load_train_config(
            args[args.index("--config") + 1],
            [a for a in args if "=" in a and not a.startswith("--")],
        )
    rows = describe(jobs, [])
    assert [r["name"] for r in rows] == [j.name for j in jobs]
    assert all(r["D"] == r["steps"] * 4 * 256 for r in rows)
    levels = {k: {round(r[k], 6) for r in rows} for k in "NDRP"}
    assert all(len(v) >= 2 for v in levels.values()), levels
    assert levels["R"] == {1.5, 2.0, 3.0, 4.0} and len(levels["D"]) == 3
    # designed, not one variable at a time: at every D and every R, the other three variables vary;
    # every model (N, P) is trained at two step counts and two ratios
    for k, others in (("D", "NRP"), ("R", "NDP"), ("N", "DR"), ("P", "DR")):
        for level in levels[k]:
            mine = [r for r in rows if round(r[k], 6) == level]
            assert all(len({r[o] for r in mine}) >= 2 for o in others), (k, level)
    X = np.array([[np.log(r["N"]), r["P"], np.log(r["D"]), np.log(r["R"])] for r in rows])
    # D and R are uncorrelated with everything else (N and P share the concept depth)
    corr = np.corrcoef(X.T)
    assert all(abs(corr[i, j]) < 0.05 for i in (2, 3) for j in range(4) if i != j), corr
    # S is the most the default budget (50 min, inside the hour) holds on 2 jobs, not far below it;
    # 2 jobs do run side by side
    assert 40 * 60 < estimate_s(rec, 2) <= 50 * 60
    assert estimate_s(recipe(rec.steps * 2), 2) > 50 * 60
    assert estimate_s(rec, 1) > 1.5 * estimate_s(rec, 2)


def test_the_grid_identifies_the_compression_exponent_and_reports_a_budget(tmp_path, capsys):
    """Losses from known constants at the grid's (N, D, R, P): the fit reproduces them and recovers
    the concept term (R and P vary independently of N and D); the report writes fit.json, fit.png
    and the best R, P under the median run's FLOPs."""
    from eval.scaling import median_budget, report, train_flops
    from eval.scaling_sweep import describe

    rows = describe(_planned(tmp_path)[1], [])
    pts = [
        Point(r["N"], r["D"], r["R"], r["P"], float(law(TRUE, r["N"], r["D"], r["R"], r["P"])))
        for r in rows
    ]
    budget, tokens = median_budget(pts)
    flops = sorted(float(train_flops(p.N, p.D, p.R, p.P)) for p in pts)
    assert budget == flops[(len(flops) - 1) // 2] and tokens in {p.D for p in pts}
    res = report(pts, tmp_path / "fit", budget, tokens, what="vlm scaling sweep")
    assert res["r2"] > 0.9999
    for k in ("gamma", "d2", "A_con", "t_con"):
        assert res["constants"][k] == pytest.approx(TRUE[k], rel=1e-2), k
    saved = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert saved["best"]["budget"] == budget and len(saved["runs"]) == len(pts)
    assert (tmp_path / "fit" / "fit.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert (
        f"fitted to {len(pts)} runs: R^2 = " in out
        and "  gamma " in out
        and f"under {budget:.3g} FLOPs" in out
    )


def test_the_dry_run_lists_the_runs_and_the_estimate_and_trains_nothing(tmp_path, capsys):
    from vlm.cli import main

    out = tmp_path / "sweep"
    assert main(["scaling", "sweep", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    _, jobs = _planned(out)
    for j in jobs:
        line = next(x for x in printed.splitlines() if x.startswith(j.name + " "))
        assert (
            "hidden_size=" in line and "concept_layers=" in line and "chunk.target_ratio=" in line
        )
    assert f"{len(jobs)} runs of " in printed and "min with --jobs 2" in printed
    assert not out.exists()


def test_the_sweep_trains_on_fresh_text_enough_for_its_longest_run():
    """Eq. 22's data term assumes fresh tokens: the sweep's own corpus holds more tokens than its
    longest run reads (~265 bytes a document, ~3.65 bytes a token with the corpus's BPE)."""
    from eval.scaling_sweep import text_docs_for

    for tokens in (1e5, 3.7e6):
        assert text_docs_for(tokens) * 265 / 3.65 > 1.1 * tokens


def test_bad_sweep_input_is_a_clear_error(tmp_path, capsys):
    from vlm.cli import main

    assert main(["scaling", "sweep", "--jobs", "0", "--out", str(tmp_path)]) == 2
    assert "--jobs must be >= 1, got 0" in capsys.readouterr().err
    assert (
        main(["scaling", "sweep", "--budget-minutes", "1", "--dry-run", "--out", str(tmp_path)])
        == 2
    )
    assert "--budget-minutes 1: even 1-step runs need" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_sweep_trains_its_runs_then_reaches_the_fit(tiny_data, tmp_path, capsys):
    """3 runs of 4 steps on the tiny dataset: they train through the experiment runner, become
    points, and the fit refuses too few of them in one line; a second call reuses the runs."""
    from vlm.cli import main

    out = tmp_path / "sweep"
    args = [
        "scaling",
        "sweep",
        "--out",
        str(out),
        "--jobs",
        "2",
        "--steps",
        "1",
        "--runs",
        "3",
        f"data.default_dir={tiny_data}",
        "logging.eval_batches=1",
    ]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert (
        "vlm scaling sweep: the law has 11 constants: fit it to at least 11 runs, got 3"
        in captured.err
    )
    assert "Traceback" not in captured.err and "3 runs of 4 steps (S = 1)" in captured.out
    points = json.loads((out / "points.json").read_text())
    assert len(points) == 3
    for name, p in points.items():
        cmd = json.loads((out / f"{name}.json").read_text())["args"]
        steps = int(next(a for a in cmd if a.startswith("train.max_steps=")).split("=")[1])
        recs = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert (
            steps == len(recs) == 4
            and p["D"] == sum(r["tokens"] for r in recs) > 0.9 * steps * 4 * 256
        )
        assert (
            p["L"] > 0
            and p["R"] >= 1
            and 0 < p["P"] < 1
            and (out / name / "summary.json").is_file()
        )
    assert main(args) == 2
    assert "reusing 3 finished run(s)" in capsys.readouterr().out
