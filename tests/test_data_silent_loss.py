"""No silent loss: every sample a broken, rewritten or deleted shard loses is counted under its true reason."""

from __future__ import annotations

import gzip
import json
import tarfile
from collections import Counter

import pytest

from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.reader import iter_shard
from data_pipelines.schema import BadSample
from data_pipelines.tokenizer import ByteTokenizer
from data_pipelines.writer import MANIFEST

TOK = ByteTokenizer()


def _outcome(path, expected=None):
    return [
        (i, r.reason if isinstance(r, BadSample) else r["__key__"])
        for i, r in iter_shard(path, expected=expected)
    ]


@pytest.fixture
def text_shard(write_text_shards):
    """text_shard(tmp_path, n=5) -> (path, bytes, tar members) of one shard of n text samples."""

    def make(tmp_path, n=5):
        write_text_shards(tmp_path, n, per_shard=n)
        path = tmp_path / "t-000000.tar"
        return path, path.read_bytes(), tarfile.open(path).getmembers()

    return make


@pytest.fixture
def load_all(decode_docs):
    """load_all(tmp_path, workers=0) -> (documents seen, loader counters) of one epoch over the folder."""

    def load(tmp_path, workers=0):
        cfg = DataConfig(
            sources=[SourceConfig(path=str(tmp_path))],
            row_tokens=64,
            rows_per_batch=1,
            epochs=1,
            shuffle_buffer=0,
            num_workers=workers,
        )
        loader = build_loader(cfg, TOK)
        seen = Counter()
        for batch in loader:
            seen.update(decode_docs(batch, TOK))
        return seen, loader.counters

    return load


def _set_manifest(tmp_path, **changes):
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["shards"][0].update(changes)
    (tmp_path / MANIFEST).write_text(json.dumps(m))


def test_a_cut_inside_a_header_keeps_the_whole_sample_before_it(tmp_path, text_shard):
    path, data, members = text_shard(tmp_path)
    # inside sample 2's header, its name readable
    path.write_bytes(data[: members[2].offset + 100])
    assert _outcome(path, expected=5) == [
        (0, "t00000"),
        (1, "t00001"),
        (2, "unreadable_member"),
        (3, "truncated_shard"),
        (4, "truncated_shard"),
    ]
    assert _outcome(path) == [
        (0, "t00000"),
        (1, "t00001"),
        (2, "unreadable_member"),
        (-1, "truncated_shard"),
    ]


def test_a_cut_at_a_member_boundary_is_not_mistaken_for_the_end(tmp_path, text_shard):
    path, data, members = text_shard(tmp_path)
    # no header after sample 2: it may be partial
    path.write_bytes(data[: members[3].offset])
    assert _outcome(path) == [
        (0, "t00000"),
        (1, "t00001"),
        (2, "unreadable_member"),
        (-1, "truncated_shard"),
    ]


def test_a_compressed_shard_cut_short_is_counted(tmp_path, text_shard):
    path, data, members = text_shard(tmp_path)
    gz = tmp_path / "t-000000.tar.gz"
    # a gzip stream that is whole, of a broken tar
    gz.write_bytes(gzip.compress(data[: members[3].offset]))
    path.unlink()
    assert _outcome(gz)[-1] == (-1, "truncated_shard")
    gz.write_bytes(gzip.compress(data))
    assert _outcome(gz) == [(i, f"t0000{i}") for i in range(5)]


def test_truncated_shard_in_the_loader_counts_what_its_manifest_promised(
    tmp_path, text_shard, load_all
):
    path, data, members = text_shard(tmp_path)
    path.write_bytes(data[: members[2].offset_data + 10])  # the manifest still promises 5
    seen, counters = load_all(tmp_path)
    assert seen == Counter(["doc 0 ", "doc 1 x"])
    assert counters == {"truncated_shard": 2, "unreadable_member": 1}


@pytest.mark.parametrize("workers", [0, 2])
def test_truncated_shard_without_manifest_is_counted_once(tmp_path, workers, text_shard, load_all):
    path, data, members = text_shard(tmp_path)
    path.write_bytes(data[: members[2].offset_data + 10])
    (tmp_path / MANIFEST).unlink()
    seen, counters = load_all(tmp_path, workers)
    assert sum(seen.values()) == 2 and counters == {"truncated_shard": 1, "unreadable_member": 1}


@pytest.mark.parametrize("promised, read, lost", [(3, 3, 2), (7, 5, 2)])
def test_a_manifest_count_that_disagrees_with_an_intact_shard_is_counted(
    tmp_path, promised, read, lost, text_shard, load_all
):
    text_shard(tmp_path)
    # file_bytes still matches: the count is believed
    _set_manifest(tmp_path, count=promised)
    seen, counters = load_all(tmp_path)
    assert sum(seen.values()) == read and counters == {"manifest_mismatch": lost}


def test_a_rewritten_shard_is_recounted_not_believed(tmp_path, text_shard, load_all):
    path, _, _ = text_shard(tmp_path)
    _set_manifest(tmp_path, count=3, file_bytes=path.stat().st_size + 512)
    seen, counters = load_all(tmp_path)
    assert sum(seen.values()) == 5 and counters == {}


def test_a_deleted_shard_listed_in_the_manifest_is_counted_per_sample(
    tmp_path, load_all, write_text_shards
):
    write_text_shards(tmp_path, 9, per_shard=3)
    (tmp_path / "t-000001.tar").unlink()
    seen, counters = load_all(tmp_path)
    assert sum(seen.values()) == 6 and counters == {"missing_shard": 3}


def test_stats_name_a_deleted_shard_and_count_a_broken_one(tmp_path, write_text_shards):
    from data_pipelines.stats import collect_stats, format_stats

    write_text_shards(tmp_path, 9, per_shard=3)
    (tmp_path / "t-000001.tar").unlink()
    data = (tmp_path / "t-000002.tar").read_bytes()
    (tmp_path / "t-000002.tar").write_bytes(data[: len(data) // 4])
    result = collect_stats([tmp_path], scan=True)
    assert result["missing"] == [str(tmp_path / "t-000001.tar")]
    assert "t-000001.tar (listed in its manifest, not on disk)" in format_stats(result)
    assert result["bad"].get("truncated_shard") == 1
