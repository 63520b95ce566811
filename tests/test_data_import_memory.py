"""A LLaVA JSON array is imported streaming (issue 26): the import's peak memory does not grow with
the file. Measured (each size in a fresh process, its resident-set high-water mark), not timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from data_pipelines.import_bench import generate_llava


def _peak_mb(table, out, env) -> tuple[float, int]:
    code = (
        "import json, sys; from data_pipelines.importers import import_table; "
        "from data_pipelines.import_bench import peak_rss_mb; "
        f"s = import_table({str(table)!r}, {str(out)!r}, workers=0, max_count=2000); "
        "print(json.dumps({'written': s['written'], 'peak': peak_rss_mb()['self']}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return res["peak"], res["written"]


@pytest.mark.slow  # imports two generated files of 9 and 44 MB in fresh processes
def test_streaming_import_memory_stays_flat(tmp_path, subprocess_env):
    env = subprocess_env()
    small = generate_llava(tmp_path / "small.json", 4_000, text_bytes=2000, text_only=True)
    big = generate_llava(tmp_path / "big.json", 20_000, text_bytes=2000, text_only=True, indent=1)
    grew_mb = (big.stat().st_size - small.stat().st_size) / 2**20
    assert grew_mb > 30
    peak_small, n_small = _peak_mb(small, tmp_path / "o_small", env)
    peak_big, n_big = _peak_mb(big, tmp_path / "o_big", env)
    assert (n_small, n_big) == (4_000, 20_000)
    # json.load of the big file alone would add several times its size; streaming adds (almost)
    # nothing (what grows is bounded by the shard size: the writer's set of keys; both runs write
    # shards of 2000)
    assert peak_big - peak_small < 0.1 * grew_mb, (peak_small, peak_big, grew_mb)
