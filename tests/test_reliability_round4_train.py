"""Issue 45, the trainer's part: every file a resume reads is checked, and a damaged one handled
like a damaged weight file (a checkpoint's meta.json cut short or not an object: the checkpoint
before it; the half-written last line of metrics.jsonl: dropped with a warning; a damaged
config.yaml: a warning); `--resume train.max_steps=N` below the checkpoint's step, `--out` a file
(train and chain), `--overwrite` of a folder that holds no run, `train.init_from` a model trained
with another tokenizer, a YAML config with a key written twice or nothing in it: one line, exit 2.
SIGHUP: tests/test_reliability_preemption.py; the run folder's lock:
tests/test_reliability_round4_locks.py."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from configs.config import ConfigError, load_yaml


def _cfg(tiny_config, tiny_data, steps=4, **sections):
    return tiny_config(
        tiny_data,
        train={"max_steps": steps},
        checkpoint={"save_every": 2, "keep_last": 3},
        logging={"eval_every": 0},
        **sections,
    )


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _main(argv, capsys) -> tuple[int, str]:
    from vlm.cli import main

    rc = main(argv)
    return rc, capsys.readouterr().err


def _one_line(err: str, start: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if "[WARNING]" not in ln]
    assert len(lines) == 1 and lines[0].startswith(start) and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def four_steps(tiny_data, tmp_path_factory, tiny_config, make_trainer):
    """A finished 4-step run with checkpoints at steps 2 and 4, and its config."""
    import torch

    det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    cfg = _cfg(tiny_config, tiny_data)
    run = tmp_path_factory.mktemp("four") / "run"
    assert make_trainer(cfg, run).train() == 0
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)
    return run, cfg


# ------------------------------------------------------------------------------------------------
# damaged files a resume reads
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda t: t[: len(t) // 2], id="cut short"),
        pytest.param(lambda t: "[1, 2, 3]", id="not an object"),
        pytest.param(lambda t: json.dumps({**json.loads(t), "files": [1]}), id="files a list"),
        pytest.param(lambda t: json.dumps({**json.loads(t), "world_size": "1"}), id="a string"),
    ],
)
def test_a_damaged_meta_json_falls_back_to_the_checkpoint_before(
    damage, four_steps, tmp_path, load_tiny, torch_globals
):
    from vlm.train.trainer import Trainer

    run0, cfg = four_steps
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    meta = run / "checkpoints" / "step_00000004" / "meta.json"
    meta.write_text(damage(meta.read_text()))
    lines: list[str] = []
    cfg = dict(cfg, train={**cfg["train"], "max_steps": 6})
    trainer = Trainer(load_tiny(cfg), run, resume=True, log=lines.append)
    assert trainer.run.resume_from == run / "checkpoints" / "step_00000002"
    warned = [ln for ln in lines if ln.startswith("warning: checkpoint")]
    assert len(warned) == 1 and "step_00000004" in warned[0] and "meta.json (" in warned[0], lines
    assert trainer.train() == 0
    assert _steps(run) == [1, 2, 3, 4, 5, 6]


def test_a_half_written_last_metrics_line_is_dropped_with_a_warning(
    four_steps, tmp_path, make_trainer, torch_globals, capsys
):
    """After a disk-full stop the last line of metrics.jsonl is cut mid-record: the resume drops
    it (with a warning naming it), instead of failing with JSONDecodeError."""
    run0, cfg = four_steps
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 5.1, "lm_lo')
    cfg = dict(cfg, train={**cfg["train"], "max_steps": 6})
    assert make_trainer(cfg, run, resume=True).train() == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl: 1 line(s) that are not a JSON record, line 5" in err, err
    assert "cut short" in err
    assert _steps(run) == [1, 2, 3, 4, 5, 6]


def test_a_damaged_run_config_is_a_warning_not_a_traceback(
    four_steps, tmp_path, load_tiny, torch_globals
):
    from vlm.train.trainer import Trainer

    run0, cfg = four_steps
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    (run / "config.yaml").write_text("model: [unclosed\n")
    lines: list[str] = []
    cfg = dict(cfg, train={**cfg["train"], "max_steps": 5})
    trainer = Trainer(load_tiny(cfg), run, resume=True, log=lines.append)
    assert any("config.yaml is damaged" in ln for ln in lines), lines
    assert trainer.train() == 0 and _steps(run) == [1, 2, 3, 4, 5]


def test_resume_below_the_checkpoints_step_is_one_line(
    four_steps, tmp_path, write_config, capsys, torch_globals
):
    """`--resume train.max_steps=1` on a run checkpointed at step 4: exit 2, one line; before
    this, the run exited 0 and config.yaml said 1 step. max_steps equal to the step still
    finishes the run."""
    run0, cfg = four_steps
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    before = _digests(run)
    path = write_config(cfg, tmp_path / "c.yaml")
    rc, err = _main(
        ["train", "--config", str(path), "--out", str(run), "--resume", "train.max_steps=1"],
        capsys,
    )
    line = _one_line(err, "config error: cannot resume")
    assert rc == 2 and "step 4, past train.max_steps=1" in line, line
    assert _digests(run) == before


# ------------------------------------------------------------------------------------------------
# arguments that cannot work
@pytest.mark.parametrize("command", ["train", "chain"])
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_out_a_file_is_one_line(
    command, where, tmp_path, tiny_config, tiny_data, write_config, capsys
):
    path = write_config(_cfg(tiny_config, tiny_data), tmp_path / "c.yaml")
    (tmp_path / "f").write_text("a file")
    out = tmp_path / "f" if where == "a file" else tmp_path / "f" / "run"
    argv = (
        ["train", "--config", str(path), "--out", str(out)]
        if command == "train"
        else ["chain", str(path), "--out", str(out)]
    )
    rc, err = _main(argv, capsys)
    line = _one_line(err, "config error: --out")
    assert rc == 2 and f"{tmp_path / 'f'} is a file, not a folder" in line, line
    assert (tmp_path / "f").read_text() == "a file"


def test_overwrite_deletes_nothing_in_a_folder_that_holds_no_run(
    tmp_path, tiny_config, tiny_data, write_config, capsys, torch_globals
):
    """A folder of someone's files named like a run's outputs (metrics.jsonl, summary.json, tb/)
    but no run's config.yaml: --overwrite refuses, every file stays."""
    folder = tmp_path / "mine"
    (folder / "tb").mkdir(parents=True)
    (folder / "tb" / "notes").write_text("keep")
    (folder / "metrics.jsonl").write_text('{"step": 1, "mine": true}\n')
    (folder / "summary.json").write_text('{"my": "summary"}')
    (folder / "config.yaml").write_text("just: my notes\n")
    before = _digests(folder)
    path = write_config(_cfg(tiny_config, tiny_data), tmp_path / "c.yaml")
    rc, err = _main(["train", "--config", str(path), "--out", str(folder), "--overwrite"], capsys)
    line = _one_line(err, "config error: --overwrite")
    assert rc == 2 and "is not a run folder" in line and "nothing in it is deleted" in line, line
    assert _digests(folder) == before


