"""Issue 37, the trainer's part (1/2): a finished run is never trained over by accident
(`--overwrite` or a new --out), while a run with checkpoints still resumes; a row too short for the
largest image is a config error, and a run that skips too much of its data stops. The faults (a
pickle, SIGTERM at the end, config errors, a full disk on one rank):
test_reliability_round3_train_faults.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest


def _cfg(tiny_config, tiny_data, steps=2, **sections):
    return tiny_config(
        tiny_data,
        train={"max_steps": steps},
        checkpoint={"save_every": steps, "keep_last": 2},
        logging={"eval_every": 0},
        **sections,
    )


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


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


@pytest.fixture(scope="module")
def finished_run(tiny_data, tmp_path_factory, tiny_config, make_trainer):
    """A finished 2-step run whose checkpoints were deleted to save space (final/, summary.json,
    metrics.jsonl, config.yaml kept), and its config."""
    import shutil

    import torch

    det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    cfg = _cfg(tiny_config, tiny_data)
    run = tmp_path_factory.mktemp("finished") / "run"
    assert make_trainer(cfg, run).train() == 0
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)
    shutil.rmtree(run / "checkpoints")
    return run, cfg


# ---------------------------------------------------------------- item 1: a finished run is
# not overwritten
def test_a_finished_run_is_refused_unless_overwrite(
    finished_run, tmp_path, tiny_config, tiny_data, write_config, ROOT, subprocess_env
):
    """The issue's case: checkpoints/ deleted, final/ kept; `vlm train --out RUN` with another
    config (64 wide instead of 32) exits 2 with one line and leaves every file as it was;
    --overwrite trains the new model there."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run[0], run)
    before = _digests(run)
    other = _cfg(tiny_config, tiny_data)
    other["model"]["hidden_size"] = 64
    path = write_config(other, tmp_path / "c64.yaml")
    proc = _cli(["--config", str(path), "--out", str(run)], ROOT, subprocess_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _errors(proc.stderr, "config error:")
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        f"{run} holds the outputs of an earlier run (final/, summary.json, metrics.jsonl with 2 logged steps)"
        in errors[0]
        and "--overwrite" in errors[0]
        and "new --out" in errors[0]
    ), errors
    assert _digests(run) == before
    # --resume finds no checkpoint: a finished run is not started over either
    proc = _cli(["--config", str(path), "--out", str(run), "--resume"], ROOT, subprocess_env())
    assert (
        proc.returncode == 2
        and "holds the outputs of an earlier run" in proc.stderr
        and _digests(run) == before
    )

    proc = _cli(["--config", str(path), "--out", str(run), "--overwrite"], ROOT, subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "--overwrite: deleted the earlier run's final, summary.json, metrics.jsonl" in proc.stdout
    )
    assert json.loads((run / "final" / "config.json").read_text())["hidden_size"] == 64
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]


@pytest.mark.parametrize("kept", ["final", "summary.json", "metrics.jsonl"])
def test_each_output_alone_is_protected(finished_run, tmp_path, kept, make_trainer, torch_globals):
    """Each of a run's outputs alone (final/, summary.json, metrics.jsonl with a step) makes a
    folder that a run with nothing to resume refuses (overwrite=False, what `vlm train` passes);
    nothing in it changes."""
    import shutil

    from configs.config import ConfigError

    src, cfg = finished_run
    run = tmp_path / "run"
    run.mkdir()
    if kept == "final":
        shutil.copytree(src / kept, run / kept)
    else:
        shutil.copy(src / kept, run / kept)
    before = _digests(run)
    with pytest.raises(ConfigError, match="holds the outputs of an earlier run") as e:
        make_trainer(cfg, run, overwrite=False)
    assert ("final/" if kept == "final" else kept) in str(e.value)
    assert _digests(run) == before


