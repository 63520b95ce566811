"""Long-context harness: sizing, depth, scoring, sweep, CLI (all with test doubles; no checkpoint)."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from configs.config import ConfigError
from eval.longctx.config import LongCtxConfig
from eval.longctx.haystack import Haystack
from eval.longctx.scoring import rank_credit, string_match_all, string_match_part
from eval.longctx.sizing import SizingError, fit_to_length
from eval.longctx.sweep import run_sweep
from eval.longctx.tasks import TASKS, generate_sample
from eval.protocol import EvalModel
from eval.testing import ByteTokenizer, OracleEvalModel, WordTokenizer

ALL_TASKS = list(TASKS)
NEEDLE_TASKS = [t for t, d in TASKS.items() if d.has_depth]


def _strip(text: str, inserted: list[str]) -> str:
    for t in inserted:
        text = text.replace(t, "")
    return " ".join(text.split())


# ---- sizing
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tok_cls,lengths", [(ByteTokenizer, [2048, 6000]), (WordTokenizer, [1024, 3000])]
)
@pytest.mark.parametrize("task", ALL_TASKS)
def test_samples_hit_target_length(task, tok_cls, lengths):
    tok = tok_cls()
    for target in lengths:
        s = generate_sample(task, tok, target, depth=40.0, seed=3, index=1)
        measured = len(tok.encode(s.prompt))
        assert measured == s.length
        assert 0.98 * target <= measured <= target, (task, target, measured)
        assert s.prompt.endswith(s.prompt[s.context_span[1] :])  # answer prefix closes the prompt
        assert s.max_new_tokens >= len(tok.encode(" " + ", ".join(s.answers)))


@pytest.fixture(scope="module")
def bpe():
    """A real byte-level BPE (HF tokenizers, the project's trainer) fitted on the essay haystack."""
    from data_pipelines.tokenizer import train_bpe
    from eval.longctx.haystack import ESSAY_PATH

    return train_bpe(iter(ESSAY_PATH.read_text().split("\n") * 3), vocab_size=600)


@pytest.mark.parametrize("task", ALL_TASKS)
def test_samples_hit_target_length_bpe(task, bpe):
    for target in (1500, 6000):
        s = generate_sample(task, bpe, target, depth=70.0, seed=5, index=0)
        assert 0.98 * target <= len(bpe.encode(s.prompt)) == s.length <= target, (
            task,
            target,
            s.length,
        )
    if TASKS[task].has_depth:
        ins = s.meta["inserted"]
        (c0, c1), (n0, _) = s.context_span, s.needle_span
        depth = (
            100.0
            * len(bpe.encode(_strip(s.prompt[c0:n0], ins)))
            / len(bpe.encode(_strip(s.prompt[c0:c1], ins)))
        )
        assert abs(depth - 70.0) <= 2.0, (task, depth)


def test_sizing_binary_search_and_errors():
    tok = ByteTokenizer()
    fitted = fit_to_length(lambda n: "x" * 10 + "abc" * n, lambda p: len(tok.encode(p)), 1000)
    assert fitted.length == 1000 - (1000 - 10) % 3 and fitted.n == (1000 - 10) // 3
    with pytest.raises(SizingError, match="already 50 tokens"):
        fit_to_length(lambda n: "y" * 50 + "a" * n, len, 40)
    # 100-token steps cannot land within 2 % of 150
    with pytest.raises(SizingError, match="tolerance"):
        fit_to_length(lambda n: "a" * (100 * n), len, 150)
    with pytest.raises(SizingError):
        generate_sample("vt", tok, 300, depth=50.0)


def test_generation_is_seeded():
    tok = ByteTokenizer()
    a = generate_sample("niah_multikey", tok, 2048, 50.0, seed=1, index=0)
    b = generate_sample("niah_multikey", tok, 2048, 50.0, seed=1, index=0)
    c = generate_sample("niah_multikey", tok, 2048, 50.0, seed=1, index=1)
    assert a.prompt == b.prompt and a.answers == b.answers
    assert c.answers != a.answers


# ---- depth
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task", ["niah_single_repeat", "niah_single_essay", "niah_multikey", "niah_multivalue", "vt"]
)
@pytest.mark.parametrize(
    "tok_cls,length,tol", [(ByteTokenizer, 8192, 1.5), (WordTokenizer, 2048, 1.0)]
)
def test_needle_at_requested_depth(task, tok_cls, length, tol):
    """Depth = share of the filler's tokens before the needle (other needles excluded), as in RULER."""
    tok = tok_cls()
    for depth in (0.0, 10.0, 33.0, 50.0, 90.0, 100.0):
        s = generate_sample(task, tok, length, depth, seed=0, index=0)
        (c0, c1), (n0, _) = s.context_span, s.needle_span
        ins = s.meta["inserted"]
        before = len(tok.encode(_strip(s.prompt[c0:n0], ins)))
        filler = len(tok.encode(_strip(s.prompt[c0:c1], ins)))
        assert abs(100.0 * before / filler - depth) <= tol, (task, depth, 100.0 * before / filler)
    assert s.prompt[n0:].startswith(
        s.meta["chains"][0][0] if task == "vt" else "One of the special magic"
    )


