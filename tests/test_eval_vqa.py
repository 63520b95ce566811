"""`vlm eval vqa` on a (briefly) trained tiny checkpoint reports accuracies and both baselines."""

import json

import torch

from data_pipelines.chat import iter_vqa_samples, normalize_answer
from data_pipelines.config import DataConfig
from data_pipelines.default_dataset import DefaultDatasetConfig, build_default
from data_pipelines.loader import build_loader
from data_pipelines.tokenizer import load_tokenizer
from eval.vqa import majority_answers
from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig
from vision.navit import NaViTConfig
from vlm.cli import main
from vlm.model.config import ModelConfig, MoEConfig
from vlm.model.hf import save_pretrained
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.stats import lm_loss
from vlm.train.losses import training_loss


def test_vqa_eval_cli_on_a_trained_tiny_checkpoint(tmp_path):
    data = build_default(
        tmp_path / "data",
        DefaultDatasetConfig(
            train_scenes=40, val_scenes=4, test_scenes=12, interleaved_docs=2, text_docs=10
        ),
        progress=False,
    )
    tok = load_tokenizer("byte")
    proc = ImageProcessorConfig(patch_size=8, min_patches=4, max_patches=16, merge=2)
    vc = VisionConfig(
        processor=proc, encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16)
    )
    torch.manual_seed(0)
    model = ConceptMoEVLM(
        ModelConfig(
            vocab_size=tok.vocab_size,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        ),
        vc,
    )
    loader = build_loader(
        DataConfig(default_dir=str(data), row_tokens=256, rows_per_batch=2, processor=proc), tok
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _, batch in zip(range(15), loader):
        out = model.train()(batch)
        opt.zero_grad()
        training_loss(out, batch, model.model_cfg).backward()
        opt.step()
        losses.append(lm_loss(out, batch).item())
    assert losses[-1] < losses[0]
    save_pretrained(model, tmp_path / "final", tok)

    rc = main(
        [
            "eval",
            "vqa",
            "--ckpt",
            str(tmp_path / "final"),
            "--data",
            str(data),
            "--batch-size",
            "8",
            "--out",
            str(tmp_path / "vqa.json"),
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "vqa.json").read_text())
    samples = list(iter_vqa_samples(str(data / "test" / "vqa-*.tar")))
    assert res["n"] == len(samples) > 0
    types = {s.question_type for s in samples}
    assert (
        set(res["accuracy"])
        == types | {"all"}
        == set(res["blind_baseline"])
        == set(res["majority_baseline"])
    )
    # the majority baseline is recomputed by hand from the train split's answers
    major = majority_answers(iter_vqa_samples(str(data / "train" / "vqa-*.tar")))
    hand = (
        sum(major[s.question_type] == normalize_answer(s.answer) for s in samples)
        / len(samples)
        * 100
    )
    assert abs(res["majority_baseline"]["all"] - hand) < 1e-9
    assert 0 <= res["accuracy"]["all"] <= 100
    assert res["compression"]["tokens/image"] > 0 and res["compression"]["compression/ratio"] >= 1
