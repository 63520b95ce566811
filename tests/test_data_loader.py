"""The packed loader: exact resume, rank/worker splitting, source mixing, packing efficiency."""

from __future__ import annotations

import io
import pickle
import shutil
from collections import Counter
from dataclasses import replace

import pytest
import torch

from configs.batch import PackedBatch
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.packing import select_rows
from data_pipelines.reader import resolve_shards
from data_pipelines.schema import Sample
from data_pipelines.stream import Mixer, SourceStream, split_range
from data_pipelines.tokenizer import ByteTokenizer
from data_pipelines.writer import ShardWriter

TOK = ByteTokenizer()


def _cfg(default_dir, **kw):
    base = dict(
        default_dir=str(default_dir),
        row_tokens=512,
        rows_per_batch=2,
        shuffle_buffer=32,
        pack_buffer=16,
    )
    return DataConfig(**{**base, **kw})


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_the_uninterrupted_batches(tiny_default, workers, batches_equal):
    cfg = _cfg(tiny_default, num_workers=workers)
    loader = build_loader(cfg, TOK)
    it = iter(loader)
    stream = [next(it) for _ in range(9)]
    del it
    # state after k=5 batches (odd: with 2 workers the second one is next), through
    # torch.save/torch.load(weights_only=True) as a checkpoint would
    loader2 = build_loader(cfg, TOK)
    it2 = iter(loader2)
    for _ in range(5):
        next(it2)
    del it2
    buf = io.BytesIO()
    torch.save(loader2.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    resumed = build_loader(cfg, TOK)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(4), resumed)]
    assert len(got) == 4 and all(batches_equal(a, b) for a, b in zip(stream[5:], got))
    assert any(b.pixel_patches is not None for b in got)
    assert not batches_equal(stream[4], stream[5])
    # iterating the same loader again continues where it stopped
    more = [b for _, b in zip(range(2), loader2)]
    assert batches_equal(more[0], stream[5]) and batches_equal(more[1], stream[6])


def test_resume_across_epoch_boundaries_and_with_split_text(
    tmp_path, batches_equal, write_text_shards
):
    write_text_shards(tmp_path / "a", 23, per_shard=5)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path / "a"))],
        row_tokens=16,
        rows_per_batch=3,
        shuffle_buffer=4,
        pack_buffer=3,
        long_text="split",
    )
    full = [b for _, b in zip(range(30), build_loader(cfg, TOK))]
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    moved = replace(cfg, sources=[SourceConfig(path=str(tmp_path / "moved"))])
    for k in (7, 19):
        ld = build_loader(cfg, TOK)
        [b for _, b in zip(range(k), ld)]
        st = pickle.loads(pickle.dumps(ld.state_dict()))
        # the data folder may move between runs
        again = build_loader(moved if k == 19 else cfg, TOK)
        again.load_state_dict(st)
        assert all(
            batches_equal(a, b) for a, b in zip(full[k:], [b for _, b in zip(range(30 - k), again)])
        )


def test_state_from_another_config_is_refused(tiny_default):
    ld = build_loader(_cfg(tiny_default), TOK)
    next(iter(ld))
    other = build_loader(_cfg(tiny_default, seed=1), TOK)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(ld.state_dict())


def test_split_ranges_cover_every_sample_once():
    counts = [7, 3, 11, 1, 9]
    for splits in (1, 2, 3, 4, 6, 31):
        seen = Counter()
        sizes = []
        for s in range(splits):
            segs = split_range(counts, s, splits)
            sizes.append(sum(g.stop - g.start for g in segs))
            seen.update((g.shard, i) for g in segs for i in range(g.start, g.stop))
        assert set(seen.values()) == {1} and len(seen) == sum(counts)
        assert max(sizes) - min(sizes) <= 1


def test_streams_cover_every_sample_once_per_epoch(tmp_path, write_text_shards):
    write_text_shards(tmp_path, 31, per_shard=7)
    paths = resolve_shards(tmp_path)
    counts = [7, 7, 7, 7, 3]
    refs = Counter()
    for split in range(6):  # 2 ranks x 3 workers
        st = SourceStream(0, paths, counts, split, 6, seed=3, shuffle_buffer=4, epochs=2)
        while (item := st.next()) is not None:
            refs[item[0]] += 1
    assert len(refs) == 31 and set(refs.values()) == {2}


