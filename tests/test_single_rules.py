"""Each rule written once (issue 42 item 3): the smallest target ratio (`ChunkConfig.smallest_target`,
which every static concept capacity is sized for), the null-target rule (`resolve_targets`, which
the run's model card and resume check apply to configs read as dicts), the kind of a sample that
states none (`kind_for`), and one name per vocabulary of kinds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from configs.config import ConfigError
from data_pipelines.schema import SAMPLE_KINDS, kind_for
from vlm.model.chunking import ChunkModule
from vlm.model.config import ChunkConfig, ModelConfig, resolve_targets
from vlm.serve.layout import concept_capacity
from vlm.train.report import model_card
from vlm.train.run_config import check_resume_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "targets, smallest",
    [(None, 3.0), ({"text": None, "image": 2.5}, 2.5), ({"text": None, "image": 4.0}, 3.0)],
)
def test_the_smallest_target_sizes_every_static_capacity(targets, smallest):
    ch = ChunkConfig(target_ratio=3.0, modality_target_ratios=targets, eval_capacity_slack=1.25)
    assert ch.smallest_target == smallest
    want = -(-int(-(-512 * 1.25 // smallest)) // 16) * 16  # ceil(T * slack / R), up to 16
    assert ChunkModule(ch, 8).capacity(512, training=False) == min(512, want)
    assert concept_capacity(ModelConfig(chunk=ch), 512, None) == min(512, want)


def test_document_slack_is_checked_against_the_smallest_target():
    with pytest.raises(ConfigError, match="target 1.5"):
        ChunkConfig(target_ratio=3.0, modality_target_ratios={"image": 1.5}, document_slack=1.6)


def test_a_null_modality_target_follows_target_ratio_in_every_reader():
    assert resolve_targets(3.0, {"text": None, "image": 4.0}) == {"text": 3.0, "image": 4.0}
    assert resolve_targets(3.0, None) is None
    ch = ChunkConfig(target_ratio=3.0, modality_target_ratios={"text": None, "image": 4.0})
    assert ch.modality_targets() == {"text": 3.0, "image": 4.0}
    # the model card reads the run's config as a dict: a null target and an unstated target_ratio
    cfg = {
        "model": {
            "encoder_layers": 1,
            "concept_layers": 2,
            "decoder_layers": 1,
            "hidden_size": 32,
            "moe": {"top_k": 2, "num_experts": 4},
            "chunk": {"modality_target_ratios": {"text": None, "image": 4.0}},
        },
        "data": {"default_dir": "d"},
        "train": {"stage": "pretrain", "max_steps": 3},
    }
    card = model_card(cfg, [], "t")
    assert f"target ratios text {ChunkConfig.target_ratio:g}, image 4" in card

    # a resumed run: a stated target equal to the one a null follows is no change; another is
    def chunk(per, R=2.0):
        return {"model": {"chunk": {"target_ratio": R, "modality_target_ratios": per}}}

    check_resume_config(chunk({"text": 2.0}), chunk({"text": None}))
    with pytest.raises(ConfigError, match="modality_target_ratios.text"):
        check_resume_config(chunk({"text": 2.0}), chunk({"text": None}, R=3.0))


def test_a_sample_that_states_no_kind_is_one_by_its_images():
    assert [kind_for(n) for n in range(4)] == ["text", "pair", "interleaved", "interleaved"]
    assert {kind_for(n) for n in range(4)} == set(SAMPLE_KINDS)
    from data_pipelines.schema import decode_sample

    raw = {"__key__": "k", "0.png": b"x", "1.png": b"y", "json": b'{"text": "<image><image> a"}'}
    assert decode_sample(raw).kind == "interleaved"
    # no other copy of the rule
    for path in sorted(ROOT.glob("*/**/*.py")):
        if ".venv" in path.parts or path.name == "schema.py" or path.parts[-2] == "tests":
            continue
        assert '"pair" if' not in path.read_text(), f"{path}: a copy of kind_for's rule"


def test_one_name_per_vocabulary():
    """`KINDS` names the statistics' kinds of document (configs/batch.py) and nothing else."""
    where = []
    for top in ("configs", "data_pipelines", "vision", "vlm", "eval"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in ("KINDS", "_KINDS") for t in node.targets
                ):
                    where.append(str(path.relative_to(ROOT)))
    assert where == ["configs/batch.py"], where
