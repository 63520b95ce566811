"""The vision warm-up: a fresh encoder learns the words of its images' captions before step 0 of a VL run.

Legend: D width, N flat tokens or patches.
"""

import json

import pytest
import torch

from vlm.train.vision_warmup import (
    caption_words,
    collect_captions,
    is_caption,
    max_pool_per_image,
    run_vision_warmup,
    word_vocabulary,
)


def test_caption_words_are_lower_cased_letter_runs_without_the_placeholder():
    assert caption_words("<image>A large red circle at the top left, 2 of them.") == {
        "large",
        "red",
        "circle",
        "at",
        "the",
        "top",
        "left",
        "of",
        "them",
    }


def test_only_single_image_plain_text_samples_are_captions():
    from data_pipelines.schema import Sample

    assert is_caption(Sample(key="a", kind="pair", text="<image>A red circle.", images=[b"x"]))
    assert not is_caption(
        Sample(
            key="b",
            kind="pair",
            turns=[
                {"role": "user", "content": "<image>\nWhat?"},
                {"role": "assistant", "content": "red"},
            ],
            images=[b"x"],
        )
    )
    assert not is_caption(
        Sample(key="c", kind="interleaved", text="<image>a <image>b", images=[b"x", b"y"])
    )
    assert not is_caption(Sample(key="d", kind="text", text="no image"))


def test_vocabulary_keeps_words_in_enough_captions():
    assert word_vocabulary([{"red", "circle"}, {"red"}, {"blue"}], min_count=2) == ["red"]


def test_max_pool_is_the_max_over_each_images_own_tokens():
    x_ND = torch.randn(9, 5)
    out = max_pool_per_image(x_ND, [2, 4, 3])
    expected = torch.stack(
        [x_ND[:2].max(0).values, x_ND[2:6].max(0).values, x_ND[6:].max(0).values]
    )
    assert torch.equal(out, expected)


def test_collect_captions_reads_the_caption_shards_of_the_default_data(tiny_default):
    caps = collect_captions([str(tiny_default / "train" / "caption-*.tar")], limit=30)
    assert len(caps.images) == 30 and all(caps.words)
    assert all(w.isalpha() for ws in caps.words for w in ws)


def _encoder_and_processor():
    from configs.config import from_dict
    from vision.config import VisionConfig

    vcfg = from_dict(
        VisionConfig,
        {
            "processor": {"patch_size": 8, "min_patches": 4, "max_patches": 64, "merge": 2},
            "encoder": {
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "max_grid": 32,
                "stem": "conv",
                "stem_channels": 8,
                "merger": "none",
                "layer_scale": 0.01,
            },
        },
    )
    return vcfg.build(32).encoder, vcfg.build_processor()


def test_warmup_teaches_the_encoder_colour_words_from_captions(tiny_default, tmp_path):
    """After the warm-up the read-out names each held-out image's colours far better than the base
    rate, which it could not do if the encoder ignored the pixels."""
    from data_pipelines.config import DataConfig
    from vlm.train.config import VisionWarmupConfig

    torch.manual_seed(0)
    encoder, processor = _encoder_and_processor()
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    cfg = VisionWarmupConfig(
        steps=300, images_per_step=16, lr=1e-2, min_word_count=3, max_captions=200, held_out=20
    )
    data = DataConfig(default_dir=str(tiny_default), tokenizer="byte")
    result = run_vision_warmup(
        encoder,
        processor,
        cfg,
        data,
        seed=0,
        device=torch.device("cpu"),
        run_dir=tmp_path,
        log=lambda *_: None,
    )
    assert any(not torch.equal(before[k], v) for k, v in encoder.state_dict().items())
    assert json.loads((tmp_path / "vision_warmup.json").read_text())["steps"] == 300
    assert result["held_out_captions"] == 20 and result["loss_last"] < result["loss_first"]
    colours = ["red", "green", "blue", "yellow", "purple", "orange"]
    acc = sum(result["held_out_word_accuracy"][c] for c in colours) / len(colours)
    base = sum(result["held_out_word_base_rate"][c] for c in colours) / len(colours)
    assert acc >= base + 0.15, (acc, base)


