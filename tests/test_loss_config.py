"""The loss weights are the training config's `loss:` section (issue 52): a run continuing a
checkpoint (train.init_from, stage ct, a chain's later stage) may change them without a third
file; the old keys in the model section are still read, with one note line each naming the key
and its new place; the default loss is what it was before the move."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from configs.batch import PackedBatch
from configs.config import to_dict
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.context import ForwardContext
from vlm.model.hf import MODEL_TYPE
from vlm.train.config import load_train_config
from vlm.train.loss_config import LossConfig
from vlm.train.losses import Loss


def _write(tmp_path, data: dict, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_old_key_in_the_model_section_is_read_with_a_one_line_note(tmp_path, capsys):
    path = _write(
        tmp_path,
        {"model": {"moe": {"balance_loss_weight": 0.0}, "chunk": {"document_weight": 7.0}}},
    )
    cfg = load_train_config(path)
    assert cfg.loss.balance == 0.0 and cfg.loss.document == 7.0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    for old, new in (
        ("moe.balance_loss_weight", "loss.balance"),
        ("chunk.document_weight", "loss.document"),
    ):
        (line,) = [x for x in lines if f"model.{old} " in x]
        assert new in line, f"the note on model.{old} does not name its new place {new}: {line}"
    # the same from an override, and the loss term it feeds follows it
    cfg = load_train_config(None, ["model.chunk.ratio_loss_weight=0.5"])
    assert Loss(cfg.model, cfg.loss).weights["ratio"] == 0.5
    assert "loss.ratio" in capsys.readouterr().err


def test_the_loss_section_works_and_wins_over_an_old_key(tmp_path, capsys):
    cfg = load_train_config(None, ["loss.z=0.002", "loss.concept_balance=0.0"])
    assert capsys.readouterr().err == ""  # nothing old, nothing said
    loss = Loss(cfg.model, cfg.loss)
    assert loss.weights["z"] == 1.0 and loss.loss_cfg.router_weight("balance", True) == 0.0
    assert loss.router_losses == {"balance", "z"}  # what the training forward computes
    path = _write(tmp_path, {"model": {"moe": {"z_loss_weight": 0.3}}, "loss": {"z": 0.1}})
    assert load_train_config(path).loss.z == 0.1
    err = capsys.readouterr().err
    assert "model.moe.z_loss_weight" in err and "loss.z=0.1 states it" in err, err
    with pytest.raises(Exception, match="loss.balance must be >= 0"):
        load_train_config(None, ["loss.balance=-1"])


def test_a_concept_moe_section_of_its_own_keeps_its_layers_old_weight(capsys):
    """An old concept_moe section was a MoEConfig of its own: a balance weight it did not state
    was 0.01 (the default), whatever moe's; it becomes loss.concept_balance. One stated through the
    YAML anchor (the paper configs) equals moe's: concept_balance stays null, following balance."""
    cfg = load_train_config(
        None, ["model.moe.balance_loss_weight=0.0", "model.concept_moe={top_k: 2}"]
    )
    assert (cfg.loss.balance, cfg.loss.concept_balance) == (0.0, 0.01)
    assert "loss.concept_balance" in capsys.readouterr().err
    same = "{top_k: 2, balance_loss_weight: 0.0}"
    cfg = load_train_config(
        None, ["model.moe.balance_loss_weight=0.0", f"model.concept_moe={same}"]
    )
    assert (cfg.loss.balance, cfg.loss.concept_balance) == (0.0, None)


def _old_export(tmp_path, balance: float):
    """An export's config.json as versions before the move wrote it: the loss weights in its model."""
    model = to_dict(ModelConfig())
    model["moe"]["balance_loss_weight"] = balance
    model["moe"]["z_loss_weight"] = 0.0
    model["chunk"]["ratio_loss_weight"] = 0.03
    model["chunk"]["document_weight"] = 30.0
    out = tmp_path / "old" / "final"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, "model": model}))
    return out


