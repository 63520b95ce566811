"""Trainer configuration: one clear line for bad configs, schedules, parameter groups, DeepSpeed config."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from configs.config import ConfigError
from vlm.train.__main__ import main as train_main

BAD = [
    # (override or yaml tweak, text the one line must contain)
    (["optim.lrr=0.1"], "unknown key optim.lrr"),
    (["optim.grad_accum=two"], "optim.grad_accum"),
    (["model.moe.top_k=9", "model.moe.num_experts=4"], "top_k must be in [1, num_experts=4]"),
    (["model.chunk.target_ratio=0.5"], "target_ratio must be > 1"),
    (["deepspeed.zero_stage=5"], "allowed values: 0, 1, 2, 3"),
    (["optim.schedule=linear"], "allowed values: 'cosine', 'wsd', 'constant'"),
    (["train.stage=text"], "train.stage 'text' trains the LLM alone"),
    (["params.freeze=[decoder]"], "params.freeze entry 'decoder'"),
    (["model.init_std=-1"], "init_std must be > 0"),
    (["data.tokenizer=/nonexistent/tok"], "tokenizer '/nonexistent/tok' does not exist"),
    (
        ["data.sources=[{path: /nonexistent/*.tar}]"],
        "data.sources[0]: source /nonexistent/*.tar: shard pattern",
    ),
    (["optim.betas=[0.9]"], "optim.betas: expected 2 items, got 1"),
    (["optim.lr=.inf"], "optim.lr: got inf, expected a finite number"),
    (["optim.betas=[0.9, .nan]"], "optim.betas[1]: got nan, expected a finite number"),
    (["deepspeed.extra=5"], "deepspeed.extra: expected a mapping"),
    (
        ['deepspeed.extra={"zero_optimization": {"stage": 7}}'],
        "DeepSpeedZeroConfig | stage | Input should be 0, 1",
    ),
    (
        ['deepspeed.extra={"zero_optimization": {"stagee": 2}}'],
        "stagee | Extra inputs are not permitted",
    ),
    (
        ['deepspeed.extra={"gradient_clipping": "abc"}'],
        "gradient_clipping='abc' (from deepspeed.extra",
    ),
    (
        ['deepspeed.extra={"bf16": {"enabled": "maybe"}}'],
        "bf16.enabled='maybe' (from deepspeed.extra",
    ),
    (
        ["deepspeed.config_file=pyproject.toml"],
        "deepspeed.config_file pyproject.toml cannot be read as JSON",
    ),
]


@pytest.mark.parametrize("overrides,needle", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_config_one_line(tmp_path, capsys, overrides, needle, write_config, TINY):
    path = write_config(TINY, tmp_path / "c.yaml")
    rc = train_main(["--config", str(path), "--out", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("config error: ") and needle in err, err
    assert not (tmp_path / "run").exists(), "a config error must stop before any work"


def test_bad_config_cli_subprocess(tmp_path, TINY, write_config, ROOT, subprocess_env):
    """The real entry point: exit code 2 and exactly one line on stderr, before DeepSpeed starts."""
    cfg = dict(TINY, optim={**TINY["optim"], "betas": "fast"})
    path = write_config(cfg, tmp_path / "bad.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(tmp_path / "r")],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    lines = [
        line for line in proc.stderr.splitlines() if line.strip() and "real_accelerator" not in line
    ]
    assert lines == [lines[0]] and "optim.betas" in lines[0], proc.stderr


def test_default_configs_validate(ROOT):
    from configs.config import load_config
    from vlm.train.config import TrainConfig, load_train_config

    cfg = load_train_config(ROOT / "configs" / "default.yaml")
    assert cfg.train.stage == "vl" and cfg.vision is not None
    assert cfg.data.processor.patch_size == cfg.vision.processor.patch_size
    gpu = load_config(TrainConfig, ROOT / "configs" / "gpu.yaml")
    assert gpu.deepspeed.bf16 and gpu.deepspeed.zero_stage >= 1


def test_lr_schedules():
    """transformers' schedules behind optim.schedule: the multiplier of optim.lr at each optimizer step."""
    import torch

    from vlm.train.schedule import build_scheduler

    def multipliers(schedule, steps=111, **kw):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = build_scheduler(
            opt, schedule=schedule, warmup=10, total=110, lr=1.0, min_lr=0.1, **kw
        )
        return [sched.lr_lambdas[0](s) for s in range(steps)]

    cos = multipliers("cosine", decay_fraction=0.2)
    # linear warm-up, never 0
    assert cos[0] == pytest.approx(0.1) and cos[9] == pytest.approx(1.0)
    # cosine to the floor at the last step
    assert cos[59] == pytest.approx(0.55) and cos[109] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(cos[10:110], cos[11:110]))
    wsd = multipliers("wsd", decay_fraction=0.2)
    assert wsd[10:90] == [1.0] * 80  # stable phase
    # linear decay over the last 20 %
    assert wsd[100] == pytest.approx(0.55) and wsd[110] == pytest.approx(0.1)
    assert multipliers("constant", decay_fraction=0.2)[50] == 1.0


