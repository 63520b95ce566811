"""The eval harnesses on a real (tiny, untrained) exported checkpoint loaded by vlm.generate.load_eval_model."""

from __future__ import annotations

import importlib.util
import json

import pytest
from PIL import Image

from eval.longctx.config import LongCtxConfig
from eval.longctx.sweep import run_sweep
from eval.protocol import EvalModel
from vlm.generate import load_eval_model


@pytest.fixture(scope="module")
def ckpt(exported_vlm):
    return exported_vlm


def test_longctx_sweep_on_exported_model(ckpt):
    model = load_eval_model(ckpt, device="cpu")
    assert isinstance(model, EvalModel)
    cfg = LongCtxConfig(
        lengths=[400, 600],
        depths=[50.0],
        tasks=["niah_single_repeat"],
        num_samples=1,
        mode="both",
        num_distractors=2,
        max_new_tokens=4,
    )
    s = run_sweep(model, cfg, progress=False)
    cells = [s["results"]["niah_single_repeat"][n]["50"] for n in ("400", "600")]
    assert all(c["n"] == 1 and 0.98 * L <= c["mean_length"] <= L for c, L in zip(cells, (400, 600)))
    assert all(
        0.0 <= c["string_match_all"] <= 100.0 and 0.0 <= c["loglik_acc"] <= 100.0 for c in cells
    )
    assert all(s["compression"][n]["compression/text"] >= 1.0 for n in ("400", "600"))


@pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None, reason="lmms-eval not installed")
def test_lmms_adapter_loads_and_answers_with_exported_model(ckpt, tmp_path):
    pytest.importorskip("lmms_eval.api.model")
    from lmms_eval.api.instance import Instance

    from eval.lmms_adapter import ConceptMoELMMS

    lm = ConceptMoELMMS(pretrained=str(ckpt), batch_size=2, stats_dir=str(tmp_path))
    docs = [{"img": Image.new("RGB", (16, 12), c)} for c in ("red", "blue")]
    lm.task_dict = {"t": {"test": docs}}
    meta = {"task": "t", "repeats": 1}
    gens = [
        Instance(
            "generate_until",
            (
                f"Q{i}?",
                {"until": ["\n"], "max_new_tokens": 3},
                lambda d: [d["img"]],
                i,
                "t",
                "test",
            ),
            0,
            {**meta, "doc_id": i},
        )
        for i in range(2)
    ]
    outs = lm.generate_until(gens)
    assert len(outs) == 2 and all(isinstance(o, str) and "\n" not in o for o in outs)
    lls = lm.loglikelihood(
        [
            Instance(
                "loglikelihood",
                ("Colour?", c, lambda d: [d["img"]], 0, "t", "test"),
                i,
                {**meta, "doc_id": 0},
            )
            for i, c in enumerate(["red", "blue"])
        ]
    )
    assert all(v > 0 and isinstance(g, bool) for v, g in lls)  # choices: negative log-likelihood
    saved = json.loads(next(tmp_path.glob("*/*_compression.json")).read_text())
    assert saved["tasks"]["t"]["generate_until"]["compression"]["compression/image"] >= 1.0
