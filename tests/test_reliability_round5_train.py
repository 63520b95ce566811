"""Issue 52, the trainer's part: what was silent or wrong. `final/model.safetensors` (and `vlm
convert`'s) follows the umask as every other file does; expert choices the capacity dropped are
said on the console and counted in summary.json; the same override twice on one command line is
refused as the same YAML key twice is; a cut last line of metrics.jsonl is moved aside on resume,
never deleted, and `vlm scaling fit` names the file and line; `vlm chain` names the stage and file of
a bad value; `base:` (and `--config`) naming a folder says so. And what the docs promised: a run
started on one process with the defaults (global batch = one micro-batch) continues on two with a
smaller `data.rows_per_batch` (the same samples in the same steps), which the refusal names, and
docs/training.md says what `--accept-optim-change` takes. The lock: tests/test_reliability_round5_locks.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch

from configs.config import ConfigError, load_yaml


def _cfg(tiny_config, tiny_data, steps=4, **sections):
    sections.setdefault("logging", {"eval_every": 0, "histogram_every": 0})
    return tiny_config(
        tiny_data, train={"max_steps": steps}, checkpoint={"save_every": 2, "keep_last": 3},
        **sections,
    )  # fmt: skip


def _main(argv, capsys) -> tuple[int, str]:
    from vlm.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exit (parse_args_anywhere)
        rc = e.code
    return rc, capsys.readouterr().err


def _one_line(err: str, start: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if "[WARNING]" not in ln]
    assert len(lines) == 1 and lines[0].startswith(start) and "Traceback" not in err, err
    return lines[0]


def _steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def two_steps(tiny_data, tmp_path_factory, tiny_config, make_trainer):
    """A finished 2-step run checkpointed at step 2 (rows_per_batch 2, one micro-batch a step: the
    default's shape), and its config."""
    det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    cfg = _cfg(tiny_config, tiny_data, steps=2)
    run = tmp_path_factory.mktemp("two") / "run"
    assert make_trainer(cfg, run).train() == 0
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)
    return run, cfg


# ------------------------------------------------------------------------------------------------
# permissions
def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_every_exported_file_follows_the_umask(two_steps, umask_022, baseline_export, capsys):
    """final/model.safetensors was 0600 under umask 022, every other file 0644: a teammate or a
    serving account got PermissionError. Now all are 0644: the trainer's export and vlm convert's."""
    from vlm.cli import main

    run, _ = two_steps
    modes = _modes(run / "final")
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    out = baseline_export.parent / "converted"
    assert main(["convert", str(baseline_export), "--out", str(out)]) == 0, capsys.readouterr()
    modes = _modes(out)
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


@pytest.fixture(scope="module")
def baseline_export(tiny_vlm, tmp_path_factory):
    """An exported MoE baseline (chunking off): what `vlm convert` reads."""
    from vlm.model.hf import save_pretrained

    model, tok = tiny_vlm()
    out = tmp_path_factory.mktemp("base") / "final"
    return save_pretrained(type(model)(model.model_cfg.baseline(), model.vision_cfg), out, tok)


# ------------------------------------------------------------------------------------------------
# dropped expert choices
def test_dropped_expert_choices_are_said_and_summed_in_the_summary(
    tiny_data, tiny_config, tmp_path, load_tiny, torch_globals
):
    """moe/overflow (expert parallelism's capacity: choices computed by no expert) was only in
    metrics.jsonl. Injected here as 7 dropped choices per micro-batch (the count itself is
    tests/test_expert_parallel_train.py's): one console line at the first step, and the run's total
    in summary.json and the summary's lines."""
    from vlm.train.trainer import Trainer

    def drop_seven(out, k):
        name, st = out.moe_passes[0]
        out.moe_passes[0] = (name, dataclasses.replace(st, overflow=torch.tensor(7)))
        return out

    cfg = _cfg(tiny_config, tiny_data, steps=3, parallel={"capacity_factor": 0.25})
    lines: list[str] = []
    trainer = Trainer(load_tiny(cfg), tmp_path / "run", log=lines.append, loss_hook=drop_seven)
    assert trainer.train() == 0
    said = [ln for ln in lines if "expert choices" in ln]
    assert len(said) == 2, lines  # the first step's warning, the summary's line
    assert said[0].startswith("warning: step 1: 7 expert choices were past the expert capacity")
    assert "parallel.capacity_factor=0.25" in said[0] and "\n" not in said[0], said
    assert "21 over 3 steps" in said[1], said
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["moe_dropped_choices"] == 21
    assert [r["moe/overflow"] for r in _steps(tmp_path / "run").values()] == [7, 7, 7]