def test_what_is_not_an_output_and_what_resume_may_start_over(
    finished_run, tmp_path, make_trainer, load_tiny, torch_globals
):
    """config.yaml with an empty metrics.jsonl (what a run stopped before its first step leaves) is
    no output: the same command starts the run. metrics.jsonl with steps and no final/ (a run killed
    before its first checkpoint) is refused by default and started over with --resume (resume=True),
    as a requeue does."""
    import shutil

    from configs.config import ConfigError

    src, cfg = finished_run
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copy(src / "config.yaml", stopped / "config.yaml")
    (stopped / "metrics.jsonl").write_text("")
    assert make_trainer(cfg, stopped, overwrite=False).run.resume_from is None

    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(src / "config.yaml", killed / "config.yaml")
    shutil.copy(src / "metrics.jsonl", killed / "metrics.jsonl")
    with pytest.raises(ConfigError, match=r"--resume to start this unfinished run over"):
        make_trainer(cfg, killed, overwrite=False)
    said = []
    from vlm.train.trainer import Trainer

    Trainer(load_tiny(cfg), killed, resume=True, overwrite=False, log=said.append)
    assert any("starting the run from the beginning" in m for m in said)


def test_a_run_with_checkpoints_still_resumes_by_default(
    tiny_data, tmp_path, tiny_config, make_trainer, torch_globals
):
    """A folder with a checkpoint continues as before (the same command resumes it), outputs or not."""
    cfg = _cfg(tiny_config, tiny_data)
    run = tmp_path / "run"
    assert make_trainer(cfg, run, overwrite=False).train() == 0
    cfg["train"]["max_steps"] = 3
    tr = make_trainer(cfg, run, overwrite=False)
    assert tr.run.resume_from is not None and tr.train() == 0 and tr.step == 3


# ---------------------------------------------------------------- item 3: rows that drop images,
# skipped data
def test_a_row_too_short_for_the_largest_image_is_a_config_error(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env, png
):
    """data.row_tokens=8 with 16-patch images merged 2x2 (4 tokens): <bos><|user|>, start, 4 pads,
    end and a text token need 9. Refused before any work, one line naming data.row_tokens and 9, no
    run folder; 9 does hold such an image in a chat sample (the loader keeps it), 8 does not."""
    import numpy as np

    from data_pipelines.encode import encode_sample
    from data_pipelines.schema import BadSample, Sample
    from data_pipelines.tokenizer import load_tokenizer
    from vision.image_processor import ImageProcessor, ImageProcessorConfig

    path = write_config(_cfg(tiny_config, tiny_data), tmp_path / "c.yaml")
    run = tmp_path / "run"
    proc = _cli(
        ["--config", str(path), "--out", str(run), "data.row_tokens=8"], ROOT, subprocess_env()
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _errors(proc.stderr, "config error:")
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        errors[0].startswith("config error: data.row_tokens=8 cannot hold the largest image")
        and "at least 9" in errors[0]
        and "max_patches=16" in errors[0]
    ), errors
    assert not run.exists()

    tok = load_tokenizer("byte")
    proc_cfg = ImageProcessorConfig(patch_size=14, min_patches=4, max_patches=16, merge=2)
    big = Sample(
        key="k",
        kind="pair",
        turns=[
            {"role": "user", "content": "<image>"},
            {"role": "assistant", "content": "a red square"},
        ],
        images=[png(400, 400)],
    )
    [enc] = encode_sample(big, tok, ImageProcessor(proc_cfg), 9)
    assert len(enc) == 9 and int(np.sum(enc.ids == tok.image_pad_id)) == 4
    with pytest.raises(BadSample, match="do not fit a row of 8"):
        encode_sample(big, tok, ImageProcessor(proc_cfg), 8)


def test_skip_share_rule():
    from vlm.train.loaders import MIN_SAMPLES_JUDGED, skip_share_stop

    assert MIN_SAMPLES_JUDGED == 50
    # too few read to judge
    assert skip_share_stop({"too_long": 20}, 49, 0.1) is None
    # 10 %: not above
    assert skip_share_stop({"too_long": 5}, 50, 0.1) is None
    line = skip_share_stop({"too_long": 4, "corrupt_image": 2, "bad_json": 0}, 50, 0.1)
    assert line.startswith(
        "stopping: 6 of the 50 samples read were skipped (12.0 %, more "
        "than train.max_skip_share=0.1): corrupt_image=2, too_long=4."
    )
    # a filter is no loss
    assert skip_share_stop({"filtered_kind": 40, "too_long": 5}, 100, 0.1) is None
    assert skip_share_stop({"corrupt_image": 60}, 60, 1.0) is None  # 1 = never stop


