"""Shard sources as URLs webdataset understands (`pipe:CMD`, `http://...`, `file:PATH`): the same
samples in the same order as the local files, exact resume, counting by streaming, clear errors,
breaks counted as locally."""

from __future__ import annotations

import argparse
import functools
import gzip
import io
import re
import tarfile
import threading
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from rank_processes import free_port

from configs.config import ConfigError
from data_pipelines.cli import add_data_commands
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.reader import ShardError, iter_shard, resolve_shards, shard_counts
from data_pipelines.schema import BadSample
from data_pipelines.stats import collect_stats
from data_pipelines.tokenizer import ByteTokenizer
from data_pipelines.writer import MANIFEST

TOK = ByteTokenizer()
N, PER_SHARD = 23, 8  # shard-000000.tar (8), -000001 (8), -000002 (7)
BRACES = "shard-{000000..000002}.tar"


@pytest.fixture
def shards(tmp_path, write_text_shards):
    """(folder, texts) of three small text shards written by the project's ShardWriter (with manifest.json)."""
    d = tmp_path / "shards"
    return d, write_text_shards(d, N, per_shard=PER_SHARD, prefix="shard")


@pytest.fixture
def http_server():
    """http_server(folder) -> (base URL, request log): the folder served on 127.0.0.1 (a free port)."""
    servers, log = [], []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args):  # quiet; remember what was asked for
            log.append((self.command, self.path))

    def serve(folder):
        srv = ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=str(folder))
        )
        threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}", log

    yield serve
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _cfg(path, **kw):
    base = dict(
        sources=[SourceConfig(path=str(path))],
        row_tokens=64,
        rows_per_batch=2,
        shuffle_buffer=5,
        pack_buffer=3,
        epochs=1,
        seed=7,
    )
    return DataConfig(**{**base, **kw})


def _raw(pattern):
    """Every raw sample of a source, in order, without the `__url__` member (which names where it came from)."""
    return [
        {k: v for k, v in raw.items() if k != "__url__"}
        for p in resolve_shards(pattern)
        for _, raw in iter_shard(p)
    ]


def _same_batches(a, b, batches_equal):
    return len(a) == len(b) > 0 and all(batches_equal(x, y) for x, y in zip(a, b))


def test_pipe_urls_give_the_local_samples_in_the_same_order(shards, batches_equal):
    d, texts = shards
    url = f"pipe:cat {d}/{BRACES}"
    # webdataset's expansion
    assert resolve_shards(url) == [f"pipe:cat {d}/shard-00000{i}.tar" for i in range(3)]
    # no manifest for a command: counted by streaming
    assert shard_counts(resolve_shards(url)) == [8, 8, 7]
    assert _raw(url) == _raw(d) and len(_raw(d)) == N
    # shuffled, packed: the same batches
    local = list(build_loader(_cfg(d), TOK))
    assert _same_batches(list(build_loader(_cfg(url), TOK)), local, batches_equal)


def test_http_urls_give_the_local_samples_and_use_the_served_manifest(
    shards, http_server, batches_equal
):
    d, _ = shards
    base, log = http_server(d)
    url = f"{base}/{BRACES}"
    local = list(build_loader(_cfg(d), TOK))
    loader = build_loader(_cfg(url), TOK)
    # counts from manifest.json: no shard fetched
    assert log == [("GET", f"/{MANIFEST}")]
    assert _same_batches(list(loader), local, batches_equal)
    assert _raw(url) == _raw(d)


def test_counting_without_a_manifest_streams_each_shard_once(shards, http_server):
    d, _ = shards
    (d / MANIFEST).unlink()
    base, log = http_server(d)
    assert shard_counts(resolve_shards(f"{base}/{BRACES}")) == [8, 8, 7]
    shard_gets = Counter(p for c, p in log if p != f"/{MANIFEST}")
    assert shard_gets == {f"/shard-00000{i}.tar": 1 for i in range(3)}


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_on_a_url_source(shards, http_server, workers, batches_equal, decode_docs):
    d, texts = shards
    pipe = f"pipe:cat {d}/{BRACES}"
    cfg = _cfg(pipe, num_workers=workers)
    full = list(build_loader(cfg, TOK))
    # mid-shard, samples waiting in the shuffle and pack buffers
    k = 3
    first = build_loader(cfg, TOK)
    head = [b for _, b in zip(range(k), first)]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    resumed = build_loader(cfg, TOK)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert _same_batches(head + rest, full, batches_equal)
    seen = Counter(t for b in head + rest for t in decode_docs(b, TOK))
    assert seen == Counter(texts)  # each sample once: none repeated, none lost
    # the same state resumes on the same shards served over http (positions name shards by
    # file name)
    base, _ = http_server(d)
    moved = build_loader(_cfg(f"{base}/{BRACES}", num_workers=workers), TOK)
    moved.load_state_dict(state)
    assert _same_batches(list(moved), rest, batches_equal)