def test_overwrite_still_replaces_a_run(four_steps, tmp_path, make_trainer, torch_globals):
    run0, cfg = four_steps
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    cfg = dict(cfg, train={**cfg["train"], "max_steps": 2})
    assert make_trainer(cfg, run, overwrite=True).train() == 0
    assert _steps(run) == [1, 2]


def test_init_from_a_model_trained_with_another_tokenizer_is_refused(
    tiny_data, tmp_path, tiny_config, make_trainer, torch_globals
):
    """A model trained with the default dataset's BPE, continued with data.tokenizer=byte: refused
    (it trained at loss 16.6, reading every id as other text); its own tokenizer is accepted,
    from its final/ or from a checkpoint (whose run config names it)."""
    from vlm.train.stages import load_run_tokenizer, resolve_tokenizer

    bpe = _cfg(tiny_config, tiny_data, steps=2)
    bpe["data"] = {**bpe["data"], "tokenizer": "default", "default_dir": str(tiny_data)}
    bpe["model"] = {**bpe["model"], "vocab_size": 1024}
    run = tmp_path / "bpe"
    assert make_trainer(bpe, run).train() == 0
    for source in (run, run / "checkpoints" / "step_00000002"):
        cont = dict(bpe, train={**bpe["train"], "init_from": str(source)})
        cont["data"] = {**bpe["data"], "tokenizer": "byte"}
        with pytest.raises(ConfigError) as e:
            make_trainer(cont, tmp_path / "cont")
        msg = str(e.value)
        assert "data.tokenizer 'byte' (ByteTokenizer, 266 ids) is not the tokenizer" in msg, msg
        assert "BPETokenizer" in msg and "\n" not in msg, msg
        assert not (tmp_path / "cont").exists()
    from configs.config import from_dict
    from vlm.train.config import TrainConfig

    for tokenizer in (str(run / "final"), "default"):
        ok = dict(bpe, train={**bpe["train"], "init_from": str(run)})
        ok["data"] = {**bpe["data"], "tokenizer": tokenizer}
        load_run_tokenizer(resolve_tokenizer(from_dict(TrainConfig, ok)))


# ------------------------------------------------------------------------------------------------
# YAML
@pytest.mark.parametrize(
    "text,key,lines",
    [
        ("optim:\n  lr: 0.1\ntrain:\n  max_steps: 3\noptim:\n  clip: 2\n", "optim", (1, 5)),
        ("model:\n  moe:\n    top_k: 2\n    num_experts: 4\n    top_k: 3\n", "top_k", (3, 5)),
        ("data:\n  sources:\n    - {path: a, weight: 1, weight: 2}\n", "weight", (3, 3)),
    ],
)
def test_a_key_written_twice_is_an_error_naming_both_lines(text, key, lines, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_yaml(f)
    msg = str(e.value)
    assert f"key {key!r} is written twice" in msg and f"lines {lines[0]} and {lines[1]}" in msg, msg


def test_yaml_anchors_and_merges_still_load(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("a: &x {p: 1, q: 2}\nb:\n  <<: *x\n  q: 3\n")
    assert load_yaml(f) == {"a": {"p": 1, "q": 2}, "b": {"p": 1, "q": 3}}


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "null\n"])
def test_an_empty_config_is_an_error_not_the_default_run(text, tmp_path, capsys):
    f = tmp_path / "empty.yaml"
    f.write_text(text)
    rc, err = _main(["train", "--config", str(f), "--out", str(tmp_path / "run")], capsys)
    line = _one_line(err, "config error: config file")
    assert rc == 2 and f"{f} is empty" in line, line
    assert not (tmp_path / "run").exists()


def test_a_section_written_twice_stops_vlm_train(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.001\ntrain:\n  max_steps: 3\noptim:\n  clip: 2.0\n")
    rc, err = _main(["train", "--config", str(f), "--out", str(tmp_path / "run")], capsys)
    assert rc == 2 and "key 'optim' is written twice" in _one_line(err, "config error:")