def test_a_continued_run_may_change_a_loss_weight_from_an_old_checkpoint(tmp_path, capsys):
    """train.init_from an export written before the move (its model section holds balance 0.01):
    the run's own loss section (balance 0.5, ratio 0.1) is what trains, with no third file and no
    refusal; the stored model's loss weights are not a model setting any more."""
    from vlm.train.stages import merge_model_section, stored_model_config

    src = _old_export(tmp_path, balance=0.01)
    path = _write(
        tmp_path,
        {
            "train": {"stage": "vl", "init_from": str(src)},
            "loss": {"balance": 0.5, "ratio": 0.1},
        },
    )
    cfg = load_train_config(path)
    stored = stored_model_config(src)
    merged = merge_model_section(stored, cfg, src)
    assert merged == stored  # the model is the checkpoint's
    loss = Loss(merged, cfg.loss)
    assert loss.weights["ratio"] == 0.1 and loss.loss_cfg.balance == 0.5
    # a chain's later stage states its own weights the same way; an old-style key in the stage's
    # model section is moved, not refused as a model key that may not change
    path = _write(
        tmp_path,
        {"train": {"stage": "vl", "init_from": str(src)}, "model": {"moe": {"z_loss_weight": 0.2}}},
        "stage2.yaml",
    )
    cfg = load_train_config(path)
    assert cfg.loss.z == 0.2 and merge_model_section(stored, cfg, src) == stored
    assert "model.moe.z_loss_weight" in capsys.readouterr().err


def test_an_old_run_config_resumes_against_its_new_form(tmp_path):
    """RUN_DIR/config.yaml written before the move holds the weights in its model section: a resume
    compares them with the loss section's, quietly, and refuses a changed one by its new name."""
    from configs.config import ConfigError
    from vlm.train.run_config import check_resume_config, saved_run_config

    now = load_train_config(None)
    old = to_dict(now)
    old.pop("loss")
    old["model"]["moe"]["balance_loss_weight"] = 0.01
    old["model"]["moe"]["z_loss_weight"] = 0.0
    old["model"]["chunk"]["ratio_loss_weight"] = 0.03
    old["model"]["chunk"]["document_weight"] = 30.0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    saved = saved_run_config(tmp_path, warn=print)
    check_resume_config(saved, to_dict(now))
    changed = to_dict(load_train_config(None, ["loss.ratio=0.1"]))
    with pytest.raises(ConfigError, match="loss.ratio was 0.03"):
        check_resume_config(saved, changed)


def test_the_default_loss_is_what_it_was_before_the_move():
    """One seeded training forward of a small ConceptMoE with the default weights: each term, the
    total and the gradient's size are the values the code before the move computed (measured on it,
    the same script; bit-equal there on this machine)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
        chunk=ChunkConfig(target_ratio=3.0, document_slack=1.3),
    )
    m = ConceptMoELM(cfg).train()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (17, 9, 20)]
    batch = PackedBatch.from_documents(docs, row_len=48)
    loss = Loss(cfg, LossConfig())
    context = ForwardContext(torch.tensor(5), logits=False, router_losses=loss.router_losses)
    res = loss(m(batch, context=context), batch)
    assert res.weights == {"lm": 1.0, "ratio": 0.03, "balance": 1.0}
    got = {k: float(v.value) for k, v in res.terms.items()}
    before = {"lm": 4.176513195037842, "ratio": 34.21179962158203, "balance": 0.010060359723865986}
    assert got == pytest.approx(before, rel=1e-5), f"the terms {got}, before the move {before}"
    assert float(res.backprop) == pytest.approx(5.212927341461182, rel=1e-5)
    res.backprop.backward()
    size = float(sum(p.grad.double().abs().sum() for p in m.parameters() if p.grad is not None))
    assert size == pytest.approx(163.0143951636581, rel=1e-5)


def test_each_router_loss_weighs_its_layers_and_the_training_forward_computes_it():
    """loss.balance weighs the token layers' balance loss, loss.concept_balance the concept
    model's; the step's forward asks the MoE layers for the router losses its loss weighs (z
    here), and its statistics pass for none."""
    from vlm.model.training_controls import TrainingControls
    from vlm.train.layout import ParallelLayout
    from vlm.train.step import StepSettings, forward_context

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
    )
    m = ConceptMoELM(cfg).train()
    loss = Loss(cfg, LossConfig(balance=0.5, concept_balance=0.0, z=0.25))
    s = StepSettings(loss, TrainingControls(m), 0, ParallelLayout(1, 0), torch.device("cpu"))
    assert forward_context(s, 0, 0, statistics="off").router_losses == frozenset()
    context = forward_context(s, 0, 0)
    assert context.router_losses == {"balance", "z"}
    batch = PackedBatch.from_documents([list(range(3, 40))], row_len=40)
    out = m(batch, context=context)
    res = loss(out, batch)
    passes = out.moe_passes
    assert {n.split(".")[0] for n, _ in passes} == {"encoder", "concept", "decoder"}
    want = torch.stack(
        [(0.0 if n.startswith("concept.") else 0.5) * s_.balance for n, s_ in passes]
    ).mean()
    torch.testing.assert_close(res.terms["balance"].value, want)
    want_z = torch.stack([0.25 * s_.z for _, s_ in passes]).mean()
    assert float(want_z) > 0
    torch.testing.assert_close(res.terms["z"].value, want_z)
