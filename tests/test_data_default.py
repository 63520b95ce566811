"""The embedded default dataset: determinism, held-out combinations, answers consistent with scenes."""

from __future__ import annotations

import dataclasses
import io
import random

import pytest
from PIL import Image

from data_pipelines.chat import iter_vqa_samples
from data_pipelines.default_dataset import (
    build_default,
    default_info,
    default_sources,
    ensure_default_dataset,
)
from data_pipelines.reader import iter_shard, resolve_shards
from data_pipelines.scenes import (
    COLOURS,
    HELD_OUT,
    QUESTION_TYPES,
    SHAPES,
    caption,
    questions,
    relations,
    sample_scene,
)
from data_pipelines.schema import decode_sample


@pytest.fixture(scope="module")
def built(tmp_path_factory, TINY_DEFAULT):
    root = tmp_path_factory.mktemp("dd")
    a = build_default(root / "a", TINY_DEFAULT, progress=False)
    b = build_default(root / "b", TINY_DEFAULT, progress=False)
    c = build_default(root / "c", dataclasses.replace(TINY_DEFAULT, seed=1), progress=False)
    return a, b, c


def _files(d):
    return {
        p.relative_to(d).as_posix(): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != "default.json"
    }


def test_same_seed_same_bytes_other_seed_other_bytes(built):
    a, b, c = built
    fa, fb, fc = _files(a), _files(b), _files(c)
    assert len(fa) > 8 and fa == fb
    assert fa.keys() == fc.keys() and all(fa[k] != fc[k] for k in fa if k.endswith(".tar"))


def _samples(directory, pattern):
    out = []
    for p in resolve_shards(str(directory / pattern)):
        out += [decode_sample(raw) for _, raw in iter_shard(p)]
    return out


def test_layout_counts_and_sources(built):
    a = built[0]
    info = default_info(a)
    assert info["counts"]["train"] == {"vqa": 120, "caption": 120, "interleaved": 16, "text": 60}
    assert info["counts"]["test"] == {"vqa": 20, "caption": 20}
    srcs = default_sources(a, "train")
    assert sorted(s["name"] for s in srcs) == [
        "train/caption",
        "train/interleaved",
        "train/text",
        "train/vqa",
    ]
    assert len(_samples(a, "train/vqa-*.tar")) == 120
    inter = _samples(a, "train/interleaved-*.tar")
    assert all(
        s.kind == "interleaved" and s.placeholder_count() == len(s.images) >= 2 for s in inter
    )
    texts = _samples(a, "train/text-*.tar")
    assert all(s.kind == "text" and len(s.text) > 20 for s in texts)


def test_held_out_combinations_only_in_test(built):
    a = built[0]
    for split in ("train", "val"):
        for s in _samples(a, f"{split}/vqa-*.tar") + _samples(a, f"{split}/caption-*.tar"):
            combos = {(o["colour"], o["shape"]) for o in s.meta["scene"]["objects"]}
            assert not combos & HELD_OUT, (split, s.key)
    test = _samples(a, "test/vqa-*.tar")
    assert all(
        {(o["colour"], o["shape"]) for o in s.meta["scene"]["objects"]} & HELD_OUT for s in test
    )
    assert any(q["heldout"] for s in test for q in s.meta["qa"])


def test_answers_agree_with_scene_and_chat_layout(built):
    a = built[0]
    types = set()
    for s in _samples(a, "train/vqa-*.tar"):
        objs = s.meta["scene"]["objects"]
        assert s.turns[0]["content"].startswith("<image>\n") and len(s.turns) == 2 * len(
            s.meta["qa"]
        )
        for j, qa in enumerate(s.meta["qa"]):
            types.add(qa["type"])
            assert s.turns[2 * j + 1]["content"] == qa["answer"]
            if qa["question"] == "How many objects are there?":
                assert qa["answer"] == str(len(objs))
            if qa["type"] == "colour":
                assert qa["answer"] in COLOURS
            if qa["type"] == "shape":
                assert qa["answer"] in SHAPES
            if qa["type"] == "yesno":
                c, sh = qa["question"][len("Is there a ") : -1].split()
                assert qa["answer"] == (
                    "yes" if any((o["colour"], o["shape"]) == (c, sh) for o in objs) else "no"
                )
    assert types == set(QUESTION_TYPES)