@pytest.fixture
def _tiny_model(load_tiny, TINY):
    def make(**cfg_updates):
        cfg = load_tiny({**TINY, **cfg_updates})
        from vlm.model.multimodal import ConceptMoEVLM

        torch.manual_seed(0)
        return cfg, ConceptMoEVLM(cfg.model, cfg.vision)

    return make


def test_param_groups_mup_and_multipliers(_tiny_model, TINY):
    from vlm.train.param_groups import (
        apply_mup_init,
        build_param_groups,
        mup_width_multipliers,
        part_of,
    )

    model_cfg = dict(TINY["model"], hidden_size=64, concept_hidden_size=128, head_dim=16)
    cfg, model = _tiny_model(
        model=model_cfg,
        params={"mup": True, "mup_base_width": 32, "vision_lr_mult": 0.1, "projector_lr_mult": 2.0},
    )
    s_tok, s_con = mup_width_multipliers(64, 128, 32)
    assert (s_tok, s_con) == (2.0, 4.0)
    groups = build_param_groups(model, cfg.optim, cfg.params, 64, 128)
    by_name = {}
    for g in groups:
        by_name.setdefault(g["name"], []).append(g)
    lr = cfg.optim.lr
    assert [g["lr"] for g in by_name["token/matrix"]] == [lr / 2]  # eq. 19
    assert [g["lr"] for g in by_name["concept/matrix"]] == [lr / 4]  # eq. 20
    assert by_name["concept/matrix"][0]["eps"] == pytest.approx(cfg.optim.eps / 4)
    assert (
        by_name["embed/matrix"][0]["lr"] == lr and by_name["embed/matrix"][0]["weight_decay"] == 0
    )
    assert by_name["head/matrix"][0]["lr"] == lr
    assert by_name["vision/matrix"][0]["lr"] == pytest.approx(0.1 * lr)
    assert by_name["projector/matrix"][0]["lr"] == pytest.approx(2 * lr)
    assert all(
        g["weight_decay"] == 0 for n, gs in by_name.items() if n.endswith("vector") for g in gs
    )
    # every trainable tensor in exactly one group
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert (
        part_of("lm.concept.0.attn.q_proj.weight") == "concept"
        and part_of("lm.decoder.0.mlp.x") == "token"
    )
    # init variance sigma^2 / s for hidden matrices, untouched embeddings
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_mup_init(model, s_tok, s_con)
    after = dict(model.named_parameters())
    w = (
        "lm.concept.0.attn.q_proj.weight"
        if "lm.concept.0.attn.q_proj.weight" in after
        else next(n for n in after if n.startswith("lm.concept.") and after[n].ndim >= 2)
    )
    assert torch.allclose(after[w], before[w] / math.sqrt(s_con))
    assert torch.equal(after["lm.embed.weight"], before["lm.embed.weight"])


def test_freeze_by_prefix_and_unknown_prefix(_tiny_model):
    from vlm.train.param_groups import build_param_groups, freeze_prefixes

    cfg, model = _tiny_model()
    n = freeze_prefixes(model, ["vision.encoder", "lm.embed"])
    assert n > 0
    assert all(
        not p.requires_grad
        for name, p in model.named_parameters()
        if name.startswith(("vision.encoder.", "lm.embed."))
    )
    groups = build_param_groups(model, cfg.optim, cfg.params, 32, 32)
    frozen = {id(p) for name, p in model.named_parameters() if not p.requires_grad}
    assert not frozen & {id(p) for g in groups for p in g["params"]}
    with pytest.raises(ConfigError, match="matches no parameter; module prefixes: .*lm.decoder"):
        freeze_prefixes(model, ["lm.nonexistent"])