# ------------------------------------------------------------------------------------------------
# the command line and configs
@pytest.mark.parametrize(
    "args",
    [
        ["optim.lr=0.001", "optim.lr=0.002"],
        ["optim.lr=0.001", "--max-steps", "1", "optim.lr=0.002"],  # after an option too
    ],
    ids=["together", "after an option"],
)
def test_the_same_override_twice_is_one_line(
    args, tmp_path, capsys, tiny_config, tiny_data, write_config, torch_globals
):
    cfg = write_config(_cfg(tiny_config, tiny_data, steps=1), tmp_path / "c.yaml")
    rc, err = _main(["train", "--config", str(cfg), "--out", str(tmp_path / "run"), *args], capsys)
    line = _one_line(err, "config error: override optim.lr is given twice")
    assert rc == 2 and "optim.lr=0.001 and optim.lr=0.002" in line, line
    assert not (tmp_path / "run").exists()


def test_chain_refuses_an_override_twice_and_names_the_stage_of_a_bad_value(
    tiny_config, tiny_data, write_config, tmp_path, capsys
):
    first = write_config(_cfg(tiny_config, tiny_data, steps=1), tmp_path / "first.yaml")
    second = tmp_path / "second.yaml"
    second.write_text(f"base: {first.name}\noptim:\n  lr: -1\n")
    out = tmp_path / "chain"
    rc, err = _main(["chain", str(first), str(second), "--out", str(out)], capsys)
    line = _one_line(err, f"config error: stage 1 ({second}): ")
    assert rc == 2 and "optim.lr" in line, line
    assert not out.exists()
    rc, err = _main(["chain", str(first), "a.b=1", "--out", str(out), "a.b=2"], capsys)
    assert rc == 2 and "override a.b is given twice" in _one_line(err, "config error:")