def _mixed_source(directory: Path, png, good: int, bad: int) -> list[dict]:
    """One source of `good` text samples and `bad` caption samples whose image is no image."""
    from data_pipelines.schema import Sample
    from data_pipelines.writer import ShardWriter

    with ShardWriter(directory, "m", max_count=40) as w:
        for i in range(good + bad):
            if i % 3 == 0 and bad:
                bad -= 1
                w.write(
                    Sample(
                        key=f"b{i:04d}",
                        kind="pair",
                        text="<image>a picture",
                        images=[b"not an image"],
                        image_exts=["png"],
                    )
                )
            else:
                w.write(
                    Sample(key=f"g{i:04d}", kind="text", text=f"sample {i} " + "word " * (i % 7))
                )
    return [{"path": str(directory / "m-*.tar"), "name": "mixed"}]


def test_a_run_that_skips_too_much_of_its_data_stops(
    tiny_data, tmp_path, tiny_config, make_trainer, png, torch_globals
):
    """A third of the samples have broken images: the run stops at the first log once 50 samples
    were read, with one line naming the counters, exit code 1, no final/; with
    train.max_skip_share=0.5 the same data trains."""
    sources = _mixed_source(tmp_path / "data", png, 80, 40)
    said = []
    cfg = _cfg(
        tiny_config,
        tiny_data,
        steps=30,
        data={"sources": sources, "pack_buffer": 32, "shuffle_buffer": 0},
    )
    run = tmp_path / "run"
    tr = make_trainer(cfg, run)
    tr.log_fn = said.append
    assert tr.train() == 1
    stop = [m for m in said if m.startswith("stopping:")]
    assert (
        len(stop) == 1 and "corrupt_image=" in stop[0] and "train.max_skip_share=0.1" in stop[0]
    ), said
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps and steps[-1] < 30 and f"(step {steps[-1]})" in stop[0]
    assert (
        not (run / "final").exists()
        and json.loads((run / "summary.json").read_text())["exit_code"] == 1
    )

    cfg["train"]["max_skip_share"] = 0.5
    assert make_trainer(cfg, tmp_path / "run2").train() == 0


def test_a_source_that_loses_too_much_stops_the_run_though_the_whole_does_not(
    tiny_data, tmp_path, tiny_config, make_trainer, png, torch_globals
):
    """The rule holds per source (one kind of sample each in the default data): a caption source
    losing a third of its samples stops the run, naming it, although the text source's volume keeps
    the whole under the limit."""
    from data_pipelines.schema import Sample
    from data_pipelines.writer import ShardWriter

    with ShardWriter(tmp_path / "texts", "t", max_count=100) as w:
        for i in range(600):
            w.write(Sample(key=f"t{i:04d}", kind="text", text=f"sample {i} " + "word " * (i % 7)))
    sources = [
        {"path": str(tmp_path / "texts" / "t-*.tar"), "name": "texts", "weight": 5.0},
        _mixed_source(tmp_path / "caps", png, 80, 40)[0],
    ]
    said = []
    cfg = _cfg(
        tiny_config,
        tiny_data,
        steps=40,
        data={"sources": sources, "pack_buffer": 32, "shuffle_buffer": 0},
    )
    tr = make_trainer(cfg, tmp_path / "run")
    tr.log_fn = said.append
    assert tr.train() == 1
    stop = [m for m in said if m.startswith("stopping:")]
    assert len(stop) == 1 and "from source mixed" in stop[0] and "corrupt_image=" in stop[0], said
    assert "samples read from source mixed" in stop[0]
    lost = sum(n for r, n in tr.run.loader.counters.items() if r != "filtered_kind")
    # the whole was within the limit: the source's rule stopped it
    assert 0 < lost < 0.1 * tr.run.loader.stats["samples_read"]
