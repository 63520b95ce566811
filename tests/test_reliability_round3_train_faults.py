"""Issue 37, the trainer's part (2/2): a pickle in a checkpoint and a full disk on one rank of two
end in one line on every rank; SIGTERM in the end-of-run evaluation stops it and the same command
finishes the run; a config error found after the run folder was made removes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from rank_processes import free_port


def _cfg(tiny_config, tiny_data, steps=2, **sections):
    return tiny_config(
        tiny_data,
        train={"max_steps": steps},
        checkpoint={"save_every": steps, "keep_last": 2},
        logging={"eval_every": 0},
        **sections,
    )


def _cli(args, ROOT, env, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "vlm.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _errors(stderr: str, prefix: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(prefix)]


# ---------------------------------------------------------------- item 4: a pickle found on resume
class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_in_a_checkpoint_is_refused_in_one_line(
    tiny_data,
    tmp_path,
    tiny_config,
    make_trainer,
    write_config,
    torch_globals,
    ROOT,
    subprocess_env,
):
    """The trainer state of the latest checkpoint replaced by a pickle that runs code, its checksum
    updated to match: `vlm train --resume` refuses it in one line naming the file (exit 1, no
    traceback), the code never runs."""
    import torch

    from vlm.train.checkpoint import file_digests

    cfg = _cfg(tiny_config, tiny_data)
    run = tmp_path / "run"
    assert make_trainer(cfg, run).train() == 0
    ckpt = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    torch.save({"step": 2, "payload": _RunsCode(str(marker))}, ckpt / "rank_00000.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "files": file_digests(ckpt)}))
    cfg["train"]["max_steps"] = 3
    path = write_config(cfg, tmp_path / "c.yaml")
    proc = _cli(["--config", str(path), "--out", str(run), "--resume"], ROOT, subprocess_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = _errors(proc.stderr, "vlm train:")
    assert "Traceback" not in proc.stderr + proc.stdout and "[rank0]" not in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert len(errors) == 1 and errors[0].startswith(
        f"vlm train: checkpoint {ckpt / 'rank_00000.pt'}: refused"
    )
    assert not marker.exists()


# ---------------------------------------------------------------- item 5: SIGTERM in the
# end-of-run evaluation
def test_sigterm_in_the_end_of_run_evaluation_stops_it_and_the_same_command_finishes(
    tiny_data, tmp_path, tiny_config, make_trainer, torch_globals, capfd
):
    """A SIGTERM while the end-of-run callbacks run (the VQA eval) ends them at once: exit 143,
    final/ exported, no summary; stderr says the evaluation stops (not "saving a checkpoint"). The
    same command then resumes at the last step, trains nothing, runs the evaluation and writes the
    summary (exit code 0)."""
    from vlm.train.signals import stop_on_signals

    cfg = _cfg(tiny_config, tiny_data)
    run = tmp_path / "run"
    calls = []

    def slow_eval(final, cfg, run_dir, log):
        calls.append("started")
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline:  # an evaluation that would take 10 s
            time.sleep(0.01)
        calls.append("finished")
        return {"vqa": None}

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    said = []
    try:
        with stop_on_signals() as stop:
            tr = make_trainer(cfg, run, on_end=[slow_eval], stop=stop)
            tr.log_fn = said.append
            t0 = time.time()
            rc = tr.train()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    assert rc == 143 and calls == ["started"] and time.time() - t0 < 10
    err = capfd.readouterr().err
    assert (
        "SIGTERM received: stopping the end-of-run evaluation" in err
        and "saving a checkpoint" not in err
    ), err
    assert said[-1].startswith(
        "stopped by SIGTERM after the last step (2), before the end-of-run "
        "evaluation and summary; the same command finishes the run"
    ), said[-3:]
    assert (run / "final" / "model.safetensors").is_file() and not (run / "summary.json").exists()

    done = []
    tr = make_trainer(
        cfg,
        run,
        on_end=[lambda f, c, r, log: done.append(f) or {"eval_done": True}],
        overwrite=False,
    )
    assert tr.run.resume_from == run / "checkpoints" / "step_00000002"
    assert tr.train() == 0 and tr.step == 2 and done == [run / "final"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["eval_done"] is True and summary["steps"] == 2


# ---------------------------------------------------------------- item 7: config errors, a full
# disk on one rank
@pytest.mark.parametrize(
    "section,value,match",
    [
        ("params", {"freeze": ["lm.nope"]}, "params.freeze entry 'lm.nope' matches no parameter"),
        ("model", {"vocab_size": 100}, "model.vocab_size=100 is smaller than the tokenizer's"),
    ],
)
def test_a_config_error_found_after_the_folder_was_made_leaves_none(
    tiny_data, tmp_path, tiny_config, make_trainer, torch_globals, section, value, match
):
    """Errors only the built model shows (a freeze prefix matching nothing, a vocabulary
    smaller than the tokenizer's): the folders that making RUN_DIR created (parents included)
    are gone again."""
    from configs.config import ConfigError

    cfg = _cfg(tiny_config, tiny_data)
    cfg[section] = {**cfg.get(section, {}), **value}
    with pytest.raises(ConfigError, match=match):
        make_trainer(cfg, tmp_path / "new" / "deeper" / "run")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a folder that was there before stays
    with pytest.raises(ConfigError, match=match):
        make_trainer(cfg, tmp_path / "mine")
    assert (tmp_path / "mine").is_dir()


def test_a_config_error_after_the_folder_through_the_cli(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env
):
    path = write_config(_cfg(tiny_config, tiny_data), tmp_path / "c.yaml")
    proc = _cli(
        ["--config", str(path), "--out", str(tmp_path / "run"), "params.freeze=[lm.nope]"],
        ROOT,
        subprocess_env(),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = _errors(proc.stderr, "config error:")
    assert len(errors) == 1 and errors[0].startswith(
        "config error: params.freeze entry 'lm.nope' "
        "matches no parameter; module prefixes: lm.chunker, "
    ), errors
    assert not (tmp_path / "run").exists()


_ENOSPC_ON_RANK_1 = r"""
import errno, os, sys
from vlm.train import ckpt_save as ck
real, victim = ck.write_file, os.environ["ENOSPC_FILE"]
def write_file(obj, path, *args, **kw):
    if os.path.basename(str(path)).startswith(victim):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real(obj, path, *args, **kw)
ck.write_file = write_file
from vlm.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("zero,victim", [(0, "rank_00001.pt"), (2, "zero_pp_rank_1_")])
def test_a_full_disk_on_one_rank_ends_every_rank(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env, zero, victim
):
    """Two gloo ranks; rank 1 cannot write its part of the checkpoint at step 2 (OSError ENOSPC):
    its trainer state, or under ZeRO-2 its optimizer partition inside DeepSpeed's save. Both ranks
    end within the timeout (none waits for the other in a collective), each with exit code 1 and one
    line naming rank 1's file and "No space left on device"; no partial checkpoint is left."""
    cfg = _cfg(tiny_config, tiny_data, deepspeed={"zero_stage": zero})
    path = write_config(cfg, tmp_path / "c.yaml")
    run = tmp_path / "run"
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            subprocess_env(),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            ENOSPC_FILE=victim,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _ENOSPC_ON_RANK_1, "--config", str(path), "--out", str(run)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.time() + 300
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(deadline - time.time(), 1)))
    except subprocess.TimeoutExpired:
        pytest.fail("a rank hung after the other could not write its checkpoint")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        errors = _errors(err, "vlm train:")
        assert p.returncode == 1 and "Traceback" not in err, (rank, err[-3000:])
        assert (
            len(errors) == 1
            and errors[0].startswith("vlm train: cannot write checkpoint step 2: ")
            and f"/{victim}" in errors[0]
            and "No space left on device" in errors[0]
        ), (rank, errors)
    assert not (run / "checkpoints").exists() or not [
        p.name for p in (run / "checkpoints").iterdir()
    ]