def test_relation_sentences_agree_with_the_scene():
    """`relation_captions`: one sentence per pair sharing a row or column, true of the scene in
    either direction, in the position questions' answer words."""
    seen = set()
    for i in range(300):
        rng = random.Random(i)
        scene = sample_scene(rng, 64, 96, 4, heldout=False)
        cell = {(o.colour, o.shape): (o.row, o.col) for o in scene.objects}
        if len(cell) < len(scene.objects):
            continue  # two objects of one colour and shape: a sentence could name either
        sentences = [x for x in relations(rng, scene).split(".") if x.strip()]
        pairs = sum(
            a.row == b.row or a.col == b.col
            for k, a in enumerate(scene.objects)
            for b in scene.objects[k + 1 :]
        )
        assert len(sentences) == pairs
        for x in sentences:
            w = x.replace(",", "").split()  # Relative to the C2 S2 the C1 S1 is REL
            (r2, c2), (r1, c1) = cell[w[3], w[4]], cell[w[6], w[7]]
            rel = " ".join(w[9:])
            seen.add(rel)
            assert {
                "to the left": r1 == r2 and c1 < c2,
                "to the right": r1 == r2 and c1 > c2,
                "above": c1 == c2 and r1 < r2,
                "below": c1 == c2 and r1 > r2,
            }[rel], x
    assert seen == {"to the left", "to the right", "above", "below"}


def test_caption_samples_carry_one_relation_sentence_per_row_or_column_pair(
    built, tmp_path, TINY_DEFAULT
):
    """relation_captions (on by default): each caption sample is the scene's caption and then one
    sentence per pair of objects sharing a row or a column; off, the caption alone."""

    def pairs(objs):
        return sum(
            a["row"] == b["row"] or a["col"] == b["col"]
            for k, a in enumerate(objs)
            for b in objs[k + 1 :]
        )

    caps = _samples(built[0], "train/caption-*.tar")
    assert sum(pairs(c.meta["scene"]["objects"]) for c in caps) > 0
    for c in caps:
        assert c.text.count(".") == 1 + pairs(c.meta["scene"]["objects"]), c.text
    plain = build_default(
        tmp_path / "plain",
        dataclasses.replace(TINY_DEFAULT, relation_captions=False),
        progress=False,
    )
    assert all(c.text.count(".") == 1 for c in _samples(plain, "train/caption-*.tar"))


def test_scene_rendering_matches_description():
    rng = random.Random(5)
    scene = sample_scene(rng, 96, 96, 3, heldout=False)
    from data_pipelines.scenes import COLOURS as C
    from data_pipelines.scenes import render_scene

    img = Image.open(io.BytesIO(render_scene(scene))).convert("RGB")
    assert img.size == (96, 96)
    for o in scene.objects:  # the centre pixel of every object has its colour
        assert img.getpixel((int(o.cx), int(o.cy))) == C[o.colour]
    assert caption(scene).count(",") + caption(scene).count(" and ") == len(scene.objects) - 1
    qs = questions(random.Random(0), scene, 3, heldout=False)
    assert len({q["type"] for q in qs}) == len(qs) == 3


def test_ensure_default_is_idempotent_and_vqa_iterator(built, tmp_path, TINY_DEFAULT):
    a = built[0]
    before = (a / "default.json").stat().st_mtime_ns
    assert ensure_default_dataset(a, TINY_DEFAULT, progress=False) == a
    assert (a / "default.json").stat().st_mtime_ns == before
    vqa = list(iter_vqa_samples(a / "test"))
    assert len(vqa) == sum(len(s.meta["qa"]) for s in _samples(a, "test/vqa-*.tar"))
    v = vqa[0]
    assert v.prompt == f"<|user|><image>\n{v.question}<|end|><|assistant|>"
    assert Image.open(io.BytesIO(v.image)).size[0] >= 64 and v.question_type in QUESTION_TYPES
    assert len(list(iter_vqa_samples([a / "test"], limit=5))) == 5


def test_build_refuses_to_replace_a_foreign_folder(tmp_path, TINY_DEFAULT):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="refusing"):
        build_default(tmp_path, TINY_DEFAULT, progress=False)
    assert (tmp_path / "mine.txt").read_text() == "precious"
