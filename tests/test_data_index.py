"""The loader's index (data_pipelines.index): written with every shard, built once for shards made
elsewhere (beside them, or in a cache folder where their folder is read-only), rebuilt when a shard
changes; planning reads no shard, and a rank reads only the bytes of its own samples."""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from dataclasses import replace

import pytest

from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.index import Catalog
from data_pipelines.index_file import MAGIC, IndexFile
from data_pipelines.index_layers import INDEX_DIR, shard_stat
from data_pipelines.loader import build_loader
from data_pipelines.schema import Sample
from data_pipelines.tokenizer import ByteTokenizer
from data_pipelines.writer import ShardWriter
from vision.image_processor import ImageProcessor

TOK = ByteTokenizer()


def _cfg(path, **kw) -> DataConfig:
    base = dict(row_tokens=64, rows_per_batch=2, shuffle_buffer=4, pack_buffer=4, epochs=1)
    return DataConfig(sources=[SourceConfig(path=str(path))], **{**base, **kw})


def _settle(folder) -> None:
    """Date the shards back: the loader keeps no index of a shard changed in the last seconds."""
    old = time.time() - 60
    for p in folder.glob("*.tar"):
        os.utime(p, (old, old))


def _docs(cfg, decode_docs, rank=0, world=1) -> tuple[Counter, dict, dict]:
    loader = build_loader(cfg, TOK, rank, world)
    seen = Counter()
    for batch in loader:
        seen.update(decode_docs(batch, TOK))
    return seen, loader.counters, loader.io


def test_the_writer_indexes_each_shard_and_a_second_loader_reads_no_shard_to_plan(
    tmp_path, write_text_shards, decode_docs
):
    texts = write_text_shards(tmp_path, 20, per_shard=7)
    index = sorted(p.name for p in (tmp_path / INDEX_DIR).iterdir())
    assert index == [f"t-00000{i}.tar.samples.idx" for i in range(3)]
    with IndexFile(tmp_path / INDEX_DIR / index[0]) as f:
        assert f.header["version"] == 1 and f.header["groups"] == 7
    assert (tmp_path / INDEX_DIR / index[0]).read_bytes().startswith(MAGIC)
    seen, counters, io = _docs(_cfg(tmp_path), decode_docs)
    assert seen == Counter(texts) and counters == {}
    # the first loader built the tokens layer from the samples layer: the text members only
    files = {p.name for p in (tmp_path / INDEX_DIR).iterdir()}
    assert (
        sum(".tokens-" in n for n in files) == 3 and sum(n.startswith("ready.") for n in files) == 1
    )
    # a second loader plans from the index alone: it reads each sample's bytes once, to train on it
    loader = build_loader(_cfg(tmp_path), TOK)
    assert loader.io.get("shard_bytes", 0) == 0, "building the loader read shards"
    list(loader)
    sizes = 0
    for f in sorted((tmp_path / INDEX_DIR).glob("*.samples.idx")):
        with IndexFile(f) as idx:
            sizes += int((idx.array("end") - idx.array("start")).sum())
    assert loader.io["shard_bytes"] == sizes and loader.io["samples_decoded"] == 20


def test_shards_made_elsewhere_are_indexed_once_and_again_when_they_change(
    tmp_path, write_text_shards, decode_docs
):
    texts = write_text_shards(tmp_path, 12, per_shard=6)
    for p in (tmp_path / INDEX_DIR).iterdir():  # as shards made by another tool
        p.unlink()
    _settle(tmp_path)
    seen, _, io = _docs(_cfg(tmp_path), decode_docs)
    assert seen == Counter(texts) and io["samples_decoded"] == 12 + 12  # indexed, then trained on
    assert (tmp_path / INDEX_DIR / "t-000000.tar.samples.idx").is_file()
    _, _, io = _docs(_cfg(tmp_path), decode_docs)
    assert io["samples_decoded"] == 12, "a second loader indexed the shards again"
    # one shard rewritten with other samples: its index no longer holds, and is built again
    with ShardWriter(tmp_path, "t", max_count=6, start_index=1) as w:
        for i in range(6):
            w.write(Sample(key=f"new{i}", kind="text", text=f"rewritten {i}"))
    (tmp_path / INDEX_DIR / "t-000001.tar.samples.idx").unlink()  # the writer's own would hold
    _settle(tmp_path)
    seen, _, _ = _docs(_cfg(tmp_path), decode_docs)
    assert seen == Counter(texts[:6] + [f"rewritten {i}" for i in range(6)])


def test_an_unsettled_shard_is_indexed_but_its_index_is_not_kept(tmp_path, decode_docs):
    """A shard changed in the last seconds may change again within its timestamp's resolution: the
    loader uses what it builds of it but keeps nothing."""
    import tarfile

    with tarfile.open(tmp_path / "x.tar", "w") as tf:
        for i in range(3):
            data = f"fresh {i}".encode()
            ti = tarfile.TarInfo(f"k{i}.txt")
            ti.size = len(data)
            tf.addfile(ti, __import__("io").BytesIO(data))
    seen, counters, _ = _docs(_cfg(tmp_path), decode_docs)
    assert seen == Counter(f"fresh {i}" for i in range(3)) and counters == {}
    assert not (tmp_path / INDEX_DIR / "x.tar.samples.idx").exists()