def test_a_base_or_config_that_is_a_folder_says_so(tmp_path, capsys):
    (tmp_path / "recipes").mkdir()
    f = tmp_path / "c.yaml"
    f.write_text("base: recipes\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(f)
    assert "base recipes is a folder, not a YAML file" in str(e.value), e.value
    rc, err = _main(["train", "--config", str(tmp_path / "recipes"), "--out", str(tmp_path / "r")],
                    capsys)  # fmt: skip
    line = _one_line(err, "config error: config file")
    assert rc == 2 and "is a folder, not a YAML file" in line and "does not exist" not in line


# ------------------------------------------------------------------------------------------------
# a cut last line of metrics.jsonl
CUT = '{"step": 3, "loss": 5.1, "lm_lo'


def test_a_cut_metrics_line_is_moved_aside_and_named_by_scaling_fit(
    two_steps, tmp_path, make_trainer, torch_globals, capsys
):
    """The resume deleted the cut line for good (its warning said so); `vlm scaling fit` said
    "Unterminated string ... line 1" naming no file. Now the fit names the file and the line, and
    the resume moves the line, byte for byte, to metrics.jsonl.cut-<time> beside it."""
    run0, cfg = two_steps
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(CUT)
    rc, err = _main(["scaling", "fit", str(run)], capsys)
    line = _one_line(err, "config error: vlm scaling fit: ")
    assert rc == 2 and f"{run / 'metrics.jsonl'} line 3 is not a JSON record" in line, line

    cfg = dict(cfg, train={**cfg["train"], "max_steps": 3})
    assert make_trainer(cfg, run, resume=True).train() == 0
    err = capsys.readouterr().err
    aside = list(run.glob("metrics.jsonl.cut-*"))
    assert len(aside) == 1 and aside[0].read_text() == CUT + "\n"
    said = f"line 3 (the last one: cut short when the run stopped), moved as they were to {aside[0].name}"
    assert said in err, err
    assert sorted(_steps(run)) == [1, 2, 3]
    from vlm.train.run_dir import clear_run

    assert aside[0].name in clear_run(run)  # --overwrite takes it with the run


# ------------------------------------------------------------------------------------------------
# a default single-process run continued on more ranks
def test_a_global_batch_of_one_micro_batch_names_the_rows_that_resume_on_two_ranks(load_tiny, TINY):
    """The defaults make one micro-batch the global batch; on two ranks the refusal suggested
    changing optim.global_batch_rows or data.rows_per_batch, and a resume refused both. A resume's
    refusal now names the micro-batch that fits, which a resume accepts (the next tests)."""
    from vlm.train.run_config import with_global_batch

    cfg = load_tiny({**TINY, "data": {**TINY["data"], "rows_per_batch": 4}})
    with pytest.raises(ConfigError) as e:
        with_global_batch(cfg, 2, saved=4)
    msg = str(e.value)
    assert msg.startswith(
        "cannot resume on 2 rank(s): the run's global batch, optim.global_batch_rows=4"
    )
    assert "resume with data.rows_per_batch=2" in msg and "optim.global_batch_rows or" not in msg
    with pytest.raises(ConfigError, match="run on a number of ranks that divides 3"):
        with_global_batch(cfg, 2, saved=3)
    resumed = with_global_batch(
        load_tiny({**TINY, "data": {**TINY["data"], "rows_per_batch": 2}}), 2, 4
    )
    assert (resumed.optim.global_batch_rows, resumed.optim.grad_accum) == (4, 1)


def test_the_same_rows_train_in_the_same_steps_with_a_smaller_micro_batch(
    tiny_default, batches_equal
):
    """Exactness, at the loader: a position saved after a global batch of rows_per_batch=2
    continues with rows_per_batch=1 on the same rows, two micro-batches per step (and on two ranks
    each takes one), so every step trains the samples it would have."""
    from dataclasses import replace

    from configs.batch import PackedBatch
    from data_pipelines.config import DataConfig
    from data_pipelines.loader import build_loader
    from data_pipelines.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    cfg = DataConfig(default_dir=str(tiny_default), row_tokens=256, rows_per_batch=2,
                     shuffle_buffer=16, pack_buffer=8)  # fmt: skip
    ld = build_loader(cfg, tok)
    whole = [b for _, b in zip(range(4), ld)]  # steps 1..4, one micro-batch each
    ld = build_loader(cfg, tok)
    _ = [b for _, b in zip(range(2), ld)]
    state = ld.state_dict()  # as the checkpoint at step 2 holds it
    for world in (1, 2):
        got = []
        for rank in range(world):
            small = build_loader(replace(cfg, rows_per_batch=1), tok, rank, world)
            small.load_state_dict(state)
            got.append([b for _, b in zip(range(4 // world), small)])
        rows = [got[k % world][k // world] for k in range(4)]  # micro-batch g of the order
        for step in (0, 1):
            want = whole[2 + step]
            pair = rows[2 * step : 2 * step + 2]
            assert all(isinstance(b, PackedBatch) and b.input_ids.shape[0] == 1 for b in pair)
            for r in (0, 1):
                assert torch.equal(pair[r].input_ids[0], want.input_ids[r]), (world, step, r)


def test_a_resume_may_cut_the_global_batch_into_smaller_micro_batches(
    two_steps, tmp_path, load_tiny, torch_globals, tiny_config, tiny_data, make_trainer
):
    """The run of `two_steps` (2 rows, one micro-batch a step) continued with rows_per_batch=1:
    accepted with a one-line note, and steps 3 and 4 train the tokens of the uninterrupted run's."""
    from vlm.train.trainer import Trainer

    run0, cfg = two_steps
    whole = tmp_path / "whole"
    assert make_trainer(dict(cfg, train={**cfg["train"], "max_steps": 4}), whole).train() == 0
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    more = dict(
        cfg, train={**cfg["train"], "max_steps": 4}, data={**cfg["data"], "rows_per_batch": 1}
    )
    lines: list[str] = []
    trainer = Trainer(load_tiny(more), run, resume=True, log=lines.append)
    assert trainer.run.cfg.optim.grad_accum == 2 and trainer.run.cfg.optim.global_batch_rows == 2
    notes = [ln for ln in lines if ln.startswith("note: data.rows_per_batch was 2")]
    assert len(notes) == 1 and "the same samples train in the same steps" in notes[0], lines
    assert trainer.train() == 0
    a, b = _steps(whole), _steps(run)
    assert sorted(b) == [1, 2, 3, 4]
    assert [b[s]["tokens"] for s in (3, 4)] == [a[s]["tokens"] for s in (3, 4)]
    for s in (3, 4):  # the same samples; other boundary noise, so close, not equal
        assert b[s]["loss/lm"] == pytest.approx(a[s]["loss/lm"], rel=0.05), s


def test_a_resume_may_not_change_the_global_batch_and_the_docs_say_so(
    two_steps, tmp_path, load_tiny, ROOT
):
    """`--accept-optim-change` takes the settings docs/training.md lists (not optim.global_batch_rows,
    which the docs said with `optim.*`); a changed global batch is refused naming what to do."""
    from vlm.train.run_config import OPTIM_CHANGES
    from vlm.train.trainer import Trainer

    run0, cfg = two_steps
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    bigger = dict(cfg, optim={**cfg["optim"], "global_batch_rows": 4})
    with pytest.raises(ConfigError) as e:
        Trainer(load_tiny(bigger), run, resume=True, accept_optim_change=True)
    msg = str(e.value)
    assert "optim.global_batch_rows was 2 in the checkpointed run, now 4" in msg, msg
    assert "the global batch cannot change on resume" in msg and "data.rows_per_batch" in msg, msg

    doc = (ROOT / "docs" / "training.md").read_text()
    said = re.search(r"`--accept-optim-change` takes (.*?)\.\s", doc, re.S)
    assert said, "docs/training.md: no sentence saying what --accept-optim-change takes"
    for key in OPTIM_CHANGES:
        assert f"`{key.split('.')[1]}`" in said.group(1) or f"`{key}`" in said.group(1), key
    assert "optim.*" not in said.group(1)
    assert "`optim.global_batch_rows`" in doc and "smaller `data.rows_per_batch`" in doc


def _rank(rank: int, world: int, port: int, cfg, run_dir: str, result: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    from vlm.train.trainer import Trainer

    lines: list[str] = []
    try:
        rc = Trainer(cfg, run_dir, resume=True, log=lines.append).train()
    except ConfigError as e:
        rc, lines = 2, [str(e)]
    if rank == 0:
        Path(result).write_text(json.dumps({"rc": rc, "log": lines}))


def _on_ranks(world: int, cfg, run: Path) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run.parent / f"{run.name}-{world}.json"
    mp.spawn(_rank, args=(world, port, cfg, str(run), str(result)), nprocs=world, join=True)
    return json.loads(result.read_text())


@pytest.mark.slow
def test_a_default_single_process_run_continues_on_two_ranks(
    two_steps, tmp_path, load_tiny, make_trainer, torch_globals
):
    """The whole way, on two gloo processes with data.rows_per_batch=1 (what the refusal names:
    the test above): steps 3 and 4 train the uninterrupted single-process run's tokens."""
    run0, cfg = two_steps
    four = dict(cfg, train={**cfg["train"], "max_steps": 4})
    whole = tmp_path / "whole"
    assert make_trainer(four, whole).train() == 0
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    smaller = load_tiny(dict(four, data={**four["data"], "rows_per_batch": 1}))
    done = _on_ranks(2, smaller, run)
    assert done["rc"] == 0, done
    assert any(ln.startswith("note: data.rows_per_batch was 2") for ln in done["log"]), done
    a, b = _steps(whole), _steps(run)
    assert sorted(b) == [1, 2, 3, 4]
    assert [b[s]["tokens"] for s in (3, 4)] == [a[s]["tokens"] for s in (3, 4)]