def test_file_urls_name_local_files(shards, batches_equal):
    d, _ = shards
    local = resolve_shards(d)
    for url in (f"file://{d}/{BRACES}", f"file:{d}", f"file://localhost{d}/shard-*.tar"):
        assert resolve_shards(url) == local
    assert _same_batches(
        list(build_loader(_cfg(f"file:{d}"), TOK)), list(build_loader(_cfg(d), TOK)), batches_equal
    )
    with pytest.raises(ConfigError, match="does not exist"):
        SourceConfig(path=f"file:{d}/nope.tar").validate()


def test_unreachable_urls_and_failing_commands_give_a_clear_error(shards, http_server, capsys):
    d, _ = shards
    base, _ = http_server(d)
    port = free_port()
    cases = {
        "pipe:false": r"the command `false` exited with status 1",
        f"pipe:cat {d}/missing.tar": r"the command `cat .*missing.tar` exited with status 1",
        f"{base}/missing.tar": r"curl exited with status 22 \(.*HTTP error",
        f"http://127.0.0.1:{port}/shard-000000.tar": (
            r"curl exited with status 7 \(could not connect"
        ),
    }
    for url, why in cases.items():
        with pytest.raises(
            ShardError, match=f"shard {re.escape(url)} cannot be read: {why}"
        ) as err:
            build_loader(_cfg(url), TOK)
        # `vlm train` prints it in one line, no traceback
        assert isinstance(err.value, ConfigError)
    p = argparse.ArgumentParser(prog="vlm")
    add_data_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["data", "stats", "pipe:false"])
    capsys.readouterr()
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "error: shard pipe:false cannot be read" in err and "Traceback" not in err
    # webdataset's ${VAR} expansion
    with pytest.raises(ConfigError, match="WDS_NOPE"):
        SourceConfig(path="pipe:cat ${NOPE}/a.tar").validate()
    with pytest.raises(ConfigError, match="Hugging Face hub"):
        SourceConfig(path="hf://datasets/x/y/a.tar").validate()


def _outcome(path, expected=None):
    return [
        (i, r.reason if isinstance(r, BadSample) else r["__key__"])
        for i, r in iter_shard(path, expected=expected)
    ]


def test_a_broken_stream_is_counted_as_a_broken_local_file(tmp_path, write_text_shards):
    write_text_shards(tmp_path, 5, per_shard=5)
    data = (tmp_path / "t-000000.tar").read_bytes()
    members = tarfile.open(tmp_path / "t-000000.tar").getmembers()
    cut = {
        "inside_a_header.tar": data[: members[2].offset + 100],
        "member_boundary.tar": data[: members[3].offset],
        "gzip_cut.tar.gz": gzip.compress(data)[:-30],
        "not_a_tar.tar": b"garbage" * 50,
    }
    for name, b in cut.items():
        (tmp_path / name).write_bytes(b)
        for expected in (None, 5):
            local = _outcome(tmp_path / name, expected)
            assert _outcome(f"pipe:cat {tmp_path / name}", expected) == local, name
            assert local != [(i, f"t0000{i}") for i in range(5)]


def test_a_url_that_stops_answering_mid_run_is_counted_not_fatal(shards, http_server, decode_docs):
    d, texts = shards
    base, _ = http_server(d)
    # counts from the manifest
    loader = build_loader(_cfg(f"{base}/{BRACES}", shuffle_buffer=0), TOK)
    (d / "shard-000001.tar").unlink()
    seen = Counter(t for b in loader for t in decode_docs(b, TOK))
    assert seen == Counter(texts[:8] + texts[16:]) and loader.counters == {"unreadable_shard": 1}


def test_stats_read_url_sources_like_local_ones(shards, http_server):
    d, _ = shards
    base, _ = http_server(d)
    local = collect_stats([d], scan=True)
    # no manifest: scanned by streaming
    piped = collect_stats([f"pipe:cat {d}/{BRACES}"])
    # the served manifest's entries
    served = collect_stats([f"{base}/{BRACES}"])
    assert piped["scanned"] == 3 and served["scanned"] == 0
    for res in (piped, served):
        assert res["totals"]["count"] == N and res["totals"]["kinds"] == local["totals"]["kinds"]
        assert [e["count"] for e in res["shards"]] == [e["count"] for e in local["shards"]]
