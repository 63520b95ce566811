"""DLCM's compression-aware scaling law (eq. 22): the fit recovers known constants; runs become points."""
import json

import pytest

from eval.scaling import Point, best_allocation, fit, law, run_point

TRUE = {"E0": 1.2, "A_tok": 40.0, "t_tok": 1e3, "d1": 0.35, "A_con": 25.0, "gamma": 0.3, "t_con": 1e3, "d2": 0.3,
        "A_dat": 300.0, "t_dat": 1e6, "alpha": 0.3}


def test_fit_recovers_the_constants_of_synthetic_summaries():
    pts = [Point(N, D, R, P, float(law(TRUE, N, D, R, P)))
           for N in (1e6, 1e7, 3e7) for D in (1e8, 3e8, 1e9, 3e9) for R in (2, 4, 8) for P in (0.3, 0.7)]
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


def test_a_finished_run_becomes_a_point(tiny_data, tiny_config, make_trainer, tmp_path, torch_globals):
    run = tmp_path / "run"
    assert make_trainer(tiny_config(tiny_data), run).train() == 0
    p = run_point(run)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert p.D == sum(r["tokens"] for r in recs) and p.N > 0 and 0 < p.P < 1 and p.R >= 1 and p.L > 0


def test_the_command_refuses_too_few_runs_in_one_line(tmp_path, subprocess_env):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "vlm.cli", "scaling", "fit", str(tmp_path / "missing")],
                       capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "vlm scaling fit" in r.stderr