def test_loader_ranks_and_workers_cover_every_sample_once(tmp_path, write_text_shards, decode_docs):
    texts = write_text_shards(tmp_path / "s", 40, per_shard=9)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path / "s"))],
        row_tokens=64,
        rows_per_batch=2,
        shuffle_buffer=5,
        pack_buffer=4,
        num_workers=2,
        epochs=1,
    )
    seen = Counter()
    for rank in range(2):
        for batch in build_loader(cfg, TOK, rank=rank, world_size=2):
            seen.update(decode_docs(batch, TOK))
    assert seen == Counter(texts)


def test_two_ranks_micro_batches_stack_into_one_ranks_batches_of_twice_the_rows(
    tiny_default, batches_equal
):
    """Rows are packed in one global order: rank 0 and rank 1's micro-batches of a round, stacked,
    are the micro-batch of one rank with twice the rows (the global batch of the old
    rank_split="rows", which the loader no longer reads)."""
    cfg = _cfg(tiny_default, rows_per_batch=2)
    single = [b for _, b in zip(range(3), build_loader(replace(cfg, rows_per_batch=4), TOK))]
    per_rank = [
        [b for _, b in zip(range(3), build_loader(cfg, TOK, rank=r, world_size=2))]
        for r in range(2)
    ]
    for k in range(3):
        joined = PackedBatch.stack([per_rank[0][k], per_rank[1][k]])
        assert batches_equal(joined, single[k])
    assert any(b.image_grids is not None for b in per_rank[1])


def test_select_rows_keeps_each_rows_images(tiny_default, batches_equal):
    (b,) = [b for _, b in zip(range(1), build_loader(_cfg(tiny_default, rows_per_batch=3), TOK))]
    parts = [select_rows(b, i, i + 1) for i in range(3)]
    assert batches_equal(PackedBatch.stack(parts), b)
    for p in parts:
        n = 0 if p.image_grids is None else int(p.image_grids.prod(1).sum())
        assert (p.pixel_patches is None and n == 0) or p.pixel_patches.shape[0] == n


def test_mixing_follows_weights_deterministically(tmp_path, write_text_shards):
    write_text_shards(tmp_path / "a", 30, per_shard=10, prefix="a")
    write_text_shards(tmp_path / "b", 30, per_shard=10, prefix="b")

    def picks(seed):
        streams = [
            SourceStream(i, resolve_shards(tmp_path / n), [10, 10, 10], 0, 1, seed, 8, None)
            for i, n in enumerate("ab")
        ]
        mixer = Mixer(streams, [3.0, 1.0], seed, 0)
        return [mixer.next()[0] for _ in range(2000)]

    a = picks(0)
    assert 0.72 < a.count(0) / len(a) < 0.78
    assert a == picks(0) and a != picks(1)


def test_packing_efficiency_on_default_data(tiny_default):
    ld = build_loader(_cfg(tiny_default, row_tokens=1024, rows_per_batch=4, pack_buffer=64), TOK)
    batches = [b for _, b in zip(range(12), ld)]
    valid = sum(int(b.valid.sum()) for b in batches)
    assert valid / sum(b.input_ids.numel() for b in batches) >= 0.97
    assert ld.packing_efficiency() >= 0.97 and ld.counters == {}
    kinds = {"image": any(b.image_grids is not None for b in batches)}
    assert kinds["image"] and "packing efficiency" in ld.report()


def test_a_source_of_one_sample_serves_any_number_of_ranks_and_workers(tmp_path, decode_docs):
    """Every rank plans the one global order: a source smaller than ranks x workers leaves none of
    them without data (the split loader refused it)."""
    with ShardWriter(tmp_path) as w:
        w.write(Sample(key="only", kind="text", text="one"))
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path))],
        num_workers=2,
        epochs=3,
        rows_per_batch=1,
        pack_buffer=1,
    )
    got = [decode_docs(b, TOK) for r in range(2) for b in build_loader(cfg, TOK, r, 2)]
    assert sorted(got) == [["one"]] * 3
    with pytest.raises(ValueError, match="matches no files"):
        build_loader(DataConfig(sources=[SourceConfig(path=str(tmp_path / "*.nothing"))]), TOK)