def test_insertion_snaps_to_nearest_sentence_boundary():
    hay = Haystack("repeat")
    n = 40
    bounds, offsets = hay.boundaries(n)
    assert list(bounds[:4]) == [0, 4, 8, 12] and bounds[-1] == n
    text = hay.render(n, [(50.0, "NEEDLE."), (50.0, "AFTER.")])
    words = text.split(" ")
    i = words.index("NEEDLE.")
    assert words[i + 1] == "AFTER." and words[i - 1].endswith(".")
    # the boundary chosen is the one whose word offset is nearest to half the filler
    assert abs(i - n / 2) == min(abs(b - n / 2) for b in bounds)


# ---- scoring
# ----------------------------------------------------------------------------------------


def test_string_match_scores_hand_computed():
    preds = ["The numbers are 123 and 456.", "nothing here", "ABC\x00def"]
    refs = [["123", "456", "789"], ["x"], ["abc", "zzz"]]
    assert string_match_all(preds, refs) == pytest.approx(100 * (2 / 3 + 0 + 1 / 2) / 3)
    assert string_match_part(preds, refs) == pytest.approx(100 * (1 + 0 + 1) / 3)
    assert string_match_all(["anything"], [["thin"]]) == 100.0  # substring, case-insensitive
    with pytest.raises(ValueError):
        string_match_all(["a"], [["a"], ["b"]])


def test_rank_credit_ties_share():
    assert rank_credit([0.0, -1.0, -2.0]) == 1.0
    assert rank_credit([-3.0, -1.0, -2.0]) == 0.0
    assert rank_credit([-1.0, -1.0, -5.0]) == 0.5
    assert rank_credit([2.0] * 5) == pytest.approx(0.2)


# ---- sweep with model doubles
# -----------------------------------------------------------------------


def _cfg(**kw) -> LongCtxConfig:
    base = dict(
        lengths=[1024, 2048],
        depths=[0.0, 50.0, 100.0],
        tasks=ALL_TASKS,
        num_samples=2,
        mode="both",
        batch_size=3,
        num_distractors=4,
    )
    base.update(kw)
    return LongCtxConfig(**base)


def test_oracle_scores_100_and_silent_scores_0():
    oracle = OracleEvalModel(WordTokenizer())
    assert isinstance(oracle, EvalModel)
    summary = run_sweep(oracle, _cfg(), progress=False)
    assert not summary["skipped"]
    for task in ALL_TASKS:
        cells = [c for by_d in summary["results"][task].values() for c in by_d.values()]
        assert len(cells) == 2 * (3 if TASKS[task].has_depth else 1)
        assert all(c["string_match_all"] == 100.0 and c["loglik_acc"] == 100.0 for c in cells), task
        assert all(
            0.98 * 1024 <= c["min_length"] for c in summary["results"][task]["1024"].values()
        )
    silent = run_sweep(
        OracleEvalModel(WordTokenizer(), silent=True), _cfg(mode="generate"), progress=False
    )
    assert all(
        c["string_match_all"] == 0.0 and c["string_match_part"] == 0.0
        for by_len in silent["results"].values()
        for by_d in by_len.values()
        for c in by_d.values()
    )


def test_compression_recorded_per_length_and_budgets_passed():
    model = OracleEvalModel(ByteTokenizer())
    summary = run_sweep(
        model,
        _cfg(lengths=[2048, 4096], tasks=["niah_single_essay", "fwe"], mode="generate"),
        progress=False,
    )
    comp = summary["compression"]
    assert set(comp) == {"2048", "4096"} and all(comp[n]["compression/text"] > 1.0 for n in comp)
    assert comp["2048"] != comp["4096"]  # reset between lengths: each length reports its own calls
    gens = [c for c in model.calls if c["kind"] == "generate"]
    assert all(c["max_new_tokens"] >= 16 for c in gens) and max(c["n"] for c in gens) == 2


