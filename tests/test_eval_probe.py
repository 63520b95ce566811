"""`vlm eval probe`: an object's cell and two objects' relation, each continued from the caption before it."""

import io
import json

import torch
from PIL import Image

from data_pipelines.default_dataset import DefaultDatasetConfig, build_default
from data_pipelines.samples import iter_samples
from data_pipelines.scenes import CELL_PHRASE
from data_pipelines.tokenizer import load_tokenizer
from eval.caption_probe import probe_items, run_probes
from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig
from vision.navit import NaViTConfig
from vlm.cli import main
from vlm.model.config import ModelConfig, MoEConfig
from vlm.model.hf import save_pretrained
from vlm.model.multimodal import ConceptMoEVLM


def _items(tiny_default, limit=1000):
    return probe_items(iter_samples([str(tiny_default / "train" / "caption-*.tar")]), limit)


def test_each_item_stops_where_its_answer_starts(tiny_default):
    items = _items(tiny_default)
    cells = [it for it in items if it.kind == "cell"]
    rels = [it for it in items if it.kind == "relation"]
    assert cells and rels
    assert {it.answer for it in cells} <= set(CELL_PHRASE.values())
    assert {it.answer for it in rels} <= {"to the left", "to the right", "above", "below"}
    # both objects named before the relation, which the full caption continues with
    for it in rels:
        assert it.prefix.split(". ")[-1].startswith("Relative to the ") and it.prefix.endswith(
            " is"
        )
    caps = {
        s.images[0]: s.text for s in iter_samples([str(tiny_default / "train" / "caption-*.tar")])
    }
    for it in items:
        assert caps[it.image].replace("<image>", "").startswith(f"{it.prefix} {it.answer}")
    assert len(_items(tiny_default, limit=2)) == 4


class _Oracle:
    """Answers right when it is shown the image, wrong when blind."""

    # the first object's prefix ("A small red circle") recurs: the image tells them apart
    def __init__(self, items):
        self.answers = {
            (it.prefix, Image.open(io.BytesIO(it.image)).tobytes()): it.answer for it in items
        }

    def generate(self, prompts, images, max_new_tokens):
        if not images:
            return [" nothing"] * len(prompts)
        return [
            " " + self.answers[p.replace("<image>", ""), im[0].tobytes()] + " and"
            for p, im in zip(prompts, images)
        ]


class _Constant:
    def __init__(self, text):
        self.text = text

    def generate(self, prompts, images, max_new_tokens):
        return [self.text] * len(prompts)


def test_scores_tell_reading_from_guessing(tiny_default):
    items = _items(tiny_default)
    res = run_probes(_Oracle(items), items, batch_size=5)
    assert {k: (r["image"], r["blind"]) for k, r in res.items()} == {
        "cell": (100.0, 0.0),
        "relation": (100.0, 0.0),
    }
    rels = [it for it in items if it.kind == "relation"]
    share = 100.0 * sum(it.answer == "above" for it in rels) / len(rels)
    assert run_probes(_Constant(" above the"), rels)["relation"]["image"] == share


def test_probe_cli_on_a_tiny_checkpoint(tmp_path):
    data = build_default(
        tmp_path / "data",
        DefaultDatasetConfig(
            train_scenes=4, val_scenes=12, test_scenes=2, interleaved_docs=1, text_docs=2
        ),
        progress=False,
    )
    tok = load_tokenizer("byte")
    proc = ImageProcessorConfig(patch_size=8, min_patches=4, max_patches=16, merge=2)
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
        VisionConfig(
            processor=proc,
            encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16),
        ),
    )
    save_pretrained(model, tmp_path / "final", tok)
    assert (
        main(
            [
                "eval",
                "probe",
                "--ckpt",
                str(tmp_path / "final"),
                "--data",
                str(data),
                "--limit",
                "6",
                "--out",
                str(tmp_path / "probe.json"),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "probe.json").read_text())
    assert res["cell"]["n"] == 6 and 0 < res["relation"]["n"] <= 6
    assert all(0 <= r[k] <= 100 for r in res.values() for k in ("image", "blind", "majority"))
