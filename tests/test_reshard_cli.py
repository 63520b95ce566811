"""`vlm reshard RUN --workers K` (issue 49 item 2): a ZeRO checkpoint converted offline into
DeepSpeed's universal format by K worker processes, into the checkpoint's own folder where a resume
on another number of ranks finds it (vlm.train.reshard.universal_intact); a checkpoint that needs
no conversion is one line."""

from __future__ import annotations

import hashlib
import json

import pytest

pytestmark = pytest.mark.slow


def test_vlm_reshard_converts_with_workers(tiny_data, tmp_path, tiny_config, make_trainer, capsys):
    from vlm.cli import main
    from vlm.train.reshard import universal_intact

    run = tmp_path / "run"
    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 1, "vqa_eval": False},
        deepspeed={"zero_stage": 2},
        logging={"eval_every": 0, "histogram_every": 0},
    )
    assert make_trainer(cfg, run).train() == 0
    capsys.readouterr()
    assert main(["reshard", str(run), "--workers", "2"]) == 0
    out = capsys.readouterr()
    ckpt = run / "checkpoints" / "step_00000001"
    assert out.out.strip().startswith(str(ckpt / "universal")), out.out
    assert "with 2 worker(s)" in out.err, out.err
    assert universal_intact(ckpt), "the conversion is not whole (its meta.json's digests)"
    assert list((ckpt / "universal" / "ds" / "zero").iterdir()), "no parameter converted"

    # ZeRO 0 in fp32: the module file holds the whole optimizer state, nothing to convert
    plain = tmp_path / "plain" / "checkpoints" / "step_00000001"
    (plain / "ds").mkdir(parents=True)
    (plain / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"whole")
    digest = hashlib.sha256(b"whole").hexdigest()
    files = {"ds/mp_rank_00_model_states.pt": digest}
    (plain / "meta.json").write_text(json.dumps({"step": 1, "world_size": 1, "files": files}))
    assert main(["reshard", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs no conversion" in err and "\n" not in err, err