def test_warmup_refuses_data_without_captions(tmp_path, write_text_shards):
    from configs.config import from_dict
    from data_pipelines.config import DataConfig
    from vlm.train.config import VisionWarmupConfig

    write_text_shards(tmp_path / "text", 20, 10)
    data = from_dict(
        DataConfig, {"sources": [{"path": str(tmp_path / "text" / "t-*.tar")}], "tokenizer": "byte"}
    )
    encoder, processor = _encoder_and_processor()
    with pytest.raises(ValueError, match="caption samples"):
        run_vision_warmup(
            encoder,
            processor,
            VisionWarmupConfig(steps=5),
            data,
            seed=0,
            device=torch.device("cpu"),
            run_dir=None,
            log=lambda *_: None,
        )


def test_config_refuses_a_warmup_for_a_frozen_or_missing_encoder(
    TINY, load_tiny, tiny_data, tiny_config
):
    from configs.config import ConfigError

    cfg = tiny_config(tiny_data, vision_warmup={"steps": 10})
    cfg["vision"]["freeze_encoder"] = True
    with pytest.raises(ConfigError, match="freezes"):
        load_tiny(cfg)
    with pytest.raises(ConfigError, match="vision_warmup.steps must be >= 0"):
        load_tiny(tiny_config(tiny_data, vision_warmup={"steps": -1}))


def test_a_vl_run_warms_up_a_fresh_encoder_but_not_one_it_resumes_or_inherits(
    tiny_data, tiny_config, make_trainer, tmp_path, torch_globals
):
    cfg = tiny_config(
        tiny_data,
        vision_warmup={
            "steps": 3,
            "images_per_step": 4,
            "min_word_count": 2,
            "max_captions": 40,
            "held_out": 4,
        },
    )
    run = tmp_path / "run"
    t = make_trainer(cfg, run)
    assert (run / "vision_warmup.json").is_file()
    assert t.train() == 0
    (run / "vision_warmup.json").unlink()
    # resumed: the checkpoint has the warmed encoder
    make_trainer(cfg, run, resume=True)
    assert not (run / "vision_warmup.json").exists()
    child = tmp_path / "child"
    cfg2 = tiny_config(
        tiny_data, vision_warmup=cfg["vision_warmup"], train={"init_from": str(run / "final")}
    )
    # inherited: init_from carries the encoder
    make_trainer(cfg2, child)
    assert not (child / "vision_warmup.json").exists()


def test_freeze_after_keeps_the_warmed_encoder_for_the_run_and_its_resumes(
    tiny_data, tiny_config, make_trainer, tmp_path, torch_globals
):
    """vision_warmup.freeze_after: the encoder trains in the warm-up, then not at all (nor after a
    resume); the projector and the LLM still train."""
    cfg = tiny_config(
        tiny_data,
        vision_warmup={
            "steps": 3,
            "images_per_step": 4,
            "min_word_count": 2,
            "max_captions": 40,
            "held_out": 4,
            "freeze_after": True,
        },
    )
    run = tmp_path / "run"
    t = make_trainer(cfg, run)
    enc = t.run.engine.module.vision.encoder
    assert not any(p.requires_grad for p in enc.parameters())
    warmed = {k: v.clone() for k, v in enc.state_dict().items()}
    proj = {k: v.clone() for k, v in t.run.engine.module.vision.projector.state_dict().items()}
    assert t.train() == 0
    assert all(torch.equal(v, enc.state_dict()[k]) for k, v in warmed.items())
    assert not all(
        torch.equal(v, t.run.engine.module.vision.projector.state_dict()[k])
        for k, v in proj.items()
    )
    resumed = make_trainer(cfg, run, resume=True)
    assert not any(p.requires_grad for p in resumed.run.engine.module.vision.encoder.parameters())