def test_near_sighted_model_gives_depth_gradient_and_loglik_is_graded():
    # sees only the last 3000 characters: late needles are found, early ones are not
    model = OracleEvalModel(WordTokenizer(), window_chars=3000)
    summary = run_sweep(
        model, _cfg(lengths=[2048], tasks=["niah_single_essay"], num_samples=3), progress=False
    )
    cells = summary["results"]["niah_single_essay"]["2048"]
    assert cells["0"]["string_match_all"] == 0.0 and cells["100"]["string_match_all"] == 100.0
    # not found -> constant log-likelihoods -> exactly chance (1 / (1 + distractors))
    assert (
        cells["0"]["loglik_acc"] == pytest.approx(100.0 / 5) and cells["100"]["loglik_acc"] == 100.0
    )


class _ShortestWins(OracleEvalModel):
    """Prefers shorter continuations, ignoring the context: ranks the reference only when it is shortest."""

    def loglikelihood(self, contexts, continuations, images=None):
        return [(-float(len(c)), False) for c in continuations]


def test_loglik_ranking_uses_the_models_scores():
    tok = WordTokenizer()
    summary = run_sweep(
        _ShortestWins(tok),
        _cfg(lengths=[1024], depths=[50.0], tasks=["cwe"], mode="loglik"),
        progress=False,
    )
    cell = summary["results"]["cwe"]["1024"]["all"]
    samples = [generate_sample("cwe", tok, 1024, None, 0, i) for i in range(2)]
    expected = np.mean(
        [
            np.mean(
                [rank_credit([-len(" " + c) for c in [r] + s.distractors[:4]]) for r in s.answers]
            )
            for s in samples
        ]
    )
    assert cell["loglik_acc"] == pytest.approx(100 * expected) and "string_match_all" not in cell


def test_config_validation_names_the_problem():
    with pytest.raises(ConfigError, match="allowed: .*niah_single_essay"):
        _cfg(tasks=["niah_nope"]).validate()
    with pytest.raises(ConfigError, match="depths"):
        _cfg(depths=[120.0]).validate()


# ---- CLI
# ---------------------------------------------------------------------------------------------


def test_cli_writes_summaries_and_plots(tmp_path, monkeypatch):
    loaded = []

    def load_eval_model(ckpt):
        loaded.append(str(ckpt))
        return OracleEvalModel(WordTokenizer(), window_chars=None if "main" in str(ckpt) else 2500)

    monkeypatch.setitem(
        sys.modules, "vlm.generate", types.SimpleNamespace(load_eval_model=load_eval_model)
    )
    (tmp_path / "main").mkdir()
    (tmp_path / "base").mkdir()
    from vlm.cli import main

    main(
        [
            "eval",
            "longctx",
            "--ckpt",
            str(tmp_path / "main"),
            "--baseline-ckpt",
            str(tmp_path / "base"),
            "--lengths",
            "1024",
            "2048",
            "--depths",
            "0",
            "100",
            "--tasks",
            "niah_single_repeat",
            "vt",
            "--num-samples",
            "1",
            "--mode",
            "both",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    out = tmp_path / "out"
    assert loaded == [str(tmp_path / "main"), str(tmp_path / "base")]
    a = json.loads((out / "model" / "summary.json").read_text())
    b = json.loads((out / "baseline" / "summary.json").read_text())
    assert a["results"]["niah_single_repeat"]["2048"]["0"]["score"] == 100.0
    assert b["results"]["niah_single_repeat"]["2048"]["0"]["score"] == 0.0
    assert set(a["compression"]) == {"1024", "2048"}
    for f in [
        "model/heatmap.png",
        "model/heatmap_loglik_acc.png",
        "baseline/heatmap.png",
        "comparison.png",
        "comparison.json",
        "compression.png",
        "model/samples.jsonl",
    ]:
        assert (out / f).stat().st_size > 0, f
    assert len((out / "model" / "samples.jsonl").read_text().splitlines()) == 2 * 2 * 2
    with pytest.raises(SystemExit, match="allowed"):
        main(
            [
                "eval",
                "longctx",
                "--ckpt",
                str(tmp_path / "main"),
                "--tasks",
                "bogus",
                "--out",
                str(out),
            ]
        )
