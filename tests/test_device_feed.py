"""The device feed: the loader's batches reach the device unchanged (ahead of the step on CUDA),
and the time the step waited for the loader is measured."""

from __future__ import annotations

import time

import pytest
import torch

from configs.batch import PackedBatch
from data_pipelines.config import DataConfig
from data_pipelines.loader import build_loader
from data_pipelines.tokenizer import ByteTokenizer
from vlm.train.device_feed import DeviceFeed, prepare

TOK = ByteTokenizer()


def _batches(tiny_default, n):
    cfg = DataConfig(default_dir=str(tiny_default), row_tokens=256, rows_per_batch=2)
    return [b for _, b in zip(range(n), build_loader(cfg, TOK))]


def test_cpu_feed_hands_over_the_loaders_batches(tiny_default, batches_equal):
    host = _batches(tiny_default, 4)
    assert any(b.pixel_patches is not None for b in host), "no image in the loader's 4 batches"
    got = list(DeviceFeed(iter(host), "cpu", torch.bfloat16, depth=3))
    assert len(got) == 4, f"the feed handed over {len(got)} of the loader's 4 batches"
    differ = [i for i, (a, b) in enumerate(zip(host, got)) if not batches_equal(a, b)]
    assert not differ, f"batches {differ} changed on their way through the feed"
    # uint8 pixels are not cast: the tower normalises them
    dtypes = {b.pixel_patches.dtype for b in got if b.pixel_patches is not None}
    assert dtypes == {torch.uint8}, f"pixels reached the step as {dtypes}, not uint8"


def test_normalised_float_pixels_are_cast_to_the_run_dtype():
    b = PackedBatch.from_documents([[5, 6, 7]])
    b.pixel_patches = torch.zeros(4, 12)
    assert prepare(b, torch.device("cpu"), torch.bfloat16).pixel_patches.dtype == torch.bfloat16


def test_the_wait_for_the_loader_is_measured():
    def slow():
        for _ in range(3):
            time.sleep(0.05)
            yield PackedBatch.from_documents([[1, 2, 3]])

    feed = DeviceFeed(slow(), "cpu")
    next(feed)
    assert 0.04 < feed.take_wait() < 1.0
    assert feed.take_wait() == 0.0  # read: counted once
    assert len(list(feed)) == 2 and feed.take_wait() > 0.08


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_feed_copies_ahead_from_pinned_memory(tiny_default, batches_equal):
    host = _batches(tiny_default, 5)
    feed = DeviceFeed(iter(host), "cuda", torch.bfloat16, depth=2)
    first = next(feed)
    assert len(feed.ready) == 2  # the next two are on their way while the first is used
    got = [first, *feed]
    on_host = [i for i, b in enumerate(got) if not b.input_ids.is_cuda]
    assert not on_host, f"batches {on_host} were not moved to the GPU"
    differ = [i for i, (a, b) in enumerate(zip(host, got)) if not batches_equal(a, b.to("cpu"))]
    assert not differ, f"batches {differ} changed on their way to the GPU (a copy not waited for?)"