def test_deepspeed_config_generation(tmp_path):
    from vlm.train.config import DeepSpeedConfig, OptimConfig
    from vlm.train.engine import deepspeed_config

    extra = tmp_path / "ds.json"
    extra.write_text('{"zero_optimization": {"allgather_bucket_size": 123}}')
    ds = DeepSpeedConfig(zero_stage=3, bf16=True, offload_param="cpu", config_file=str(extra))
    out = deepspeed_config(ds, OptimConfig(grad_accum=4, clip=0.5), world_size=8)
    assert out["train_batch_size"] == 32 and out["gradient_accumulation_steps"] == 4
    assert out["gradient_clipping"] == 0.5 and out["bf16"]["enabled"]
    z = out["zero_optimization"]
    assert (
        z["stage"] == 3
        and z["offload_param"] == {"device": "cpu"}
        and z["allgather_bucket_size"] == 123
    )
    with pytest.raises(ConfigError, match="offload_param"):
        DeepSpeedConfig(zero_stage=2, offload_param="cpu").validate()


LLAVA_ZERO2 = {  # LLaVA's scripts/zero2.json, as users bring it
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
}


def test_a_users_deepspeed_json_with_auto_values(tmp_path):
    """ "auto" takes the run's own values (as transformers' Trainer fills them); the optimizer
    section gives way to optim.*; the stage the file sets is what the run reports."""
    import json

    from vlm.train.config import DeepSpeedConfig, OptimConfig
    from vlm.train.engine import check_deepspeed_config, effective_settings

    path = tmp_path / "zero2.json"
    path.write_text(json.dumps(LLAVA_ZERO2))
    ds = DeepSpeedConfig(config_file=str(path))
    out = check_deepspeed_config(ds, OptimConfig(grad_accum=2, clip=0.7), world_size=1)
    assert out["train_micro_batch_size_per_gpu"] == 1 and out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 2 and out["gradient_clipping"] == 0.7
    assert (
        out["bf16"]["enabled"] is False
        and out["fp16"]["enabled"] is False
        and out["fp16"]["loss_scale"] == 0
    )
    assert (
        out["zero_optimization"]["stage"] == 2
        and out["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    )
    assert "optimizer" not in out
    ran = effective_settings(ds, out)
    assert ran.zero_stage == 2 and ran.bf16 is False


def test_the_run_records_the_stage_its_deepspeed_json_set(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    import json

    import yaml

    path = tmp_path / "zero2.json"
    path.write_text(json.dumps(LLAVA_ZERO2))
    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 1},
        deepspeed={"config_file": str(path)},
        logging={"eval_every": 0},
    )
    tr = make_trainer(cfg, tmp_path / "run")
    assert tr.train() == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["deepspeed"]["zero_stage"] == 2 and tr.run.engine.zero_optimization_stage() == 2


def test_cli_override_scientific_notation_is_a_number():
    from configs.config import parse_override

    assert parse_override("optim.lr=1e-3") == (["optim", "lr"], 1e-3)
    assert parse_override("model.chunk.merge=sum") == (["model", "chunk", "merge"], "sum")


def test_overrides_may_follow_options(capsys):
    from configs.config import parse_args_anywhere
    from vlm.cli import build_parser

    args = parse_args_anywhere(
        build_parser(), ["train", "train.seed=1", "--max-steps", "3", "optim.lr=0.01"]
    )
    assert args.overrides == ["train.seed=1", "optim.lr=0.01"] and args.max_steps == 3
    for argv in (["train", "--bogus", "3"], ["train", "a=1", "--max-steps", "3", "notakeyvalue"]):
        with pytest.raises(SystemExit):
            parse_args_anywhere(build_parser(), argv)
        assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command without overrides takes none
        parse_args_anywhere(build_parser(), ["chat", "--ckpt", "x", "a=1"])


def test_non_utf8_config_is_one_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model:\n  hidden_size: 9\xff\n")
    rc = train_main(["--config", str(path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2
        and err.startswith("config error: ")
        and "not UTF-8" in err
        and len(err.splitlines()) == 1
    )
    assert not (tmp_path / "run").exists()


def test_the_data_processor_is_the_vision_processor():
    """The patch geometry is stated once, under vision.processor: with a vision section the loader
    patchifies with that same config. data.processor serves configs without vision; next to a vision
    section a copy is accepted only where it is the same (a saved run config writes both), anything
    else is one clear error."""
    from configs.config import from_dict, to_dict
    from vision.config import VisionConfig
    from vlm.train.config import TrainConfig

    vision = {
        "processor": {"patch_size": 7, "max_patches": 16},
        "encoder": {"hidden_size": 16, "num_heads": 2, "num_layers": 1, "max_grid": 16},
    }
    cfg = from_dict(TrainConfig, {"vision": vision})
    assert cfg.data.processor is cfg.vision.processor and cfg.data.processor.patch_size == 7
    again = from_dict(TrainConfig, to_dict(cfg))
    assert again == cfg and again.data.processor is again.vision.processor
    # made in Python: derived as well
    direct = TrainConfig(vision=from_dict(VisionConfig, vision))
    assert direct.data.processor is direct.vision.processor
    with pytest.raises(ConfigError, match="data.processor is set, but with a vision section"):
        from_dict(TrainConfig, {"vision": vision, "data": {"processor": {"patch_size": 4}}})
    text = from_dict(
        TrainConfig,
        {
            "vision": None,
            "train": {"stage": "text"},
            "data": {"processor": {"patch_size": 4}, "default_parts": ["text"]},
        },
    )
    assert text.data.processor.patch_size == 4
    with pytest.raises(ConfigError, match="unknown key vision.encoder.patch_size"):
        from_dict(
            TrainConfig, {"vision": dict(vision, encoder=dict(vision["encoder"], patch_size=7))}
        )


def test_no_vision_tower_refuses_image_data_in_one_line(
    tmp_path, capsys, tiny_data, tiny_config, write_config
):
    """vision: null on the default dataset's image parts is a config error at load time; on sources
    that turn out to carry images it is one line at the first batch, not a traceback."""
    from configs.config import from_dict
    from vlm.train.config import TrainConfig

    text_only = {"vision": None, "train": {"stage": "text"}, "vision_warmup": {"steps": 0}}
    for parts in ([], ["vqa"], ["text", "caption"]):
        with pytest.raises(
            ConfigError,
            match=r"vision: null, but the default dataset's parts \[.*\] carry images",
        ):
            from_dict(TrainConfig, dict(text_only, data={"default_parts": parts}))
    assert from_dict(TrainConfig, dict(text_only, data={"default_parts": ["text"]})).vision is None

    cfg = tiny_config(
        tiny_data,
        vision=None,
        vision_warmup={"steps": 0},
        train={"stage": "text", "max_steps": 2, "vqa_eval": False},
        params={"vision_lr_mult": 1.0, "projector_lr_mult": 1.0},
    )
    rc = train_main(
        ["--config", str(write_config(cfg, tmp_path / "c.yaml")), "--out", str(tmp_path / "run")]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "the data carries images but the config has no vision tower" in err


def test_print_config_shows_the_resolved_config_and_exits(tmp_path, capsys, write_config, TINY):
    import yaml

    path = write_config(TINY, tmp_path / "c.yaml")
    assert (
        train_main(
            [
                "--config",
                str(path),
                "--print-config",
                "optim.lr=0.02",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (
        printed["optim"]["lr"] == 0.02
        and printed["model"]["hidden_size"] == TINY["model"]["hidden_size"]
    )
    assert not (tmp_path / "run").exists()


def test_run_configs_written_by_earlier_versions_still_load(tmp_path):
    """RUN_DIR/config.yaml from before `logging.report_to`: `logging.tensorboard: bool` is read as report_to."""
    from vlm.train.config import load_train_config

    old = tmp_path / "config.yaml"
    old.write_text("logging:\n  tensorboard: false\n  log_every: 3\n")
    cfg = load_train_config(old)
    assert cfg.logging.report_to == [] and cfg.logging.log_every == 3
    old.write_text("logging:\n  tensorboard: true\n")
    assert load_train_config(old).logging.report_to == ["tensorboard"]
