"""`data.default_parts`: which parts of the embedded default dataset (vqa, caption, interleaved,
text) a run mixes.

Empty means all of the split's parts; a subset keeps only those sources (e.g. [text] for a text-only
stage, [caption] for an alignment stage). Unknown names and combining it with `data.sources` are
config errors.
"""

from __future__ import annotations

import pytest

from configs.batch import IMAGE, TEXT
from configs.config import ConfigError, from_dict
from data_pipelines.config import DataConfig
from data_pipelines.loader import build_loader, resolve_sources
from data_pipelines.reader import ShardError
from data_pipelines.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _cfg(data_dir, **kw) -> DataConfig:
    base = dict(
        default_dir=str(data_dir),
        row_tokens=256,
        rows_per_batch=2,
        shuffle_buffer=8,
        pack_buffer=8,
        num_workers=0,
    )
    return DataConfig(**{**base, **kw})


def _batches(cfg: DataConfig, n: int):
    it = iter(build_loader(cfg, TOK))
    return [next(it) for _ in range(n)]


def test_resolve_sources_keeps_only_the_named_parts(tiny_data):
    def labels(cfg):
        return sorted(s.label for s in resolve_sources(cfg))

    assert labels(_cfg(tiny_data)) == [
        "train/caption",
        "train/interleaved",
        "train/text",
        "train/vqa",
    ]
    assert labels(_cfg(tiny_data, default_parts=["text"])) == ["train/text"]
    assert labels(_cfg(tiny_data, default_parts=["vqa", "caption"])) == [
        "train/caption",
        "train/vqa",
    ]
    # the split still applies: val has no interleaved part, so only its captions remain
    assert labels(_cfg(tiny_data, split="val", default_parts=["caption", "interleaved"])) == [
        "val/caption"
    ]


def test_text_part_gives_text_only_batches(tiny_data):
    batches = _batches(_cfg(tiny_data, default_parts=["text"]), 4)
    for b in batches:
        assert b.pixel_patches is None and b.image_grids is None
        assert bool((b.modality[b.valid] == TEXT).all())
        assert b.valid.any()


def test_all_parts_by_default_include_images(tiny_data):
    """The contrast to the text-only case: without default_parts the same loader sees images."""
    batches = _batches(_cfg(tiny_data), 4)
    assert any(b.pixel_patches is not None for b in batches)


def test_caption_part_gives_image_batches(tiny_data):
    batches = _batches(_cfg(tiny_data, default_parts=["caption"]), 3)
    for b in batches:  # every caption sample has an image
        assert b.pixel_patches is not None and b.image_grids.shape[0] >= 1
        assert bool((b.modality[b.valid] == IMAGE).any())


def test_split_without_the_part_is_a_clear_error(tiny_data):
    with pytest.raises(ShardError, match="default_parts"):
        resolve_sources(_cfg(tiny_data, split="test", default_parts=["text"]))


@pytest.mark.parametrize("parts", [["txt"], ["text", "images"], ["VQA"]])
def test_unknown_part_names_the_allowed_values(parts):
    with pytest.raises(ConfigError) as e:
        DataConfig(default_parts=parts).validate()
    msg = str(e.value)
    assert "default_parts" in msg and "vqa, caption, interleaved, text" in msg, msg


def test_default_parts_with_sources_is_an_error(tiny_data):
    src = {"path": str(tiny_data / "train" / "text-*.tar"), "name": "mine"}
    with pytest.raises(ConfigError, match="default_parts.*sources"):
        from_dict(DataConfig, {"sources": [src], "default_parts": ["text"]})
    from_dict(DataConfig, {"sources": [src]}).validate()  # each alone is fine
    from_dict(DataConfig, {"default_parts": ["text"]}).validate()


def test_train_config_reports_the_dotted_key(tmp_path, TINY, write_config):
    from vlm.train.config import load_train_config

    cfg = dict(TINY, data={**TINY["data"], "default_parts": ["pictures"]})
    with pytest.raises(
        ConfigError,
        match=r"data.*default_parts.*'pictures'.*allowed: vqa, caption, interleaved, text",
    ):
        load_train_config(write_config(cfg, tmp_path / "c.yaml"))
