"""Tokenizing, image expansion, packing and labels on hand-built samples (values counted by hand).

Legend: D width, P patches.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from configs.batch import IGNORE_INDEX, IMAGE, TEXT
from configs.config import ConfigError, from_dict
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.encode import encode_sample
from data_pipelines.packing import Packer, assemble_batch, best_subset, make_prompt_batch
from data_pipelines.schema import TOO_LONG, BadSample, Sample
from data_pipelines.tokenizer import ByteTokenizer
from vision.image_processor import ImageProcessor, ImageProcessorConfig

TOK = ByteTokenizer()
PROC = ImageProcessor(ImageProcessorConfig(patch_size=14, min_patches=4, max_patches=256, merge=2))
TEXT_DOC = Sample(key="t", kind="text", text="hi")


def _row(loss_on, png):
    chat = Sample(
        key="c",
        kind="pair",
        images=[png(56, 28)],
        turns=[{"role": "user", "content": "<image>\nQ"}, {"role": "assistant", "content": "a"}],
    )
    encs = [encode_sample(s, TOK, PROC, 64, loss_on)[0] for s in (chat, TEXT_DOC)]
    return encs, assemble_batch([encs], 24, TOK)


def test_layout_of_a_packed_row(png):
    encs, b = _row("assistant", png)
    t = TOK
    ids = [
        t.bos_id,
        t.user_id,
        t.image_start_id,
        t.image_pad_id,
        t.image_pad_id,
        t.image_end_id,
        10,
        ord("Q"),
        t.end_id,
        t.assistant_id,
        ord("a"),
        t.end_id,
        t.eos_id,
        t.bos_id,
        ord("h"),
        ord("i"),
        t.eos_id,
    ]
    assert PROC(png(56, 28)).grid == (2, 4) and PROC(png(56, 28)).num_tokens == 2
    assert b.input_ids[0, :17].tolist() == ids and (b.input_ids[0, 17:] == t.pad_id).all()
    assert b.doc_ids[0].tolist() == [0] * 13 + [1] * 4 + [-1] * 7
    assert b.position_ids[0, :17].tolist() == list(range(13)) + list(range(4))
    assert b.modality[0].tolist() == [TEXT] * 3 + [IMAGE] * 2 + [TEXT] * 19
    assert b.image_grids.tolist() == [[2, 4]] and b.pixel_patches.shape == (8, 3 * 14 * 14)
    assert b.patch_coords.tolist()[:5] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0]]
    X = IGNORE_INDEX
    # loss only on the answer ("a", <|end|>) and the final <eos> of the chat; the text doc is
    # all target
    assert (
        b.labels[0].tolist()
        == [
            X,
            X,
            X,
            X,
            X,
            X,
            X,
            X,
            X,
            ord("a"),
            t.end_id,
            t.eos_id,
            X,
            ord("h"),
            ord("i"),
            t.eos_id,
            X,
        ]
        + [X] * 7
    )


def test_labels_with_loss_on_all(png):
    _, b = _row("all", png)
    t, X = TOK, IGNORE_INDEX
    lab = b.labels[0].tolist()
    # bos -> <|user|> -> <image_start>; nothing is predicted into or out of the image, <image_end>
    # -> "\n"
    assert lab[:7] == [t.user_id, t.image_start_id, X, X, X, 10, ord("Q")]
    assert lab[12] == X and lab[16] == X  # document ends
    shifted = b.input_ids[0, 1:][b.labels[0, :-1] != X]
    assert torch.equal(shifted, b.labels[0, :-1][b.labels[0, :-1] != X])


def test_images_in_order_across_rows_and_samples(png):
    imgs = [png(28, 28, (i * 40, 0, 0)) for i in range(3)]
    s1 = Sample(key="a", kind="interleaved", text="x<image>y<image>z", images=imgs[:2])
    s2 = Sample(key="b", kind="pair", text="<image>w", images=imgs[2:])
    e1, e2 = (encode_sample(s, TOK, PROC, 64)[0] for s in (s1, s2))
    b = assemble_batch([[e1], [e2]], 32, TOK)
    expected = torch.cat([PROC(im).patches_PD for im in imgs])
    assert torch.equal(b.pixel_patches, expected)
    assert int((b.modality == IMAGE).sum()) == 3 * PROC(imgs[0]).num_tokens


def _text_of_len(n):
    return encode_sample(Sample(key=f"k{n}", kind="text", text="x" * (n - 2)), TOK, PROC, 100)[0]


def test_packer_fills_rows_exactly_and_keeps_fifo_opener():
    p = Packer(row_tokens=10, pack_buffer=8)
    for i, n in enumerate([6, 5, 4, 3, 3]):
        p.add(i, _text_of_len(n))
    rows = []
    while row := p.next_row():
        rows.append([ref for ref, _ in row])
    # the oldest opens each row, the rest is the best-filling subset: 6+4 | 5+3 | 3
    assert rows == [[0, 2], [1, 3], [4]]
    # greedy best fit would take 5 after the opener (3+5=8, then nothing fits); the subset search
    # finds 3+4+4
    p = Packer(row_tokens=11, pack_buffer=8)
    for i, n in enumerate([3, 5, 4, 4]):
        p.add(i, _text_of_len(n))
    assert [ref for ref, _ in p.next_row()] == [0, 2, 3]
    lens = np.array([7, 3, 9, 5, 2])
    assert sum(lens[best_subset(lens, 13)]) == 12 and sum(lens[best_subset(lens, 14)]) == 14
    assert sum(lens[best_subset(lens, 1)]) == 0
    assert best_subset(np.array([11, 12]), 10) == []
    rng = np.random.default_rng(0)
    for _ in range(40):  # optimal against brute force
        lens, room = rng.integers(1, 30, size=int(rng.integers(1, 9))), int(rng.integers(1, 60))
        best = max(
            sum(c)
            for k in range(len(lens) + 1)
            for c in itertools.combinations(lens.tolist(), k)
            if sum(c) <= room
        )
        pick = best_subset(lens, room)
        assert sum(lens[pick]) == best and len(set(pick)) == len(pick)
    with pytest.raises(ValueError, match="exceed"):
        p.add(9, encode_sample(Sample(key="big", kind="text", text="x" * 20), TOK, PROC, 30)[0])


def test_long_samples(png):
    long_text = Sample(key="l", kind="text", text="y" * 50)
    (cut,) = encode_sample(long_text, TOK, PROC, 20, long_text="truncate")
    assert len(cut) == 20 and cut.truncated and cut.ids[0] == TOK.bos_id
    pieces = encode_sample(long_text, TOK, PROC, 20, long_text="split")
    assert [len(p) for p in pieces] == [20, 20, 12] and pieces[-1].ids[-1] == TOK.eos_id
    big = Sample(key="b", kind="pair", text="<image>caption", images=[png(400, 400)])
    with pytest.raises(BadSample) as e:
        encode_sample(big, TOK, PROC, 32)
    assert e.value.reason == TOO_LONG
    # images fit but the caption does not: the caption is cut
    (s,) = encode_sample(
        Sample(key="c", kind="pair", text="<image>" + "z" * 40, images=[png(28, 28)]), TOK, PROC, 16
    )
    assert len(s) == 16 and s.truncated


def test_prompt_batch_for_generation(png):
    b = make_prompt_batch(
        [("<|user|><image>\nWhat?<|end|><|assistant|>", [png(28, 28)]), ("<|user|>hi<|end|>", [])],
        TOK,
        PROC,
    )
    assert b.input_ids.shape[0] == 2 and b.image_grids.tolist() == [[2, 2]]
    n0 = int((b.doc_ids[0] >= 0).sum())
    # ends with the generation prompt, no <eos>
    assert b.input_ids[0, n0 - 1].item() == TOK.assistant_id


def test_data_config_validation(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "s-0.tar").touch()
    shards, x = str(tmp_path / "a" / "*.tar"), str(tmp_path / "a" / "s-0.tar")
    cfg = from_dict(
        DataConfig,
        {
            "sources": [{"path": shards, "weight": 2}],
            "row_tokens": 512,
            "processor": {"max_patches": 64},
        },
    )
    assert isinstance(cfg.sources[0], SourceConfig) and cfg.processor.max_patches == 64
    for bad, msg in [
        ({"row_tokens": 2}, "row_tokens"),
        ({"loss_on": "user"}, "loss_on"),
        ({"sources": [{"path": x, "weight": 0}]}, "weight"),
        ({"shufle_buffer": 3}, "unknown key"),
        ({"sources": [{"path": x}, {"path": x}]}, "unique"),
        ({"sources": [{"path": str(tmp_path / "b" / "*.tar")}]}, "matches no files"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            from_dict(DataConfig, bad)
