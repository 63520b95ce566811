"""Issue 37, `vlm eval ...`: a user's mistake is one line on stderr and exit 2, found
before the work.

The probes: `vlm eval vqa` on a folder that is not a model, `--batch-size 0`, an unwritable `--out`
(found after 37 s of evaluation) each ended in a traceback; `--limit 0` scored one question. Every
command is run in-process through `vlm.cli.main`; the work it must not start (building the dataset,
loading the model, reading shards) is replaced by a function that fails the test if it is called.
"""

from __future__ import annotations

import json

import pytest

from vlm.cli import main


def _refused(argv: list[str], capsys) -> tuple[int | str, str]:
    """(exit code, stderr) of a `vlm` command that must exit."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _no_work(monkeypatch, what: str, command: str) -> None:
    def started(*args, **kwargs):
        raise AssertionError(f"{what} started before the arguments were checked")

    import data_pipelines.default_dataset
    import eval.export_tasks
    import eval.longctx.sweep
    import eval.perplexity
    import eval.vqa
    import vlm.generate

    work = [
        # every `vlm eval` command builds a missing dataset through eval.preflight.default_data
        (data_pipelines.default_dataset, "ensure_default_dataset"),
        (eval.vqa, "load_eval_model"),
        (eval.perplexity, "perplexity"),
        (eval.export_tasks, "vqa_records"),
        (eval.longctx.sweep, "run_sweep"),
    ]
    # longctx checks model folders only with the real loader; its work is the sweep
    if command != "longctx":
        work.append((vlm.generate, "load_eval_model"))
    for module, name in work:
        monkeypatch.setattr(module, name, started)


def _not_a_model(tmp_path, kind: str):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    if kind == "run folder":  # RUN_DIR given instead of RUN_DIR/final
        (folder / "checkpoints").mkdir()
        (folder / "summary.json").write_text("{}")
    return folder


@pytest.mark.parametrize("kind", ["empty folder", "run folder"])
@pytest.mark.parametrize("command", ["vqa", "probe", "ppl", "longctx"])
def test_a_folder_that_is_not_a_model_is_one_line_before_any_work(
    command, kind, tmp_path, monkeypatch, capsys
):
    _no_work(monkeypatch, "the dataset build or the model load", command)
    folder, data, out = _not_a_model(tmp_path, kind), tmp_path / "data", tmp_path / "out"
    extra = {
        "vqa": ["--data", str(data)],
        "probe": ["--data", str(data)],
        "ppl": ["--default-dir", str(data)],
        "longctx": ["--out", str(out), "--no-progress"],
    }[command]
    code, err = _refused(["eval", command, "--ckpt", str(folder), *extra], capsys)
    line = _one_line(err)
    assert code == 2 and line.startswith(
        f"vlm eval {command}: --ckpt {folder}: no exported model there"
    )
    assert not data.exists() and not out.exists()


@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("vqa", "--batch-size", "0"),
        ("vqa", "--limit", "0"),
        ("vqa", "--limit", "-3"),
        ("longctx", "--batch-size", "0"),
        ("probe", "--limit", "0"),
        ("lmms-tasks", "--limit", "0"),
        ("ppl", "--max-batches", "0"),
        ("ppl", "--row-tokens", "0"),
        ("ct-start", "--batches", "0"),
    ],
)
def test_counts_below_1_are_refused_when_parsed(
    command, flag, value, exported_vlm, tiny_default, tmp_path, monkeypatch, capsys
):
    """--limit 0 is refused rather than read: it scored 1 question, and "no limit" or "none" are
    both guesses; without --limit every question is scored."""
    _no_work(monkeypatch, "the evaluation", command)
    base = {
        "vqa": ["--ckpt", str(exported_vlm), "--data", str(tiny_default)],
        "probe": ["--ckpt", str(exported_vlm), "--data", str(tiny_default)],
        "ppl": ["--ckpt", str(exported_vlm), "--default-dir", str(tiny_default)],
        "longctx": ["--ckpt", str(exported_vlm), "--out", str(tmp_path / "lc")],
        "lmms-tasks": ["--data", str(tiny_default), "--out", str(tmp_path / "tasks")],
        "ct-start": [str(exported_vlm), "--data", str(tiny_default)],
    }[command]
    code, err = _refused(["eval", command, *base, flag, value], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"error: argument {flag}: " in err and ">= 1" in err and value in err
    assert not (tmp_path / "lc").exists() and not (tmp_path / "tasks").exists()


FILE_OUT = ["vqa", "probe", "ppl"]


@pytest.mark.parametrize("blocked", ["under a file", "a directory"])
@pytest.mark.parametrize("command", FILE_OUT + ["lmms-tasks", "longctx"])
def test_an_unwritable_out_is_refused_before_the_model_loads(
    command, blocked, exported_vlm, tiny_default, tmp_path, monkeypatch, capsys
):
    _no_work(monkeypatch, "the model load or the export", command)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    if blocked == "under a file":
        out, why = a_file / "result", f"{a_file} is a file, not a directory"
    elif command in FILE_OUT:
        out, why = tmp_path, "is a directory; give a file name"
    else:
        out, why = a_file, "is a file; give a directory"
    ckpt, data = ["--ckpt", str(exported_vlm)], ["--data", str(tiny_default)]
    args = {
        "vqa": ckpt + data,
        "probe": ckpt + data,
        "ppl": ckpt + ["--default-dir", str(tiny_default)],
        "lmms-tasks": data,
        "longctx": ckpt + ["--no-progress"],
    }[command]
    code, err = _refused(["eval", command, *args, "--out", str(out)], capsys)
    line = _one_line(err)
    assert (
        code == 2
        and line.startswith(f"vlm eval {command}: ")
        and f"--out {out}" in line
        and why in line
    )
    assert a_file.read_text() == "not a folder"


def test_out_folders_are_made_and_the_check_leaves_nothing_behind(
    exported_vlm, tiny_default, tmp_path, capsys
):
    out = tmp_path / "new" / "deeper" / "vqa.json"
    assert (
        main(
            [
                "eval",
                "vqa",
                "--ckpt",
                str(exported_vlm),
                "--data",
                str(tiny_default),
                "--limit",
                "2",
                "--batch-size",
                "2",
                "--no-blind",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["n"] == 2
    assert [p.name for p in out.parent.iterdir()] == ["vqa.json"]  # the write test left no file


def test_lmms_tasks_without_a_dataset_is_one_line(tmp_path, capsys):
    code, err = _refused(
        ["eval", "lmms-tasks", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "t")],
        capsys,
    )
    assert code == 2 and "no 'test' split there" in _one_line(err) and not (tmp_path / "t").exists()


def test_a_disk_that_fills_during_the_evaluation_is_one_line(
    exported_vlm, tiny_default, tmp_path, monkeypatch, capsys
):
    """`--out` passed its check, then the disk filled while the model answered: the final write
    fails as one line naming the file, not a traceback."""
    import errno
    import os
    from pathlib import Path

    out = tmp_path / "vqa.json"
    real_write = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self == out:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    code, err = _refused(
        [
            "eval",
            "vqa",
            "--ckpt",
            str(exported_vlm),
            "--data",
            str(tiny_default),
            "--limit",
            "2",
            "--batch-size",
            "2",
            "--no-blind",
            "--out",
            str(out),
        ],
        capsys,
    )
    line = _one_line(err)
    assert code == 2 and line.startswith("vlm eval vqa: ") and f"writing {out} failed" in line
    assert os.strerror(errno.ENOSPC) in line and not out.exists()
