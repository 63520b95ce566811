"""A rank's loader costs what its own micro-batches cost, not what the world's do (issue 49's done-when,
at a size the suite affords): on a LLaVA-like mix (chat about photo-like JPEGs, text documents), rank
0 of 64 reads at most 1.5x the bytes rank 0 of 1 reads, and decodes at most 1.5x the samples, for the
same number of its own micro-batches, though it plans 64 times as many. Planning's work is counted
as the index entries it takes; CPU time, too noisy for a test on a shared machine, is what
`vlm bench loader --world-size M --rank R` reports (docs/training.md)."""

from __future__ import annotations

import itertools

import pytest

from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.schema import Sample
from data_pipelines.tokenizer import ByteTokenizer
from data_pipelines.writer import ShardWriter
from vision.image_processor import ImageProcessorConfig

TOK = ByteTokenizer()
OWN = 3  # micro-batches of rank 0's own, at either world size


@pytest.fixture(scope="module")
def llava_like(tmp_path_factory):
    from eval.bench.llava_mix import write_llava_mix

    root = tmp_path_factory.mktemp("llava_like")
    write_llava_mix(root / "chat", 240, 10, min_side=336, max_side=512, per_shard=40)
    with ShardWriter(root / "text", "text", max_count=40) as w:
        for i in range(120):
            words = "a document of plain text to pack between the pictures " * (3 + i % 30)
            w.write(Sample(key=f"t{i:04d}", kind="text", text=f"document {i}: {words}"))
    # configs/gpu.yaml's processor and buffers' shape, at a row size the suite affords
    return DataConfig(
        sources=[
            SourceConfig(path=str(root / "chat"), weight=3.0, name="chat"),
            SourceConfig(path=str(root / "text"), weight=1.0, name="text"),
        ],
        row_tokens=2048,
        rows_per_batch=2,
        shuffle_buffer=64,
        pack_buffer=16,
        processor=ImageProcessorConfig(min_patches=16, max_patches=1024),
    )


def _rank0(cfg: DataConfig, world: int):
    loader = build_loader(cfg, TOK, 0, world)
    batches = list(itertools.islice(loader, OWN))
    return batches, loader.io


def test_rank_0_of_64_reads_and_decodes_what_rank_0_of_1_does(llava_like, batches_equal):
    build_loader(llava_like, TOK)  # the index's first build (once per dataset and tokenizer)
    one, io1 = _rank0(llava_like, 1)
    many, io64 = _rank0(llava_like, 64)
    assert batches_equal(one[0], many[0])  # micro-batch 0 is rank 0's first at any world size
    assert any(b.image_grids is not None for b in one + many)
    read1 = io1["shard_bytes"] + io1["index_bytes"]
    read64 = io64["shard_bytes"] + io64["index_bytes"]
    assert read64 <= 1.5 * read1, (
        f"rank 0 of 64 read {read64:,} bytes for {OWN} micro-batches of its own, rank 0 of 1 "
        f"{read1:,}: reading grows with the ranks"
    )
    assert io64["samples_decoded"] <= 1.5 * io1["samples_decoded"], (
        f"rank 0 of 64 decoded {io64['samples_decoded']} samples, rank 0 of 1 "
        f"{io1['samples_decoded']}: ranks decode others' samples"
    )
    # it did plan the 64 micro-batches of each round, from the index alone: an entry or more each
    assert io64["index_entries"] >= 64 * OWN > io1["index_entries"]


def test_bench_loader_measures_rank_r_of_m(tmp_path):
    """`vlm bench loader --world-size M --rank R` builds rank R of M's loader and reports its CPU
    time and bytes read per micro-batch of its own."""
    import json

    from vlm.cli import main

    assert (
        main(
            [
                "bench",
                "loader",
                "--smoke",
                "--world-size",
                "4",
                "--rank",
                "3",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "loader.json").read_text())
    assert res["settings"]["world_size"] == 4 and res["settings"]["rank"] == 3
    rows = {r["metric"]: r for r in res["rows"] if r["candidate"] == "workers=0"}
    assert rows["CPU-seconds per micro-batch"]["setting"]["world_size"] == 4
    assert rows["CPU-seconds per micro-batch"]["median"] > 0
    assert rows["MB read per micro-batch"]["median"] > 0
    assert rows["MB read per micro-batch"]["index_entries_per_micro_batch"] > 0
