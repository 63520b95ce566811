"""`vlm experiment`: recipes that reproduce the papers' findings.

Every variant of every recipe is a valid `vlm train` config that differs from its siblings only
where the recipe says; the FLOPs-matched comparisons are matched; the verdict follows the seed
spreads (holds / does not hold / inconclusive); one tiny recipe runs end to end and writes its
results, table, plot and the claims table."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from configs.config import flatten, to_dict
from eval.experiments import RECIPES, global_parser
from eval.experiments.core import (
    FAILS,
    HOLDS,
    ONE_SEED,
    UNSURE,
    Stat,
    at_most,
    better,
    no_worse,
    overall,
    stats_table,
)
from eval.experiments.report import claims_markdown, format_table
from eval.experiments.runner import estimate_s, plan


def _overrides(job) -> tuple[str, list[str]]:
    """(config path, overrides) of a planned `vlm train` command."""
    args = list(job.args)
    cfg = args[args.index("--config") + 1]
    return cfg, [a for a in args if "=" in a and not a.startswith("--")]


def _configs(name: str, tmp_path: Path) -> dict:
    """variant -> resolved TrainConfig for seed 0 (the runs it depends on faked as finished directories)."""
    from vlm.train.config import load_train_config

    recipe = RECIPES[name]()
    out = {}
    for job in plan(recipe, tmp_path, seeds=1):
        # what `after` runs leave behind
        (tmp_path / job.name / "final").mkdir(parents=True, exist_ok=True)
        cfg, overrides = _overrides(job)
        out[job.variant.name] = load_train_config(cfg, overrides)
    return out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_variant_is_a_valid_config_differing_only_where_the_recipe_says(name, tmp_path):
    recipe = RECIPES[name]()
    assert recipe.claim and recipe.source and recipe.metrics and recipe.seeds >= 2
    assert len({v.name for v in recipe.variants}) == len(recipe.variants) >= 2
    configs = _configs(name, tmp_path)
    flat = {v: flatten(to_dict(c)) for v, c in configs.items()}
    stated = {o.split("=", 1)[0] for v in recipe.variants for o in v.overrides}
    # e.g. pretraining before continual training
    if len({v.steps_mult for v in recipe.variants}) > 1:
        stated |= {"train.max_steps", "logging.eval_every"}
    keys = set().union(*flat.values())
    if any(c.model_stated is not None for c in configs.values()):
        # a variant that continues a checkpoint takes its model section from it when the model is
        # built (vlm.train.stages.merge_model_section, where a stated difference is refused):
        # compare the rest
        keys = {k for k in keys if not k.startswith("model.")}
    differing = {
        k for k in keys if len({json.dumps(f.get(k), default=str) for f in flat.values()}) > 1
    }
    assert differing, name
    # everything else equal: each difference comes from a variant's own overrides
    for k in differing:
        assert any(k == s or k.startswith(s + ".") for s in stated), (name, k)
    # the seed is the only thing that changes between the seeds of one variant
    two = plan(recipe, tmp_path, seeds=2)
    v0 = [j for j in two if j.seed == 0][0]
    v1 = [j for j in two if j.seed == 1 and j.variant.name == v0.variant.name][0]
    diff = [(a, b) for a, b in zip(v0.args, v1.args) if a != b]
    assert any(a == "train.seed=0" and b == "train.seed=1" for a, b in diff), diff
    assert all(a.startswith("train.seed=") or "-s0" in a for a, _ in diff), diff


def test_every_recipe_fits_thirty_minutes_on_two_jobs():
    for name, make in RECIPES.items():
        recipe = make()
        assert estimate_s(recipe, 2) <= 30 * 60, (name, estimate_s(recipe, 2) / 60)
        # two slots do run side by side
        assert estimate_s(recipe, 1) > estimate_s(recipe, 2) * 1.3, name


def test_the_global_parser_recipe_splits_one_global_batch_three_ways(tmp_path):
    """Same global batch as 1 micro-batch, 4 micro-batches or 2 ranks; global vs per-micro-batch statistics."""
    recipe = RECIPES["global-parser"]()
    configs = _configs("global-parser", tmp_path)
    assert (
        configs["global-4mb"].optim.grad_accum == 4
        and configs["global-2ranks"].data.rows_per_batch == 2
    )
    assert (
        configs["global-4mb"].train.global_parser and not configs["local-4mb"].train.global_parser
    )
    assert not configs["local-2ranks"].train.global_parser and global_parser.PER_BATCH.startswith(
        "train."
    )
    assert [v.ranks for v in recipe.variants if "2ranks" in v.name] == [2, 2]


def test_matched_flops_comparisons_are_matched(tmp_path):
    from vlm.model.config import ConvertConfig
    from vlm.model.convert import to_conceptmoe_config
    from vlm.model.flops import flops_per_token

    c = _configs("dynamic-vs-fixed", tmp_path / "dvf")
    f_moe = flops_per_token(c["moe"].model)["total"]
    for v in ("fixed", "dynamic"):
        assert c[v].model.chunk.enabled and c[v].model.chunk.target_ratio == 2
        assert abs(flops_per_token(c[v].model, 2.0)["total"] / f_moe - 1) < 0.03, v
    assert (
        c["fixed"].model.c_moe == c["dynamic"].model.c_moe
        and c["fixed"].model.chunk.router == "fixed"
    )
    # continual training: both conversions within a few percent of the source and of each other
    c = _configs("ct-conversion", tmp_path / "ct")
    src = c["source"].model
    f_src = flops_per_token(src)["total"]
    f = {}
    assert c["convert"].train.max_steps == 1 and c["convert"].convert.concept_top_k is None
    for v in ("topk", "loop"):
        conv = c[v].convert
        opt = ConvertConfig(
            target_ratio=conv.target_ratio, concept_top_k=conv.concept_top_k, loop=conv.loop
        )
        f[v] = flops_per_token(to_conceptmoe_config(src, opt), conv.target_ratio)["total"] / f_src
        assert abs(f[v] - 1) < 0.05, (v, f[v])
    assert (
        abs(f["topk"] - f["loop"]) < 0.01 and c["loop"].convert.loop and not c["topk"].convert.loop
    )


# ---------------------------------------------------------------- verdicts
def test_checks_follow_the_seed_spreads():
    lo, hi, mid = Stat([1.0, 1.1]), Stat([2.0, 2.2]), Stat([1.05, 2.1])
    assert better("c", "a", lo, "b", hi).status == HOLDS
    assert better("c", "a", hi, "b", lo).status == FAILS
    assert better("c", "a", lo, "b", mid).status == UNSURE
    assert better("c", "a", hi, "b", lo, lower=False).status == HOLDS
    assert better("c", "a", lo, "b", hi, lower=False).status == FAILS
    # overlapping spreads, either way
    assert better("c", "a", mid, "b", lo, lower=False).status == UNSURE
    assert better("c", "a", hi, "b", mid, lower=False).status == UNSURE
    assert better("c", "a", Stat([1.0]), "b", Stat([2.0])).status == ONE_SEED
    assert "no numbers" in better("c", "a", None, "b", lo).status
    # overlapping, mean equal
    assert no_worse("c", "a", Stat([1.0, 1.3]), "b", Stat([1.1, 1.2])).status == HOLDS
    assert no_worse("c", "a", Stat([1.1, 1.4]), "b", Stat([1.0, 1.2])).status == UNSURE
    assert no_worse("c", "a", hi, "b", lo).status == FAILS
    assert at_most("c", "g", Stat([0.01, 0.02]), 0.05).status == HOLDS
    assert at_most("c", "g", Stat([0.5, 0.6]), 0.05).status == FAILS
    assert at_most("c", "g", Stat([0.01, 0.6]), 0.05).status == UNSURE
    h, f, u = (
        better("c", "a", lo, "b", hi),
        better("c", "a", hi, "b", lo),
        better("c", "a", lo, "b", mid),
    )
    assert overall([h, h]) == HOLDS and overall([h, f]) == FAILS and overall([h, u]) == UNSURE
    f.core = False
    assert overall([h, f]) == HOLDS  # context checks do not vote


def _rows(values: dict[str, dict[str, list[float]]]) -> list[dict]:
    """Synthetic per-run rows: variant -> metric -> one value per seed."""
    rows = []
    for v, ms in values.items():
        for seed in range(len(next(iter(ms.values())))):
            rows.append({"variant": v, "seed": seed, **{k: vals[seed] for k, vals in ms.items()}})
    return rows


def _verdict(name: str, values: dict) -> tuple[str, list]:
    recipe = RECIPES[name]()
    table = stats_table(_rows(values), recipe.metrics, list(values))
    checks = recipe.verdict(table)
    return overall(checks), checks


def test_recipe_verdicts_on_synthetic_rows():
    # router: cosine clearly lower held out -> holds (the train-loss context does not vote)
    v, checks = _verdict(
        "router",
        {
            "cosine": {"val_loss": [1.00, 1.01], "train_loss": [0.90, 0.91]},
            "linear": {"val_loss": [1.05, 1.06], "train_loss": [0.88, 0.89]},
        },
    )
    assert v == HOLDS and [c.status for c in checks] == [HOLDS, HOLDS]
    # dynamic-vs-fixed: dynamic worse than both -> does not hold
    v, _ = _verdict(
        "dynamic-vs-fixed",
        {
            "moe": {"val_loss": [1.0, 1.01]},
            "fixed": {"val_loss": [1.02, 1.03]},
            "dynamic": {"val_loss": [1.10, 1.12]},
        },
    )
    assert v == FAILS
    # flip-noise: tau 6's median document drifts less but its p gap overlaps no noise's ->
    # inconclusive; the aggregate drift (the other way here) is context and does not vote
    v, checks = _verdict(
        "flip-noise",
        {
            "none": {"R_drift_doc": [0.3, 0.4], "R_drift": [0.01, 0.02], "p_gap": [0.10, 0.20]},
            "tau6": {"R_drift_doc": [0.05, 0.1], "R_drift": [0.3, 0.4], "p_gap": [0.05, 0.15]},
            "gaussian": {"R_drift_doc": [0.3, 0.4], "R_drift": [0.3, 0.4], "p_gap": [0.1, 0.2]},
            "tau4": {"R_drift_doc": [0.3, 0.4], "R_drift": [0.3, 0.4], "p_gap": [0.1, 0.2]},
        },
    )
    assert v == UNSURE and [c.status for c in checks if c.core] == [HOLDS, UNSURE]
    assert checks[1].status == FAILS and not checks[1].core
    # global-parser: judged on the median document's distance to R = 4, not on the aggregate
    near, far = (
        {"R_gap_doc": [0.1, 0.2], "R_gap": [2.0, 2.1]},
        {"R_gap_doc": [1.0, 1.2], "R_gap": [0.1, 0.2]},
    )
    v, _ = _verdict(
        "global-parser",
        {"global-4mb": near, "local-4mb": far, "global-2ranks": near, "local-2ranks": far},
    )
    assert v == HOLDS
    # image-compression: images more compressed than text in the median chat and caption documents
    row = {
        "chat_image_p50": [3.0, 3.2],
        "chat_text_p50": [1.5, 1.6],
        "caption_image_p50": [4.0, 4.1],
        "caption_text_p50": [2.0, 2.1],
        "eval_R_image": [1.0, 1.1],
        "eval_R_text": [2.0, 2.1],
        "vqa": [40.0, 41.0],
        "blind": [30.0, 31.0],
    }
    v, checks = _verdict(
        "image-compression",
        {
            "trained-joint-grid_off": row,
            "trained-per_modality-grid_off": row,
            "frozen-per_modality-grid_off": row,
        },
    )
    assert v == HOLDS and [c.status for c in checks][:3] == [HOLDS, HOLDS, FAILS]
    # ct-conversion: three claims, one row each in claims.md
    v, checks = _verdict(
        "ct-conversion",
        {
            "moe": {"val_loss": [1.00, 1.01]},
            "convert": {"step0_gap": [0.5, 0.6]},
            "topk": {"step0_gap": [0.5, 0.6], "val_loss": [1.00, 1.02]},
            "loop": {"val_loss": [0.95, 0.96]},
        },
    )
    assert [c.status for c in checks] == [FAILS, FAILS, HOLDS, UNSURE] and v == FAILS
    md = claims_markdown(
        [
            {
                "recipe": "ct-conversion",
                "source": "ConceptMoE 4.3",
                "steps": 10,
                "seeds": 2,
                "checks": [c.to_json() for c in checks],
            }
        ],
        {"global-parser": "no switch"},
    )
    assert (
        md.count("\n| **ct-conversion**") == 3
        and "| **global-parser** | not run: no switch | - |" in md
    )
    # a recipe run with --only: the checks on variants it did not run say so instead of failing
    v, checks = _verdict(
        "image-compression",
        {
            "trained-joint-grid_off": {
                "chat_image_p50": [3.0, 3.2],
                "chat_text_p50": [1.9, 2.0],
                "caption_image_p50": [3.0, 3.2],
                "caption_text_p50": [1.9, 2.0],
            }
        },
    )
    assert checks[0].status == HOLDS and "no numbers" in checks[3].status and v == checks[3].status


# ---------------------------------------------------------------- running
def test_bad_input_is_a_clear_error(tmp_path, capsys):
    from vlm.cli import main

    assert main(["experiment", "no-such-recipe"]) == 2
    assert "unknown recipe 'no-such-recipe'" in capsys.readouterr().err
    assert main(["experiment", "router", "--jobs", "0", "--out", str(tmp_path)]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
    assert main(["experiment", "router", "--only", "cosin", "--out", str(tmp_path)]) == 2
    assert "no variant cosin; its variants: cosine, linear" in capsys.readouterr().err


def test_list_names_every_recipe_with_runs_steps_and_time(capsys):
    from vlm.cli import main

    assert main(["experiment", "--list"]) == 0
    out = capsys.readouterr().out
    for name in RECIPES:
        assert f"\n{name} (" in "\n" + out, name
    assert "ct-conversion" in out and "runs x 2000 steps +" in out and "min with --jobs 2" in out


@pytest.mark.slow
def test_a_tiny_recipe_runs_end_to_end(tiny_data, tmp_path, monkeypatch, capsys):
    """joint-decoding, 2 variants x 2 seeds x 2 steps on the tiny dataset, through `vlm experiment --all`."""
    from eval.experiments import registry
    from vlm.cli import main

    monkeypatch.setattr(registry, "RECIPES", {"joint-decoding": RECIPES["joint-decoding"]})
    out = tmp_path / "exp"
    args = [
        "experiment",
        "--all",
        "--out",
        str(out),
        "--steps",
        "2",
        "--seeds",
        "2",
        "--jobs",
        "2",
        f"data.default_dir={tiny_data}",
        "logging.eval_batches=1",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    d = out / "joint-decoding"
    result = json.loads((d / "results.json").read_text())
    assert result["verdict"] in (HOLDS, FAILS, UNSURE)
    assert result["steps"] == 2 and result["seeds"] == 2
    assert [(r["variant"], r["seed"]) for r in result["rows"]] == [
        ("joint", 0),
        ("none", 0),
        ("joint", 1),
        ("none", 1),
    ]
    for r in result["rows"]:  # every number comes from its own run directory, trained as asked
        assert r["steps"] == 2 and r["val_loss"] > 0 and Path(r["run"]).is_dir()
        cmd = json.loads((d / f"{r['variant']}-s{r['seed']}.json").read_text())["command"]
        assert f"train.seed={r['seed']}" in cmd and "train.max_steps=2" in cmd
    joint = result["table"]["joint"]["val_loss"]
    assert joint["n"] == 2 and joint["min"] <= joint["mean"] <= joint["max"]
    assert (d / "results.png").stat().st_size > 10_000
    table = (d / "results.txt").read_text()
    assert table == format_table(result) + "\n" and table in printed and "verdict: " in table
    claims = (out / "claims.md").read_text()
    assert claims.startswith("| claim | measured | holds? |") and "**joint-decoding**" in claims
    # again: the finished runs are reused (no training), and other settings for the same runs
    # are refused
    assert main(args) == 0
    assert "reusing 4 finished run(s)" in capsys.readouterr().out
    assert main([*args[:-1], "logging.eval_batches=2"]) == 1
    assert "trained with other settings" in capsys.readouterr().out
    print(shlex.join(args))