def test_a_shard_folder_that_takes_no_index_keeps_it_in_the_cache_folder(
    tmp_path, write_text_shards, decode_docs
):
    data = tmp_path / "data"
    texts = write_text_shards(data, 10, per_shard=5)
    for p in (data / INDEX_DIR).iterdir():
        p.unlink()
    (data / INDEX_DIR).rmdir()
    (data / INDEX_DIR).write_text("in the way")  # as a folder that cannot be written, for root too
    _settle(data)
    cache = tmp_path / "cache"
    cfg = _cfg(data, index_cache=str(cache))
    seen, _, io = _docs(cfg, decode_docs)
    assert seen == Counter(texts) and (data / INDEX_DIR).read_text() == "in the way"
    (folder,) = cache.iterdir()
    assert (folder / "t-000000.tar.samples.idx").is_file()
    _, _, io = _docs(cfg, decode_docs)
    assert io["samples_decoded"] == 10, "the cached index was not used"


def test_an_index_file_that_is_not_one_is_built_again(tmp_path, write_text_shards, decode_docs):
    texts = write_text_shards(tmp_path, 8, per_shard=8)
    target = tmp_path / INDEX_DIR / "t-000000.tar.samples.idx"
    for junk in (
        b"",
        b"VLMINDEX\xff\xff\xff\x7f{",
        b"not an index",
        MAGIC + b"\x05\x00\x00\x00[1,2]",
    ):
        target.write_bytes(junk)
        seen, counters, _ = _docs(_cfg(tmp_path), decode_docs)
        assert seen == Counter(texts) and counters == {}


def test_a_sample_that_changed_after_it_was_planned_leaves_its_row_and_is_counted_once(
    tmp_path, decode_docs
):
    """Planning trusts the index; the rank that trains on a sample reads its bytes, and a sample
    that no longer is what its entry says (here its JSON cut into garbage in place) leaves its row
    as padding and is counted by that rank, whatever the number of ranks."""
    texts = [f"sample number {i} " + "z" * 20 for i in range(8)]
    with ShardWriter(tmp_path, "s") as w:
        for i, t in enumerate(texts):
            w.write(Sample(key=f"s{i}", kind="text", text=t))
    _settle(tmp_path)
    path = tmp_path / "s-000000.tar"
    original = path.read_bytes()
    at = original.index(b"sample number 6")

    def run(world: int) -> tuple[Counter, Counter]:
        path.write_bytes(original)
        _settle(tmp_path)
        cfg = _cfg(tmp_path, row_tokens=64, rows_per_batch=1, shuffle_buffer=0, pack_buffer=1)
        loaders = [build_loader(cfg, TOK, r, world) for r in range(world)]
        iters = [iter(ld) for ld in loaders]
        seen = Counter()
        for it in iters:  # every rank has planned (opened the shard's index) before the change
            seen.update(decode_docs(next(it), TOK))
        path.write_bytes(original[:at] + b"\x00garbage" + original[at + 8 :])  # same size
        for it in iters:
            for batch in it:
                seen.update(decode_docs(batch, TOK))
        counts = Counter()
        for ld in loaders:
            counts.update(ld.counters)
        return seen, counts

    for world in (1, 2):
        seen, counts = run(world)
        assert seen == Counter(texts[:6] + texts[7:]), world
        assert counts == {"bad_json": 1}, world


def test_catalog_counts_a_shard_without_a_manifest_from_its_index(tmp_path, write_text_shards):
    write_text_shards(tmp_path, 9, per_shard=9)
    (tmp_path / "manifest.json").unlink()
    _settle(tmp_path)
    cat = Catalog(TOK, ImageProcessor())
    assert cat.count(tmp_path / "t-000000.tar") == (9, False)
    assert cat.io.get("shard_bytes", 0) == 0  # the writer's index says it
    assert shard_stat(tmp_path / "t-000000.tar")[0] == (tmp_path / "t-000000.tar").stat().st_size


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_read_only_their_own_samples(tmp_path, write_text_shards, workers):
    write_text_shards(tmp_path, 60, per_shard=10)
    cfg = replace(_cfg(tmp_path, epochs=None, shuffle_buffer=8), num_workers=workers)
    build_loader(cfg, TOK)  # the first build of the index, shared
    reads = {}
    for world in (1, 4):
        loader = build_loader(cfg, TOK, 0, world)
        list(itertools.islice(loader, 3))
        reads[world] = loader.io
    assert reads[4]["samples_decoded"] <= reads[1]["samples_decoded"] * 1.5
    assert reads[4]["shard_bytes"] <= reads[1]["shard_bytes"] * 1.5
    assert reads[4]["index_entries"] > 3 * reads[1]["index_entries"]  # it planned 4x the batches
