"""The checkpoint save protocol and its checks without ranks (issue 49 item 2): each rank hashes the
bytes it writes as it writes them; a resume on M ranks deals the files out by writer so that every
file is verified exactly once; a save blocks the step only while its state is copied to host
memory, and counts only once written whole with its manifest; a failed background write is
reported at the next wait; pruning the oldest happens in the writer, not the step."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch

from vlm.train import ckpt_save
from vlm.train.ckpt_layout import list_checkpoints, step_dir_name
from vlm.train.ckpt_manifest import damaged_share, host_copy, share_of, write_hashed
from vlm.train.layout import ParallelLayout


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_is_hashed_as_it_is_written(tmp_path):
    state = {"w": torch.arange(10_000.0), "step": 3}
    digest, _ = write_hashed(torch.save, state, tmp_path / "a.pt")
    assert digest == _sha(tmp_path / "a.pt"), "the digest recorded is not the written file's"

    def seeking_save(obj, fh):  # a writer that goes back: the hash is of the file, read back
        fh.write(b"x" * 100)
        fh.seek(10)
        fh.write(b"y" * 5)

    digest, _ = write_hashed(seeking_save, None, tmp_path / "b.bin")
    assert digest == _sha(tmp_path / "b.bin"), "a seeking writer's file hashed in write order"


@pytest.mark.parametrize("writers, world", [(4, 2), (2, 4), (3, 3), (1000, 8)])
def test_a_resume_verifies_each_file_once_spread_over_its_ranks(writers, world):
    files = {f"rank_{w:05d}.pt": "x" for w in range(writers)} | {"ds/old.pt": "y"}
    recorded = {f"rank_{w:05d}.pt": w for w in range(writers)}
    shares = [share_of(files, recorded, r, world) for r in range(world)]
    flat = [f for s in shares for f in s]
    assert sorted(flat) == sorted(files), "a file verified twice or never"
    for r, share in enumerate(shares):
        for rel in share:
            if rel in recorded:
                assert recorded[rel] % world == r, f"{rel} of writer {recorded[rel]} on rank {r}"
    most = max(len(s) for s in shares)
    assert most <= -(-len(files) // world) + 1, f"uneven shares: {[len(s) for s in shares]}"


def test_each_rank_finds_the_damage_in_its_own_share(tmp_path):
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    files, writers = {}, {}
    for w in range(4):
        p = ckpt / f"rank_{w:05d}.pt"
        p.write_bytes(bytes([w]) * 100)
        files[p.name], writers[p.name] = _sha(p), w
    (ckpt / "meta.json").write_text(
        json.dumps({"step": 1, "world_size": 4, "files": files, "writers": writers})
    )
    (ckpt / "rank_00003.pt").write_bytes(b"\0" * 100)  # a flipped file of writer 3
    found = [damaged_share(ckpt, r, 2) for r in range(2)]
    assert found[0] is None and found[1] == "rank_00003.pt (checksum mismatch)", found
    assert damaged_share(ckpt) == "rank_00003.pt (checksum mismatch)"


def test_host_copies_are_independent_and_keep_ties():
    w = torch.ones(3)
    state = {"a": w, "b": w, "nested": [{"m": torch.zeros(2)}], "n": 1}
    copy = host_copy(state)
    w.add_(1)
    state["nested"][0]["m"].add_(5)
    assert torch.equal(copy["a"], torch.ones(3)) and torch.equal(
        copy["nested"][0]["m"], torch.zeros(2)
    )
    assert copy["a"] is copy["b"], "a tied tensor was copied twice"


class _FakeEngine:
    """What the save protocol uses of DeepSpeed's engine: save_checkpoint writing one module file
    through its checkpoint engine's `save`."""

    class _Writer:
        zipfile_serialization = True

        def save(self, state_dict, path):
            torch.save(state_dict, path)

    def __init__(self, n: int = 1000):
        self.module = torch.nn.Linear(n, 1, bias=False)
        self.optimizer = None
        self.checkpoint_engine = self._Writer()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        state = {"module": self.module.state_dict(), **client_state}
        self.checkpoint_engine.save(state, str(Path(save_dir, tag, "mp_rank_00_model_states.pt")))


def test_a_save_blocks_only_for_staging_and_counts_once_complete(tmp_path, monkeypatch):
    engine, root = _FakeEngine(), tmp_path / "checkpoints"
    cp = ckpt_save.Checkpointer(engine, root, 1, 1, ParallelLayout(1, 0))
    release, real = threading.Event(), ckpt_save.write_file

    def slow_write(obj, path, zipfile=True):  # the disk is slow: the step must not wait for it
        assert release.wait(30), "the writer was never released"
        return real(obj, path, zipfile)

    monkeypatch.setattr(ckpt_save, "write_file", slow_write)
    before = engine.module.weight.detach().clone()
    cp.save(1, {"step": 1})
    # the step goes on while the write waits: it changes the weights the save staged
    with torch.no_grad():
        engine.module.weight.add_(1.0)
    assert list_checkpoints(root) == [], "a checkpoint counted before it was written whole"
    assert (root / f".tmp-{step_dir_name(1)}").is_dir()
    assert not cp.in_flight.thread.daemon, "an exit would not wait for the save in flight"
    release.set()
    cp.wait()
    (step, ckpt), *_ = list_checkpoints(root)
    saved = torch.load(ckpt / "ds" / "mp_rank_00_model_states.pt", weights_only=True)
    assert torch.equal(saved["module"]["weight"], before), "the save wrote the next step's weights"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert set(meta["writers"].values()) == {0}
    for rel, digest in meta["files"].items():
        assert _sha(ckpt / rel) == digest, f"{rel}: the recorded digest is not the file's"
    metrics = cp.take_metrics()
    assert metrics["checkpoint/step"] == 1 and len(metrics["checkpoint/ranks"]["write_s"]) == 1

    monkeypatch.setattr(ckpt_save, "write_file", real)
    cp.save(2, {"step": 2})
    cp.wait()
    assert [s for s, _ in list_checkpoints(root)] == [2], "keep_last=1 kept the older one"


def test_a_failed_background_write_is_one_line_at_the_next_wait(tmp_path, monkeypatch):
    import errno

    from vlm.train.write_errors import WriteError

    engine, root = _FakeEngine(), tmp_path / "checkpoints"
    cp = ckpt_save.Checkpointer(engine, root, 1, 2, ParallelLayout(1, 0))

    def full(obj, path, zipfile=True):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt_save, "write_file", full)
    cp.save(1, {"step": 1})
    with pytest.raises(WriteError, match=r"cannot write checkpoint step 1: .*No space left"):
        cp.wait()
    assert list(root.iterdir()) == [], "the partial folder of the failed save is left"


def test_the_checkpoint_benchmark_times_each_phase():
    """`vlm bench checkpoint` (its smoke settings: the plumbing, not the speed)."""
    from eval.bench import checkpoint as bench

    res = bench.run(bench.SETTINGS["smoke"], log=lambda *_: None)
    got = {r["candidate"] for r in res["rows"]}
    assert got == {
        "staged (step blocked)",
        "written + hashed (background)",
        "verified (resume)",
        bench.BASELINE,
    }, got
    assert all(r["median"] > 0 for r in res["rows"]), res["rows"]
