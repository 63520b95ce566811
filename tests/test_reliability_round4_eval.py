"""Issue 45, evaluation and the other commands that write results: `vlm eval vqa --data` on
imported VQA shards scores their questions (it was a traceback); a `--data` that does not exist is
refused unless `--build` asks for the default dataset there (a typo built 58 MB at the typo); `eval
ppl --data` of a file that is no shard is one line; `vlm flops --seq-len 0` and a `--plot` that
cannot be written are refused before any work; `vlm bench`, `vlm experiment`, `vlm scaling` and
`vlm data train-tokenizer` check `--out` first (bench failed after 70 s of work)."""

from __future__ import annotations

import json
import time

import pytest

from vlm.cli import main


def _exit(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if "[WARNING]" not in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _no_build(monkeypatch):
    import data_pipelines.default_dataset as dd

    def build(*a, **k):
        raise AssertionError("the default dataset was built")

    monkeypatch.setattr(dd, "ensure_default_dataset", build)
    monkeypatch.setattr(dd, "build_default", build)


# ------------------------------------------------------------------------------------------------
# vlm eval vqa / probe / ppl / ct-start: --data
@pytest.fixture(scope="module")
def vqa_shards(tmp_path_factory, png):
    """Imported VQA shards: a table of question/answer rows over two images."""
    from data_pipelines.importers import import_table

    d = tmp_path_factory.mktemp("vqa")
    (d / "red.png").write_bytes(png(colour=(255, 0, 0)))
    (d / "blue.png").write_bytes(png(colour=(0, 0, 255)))
    rows = [
        {"image": f"{c}.png", "question": "What colour is the square?", "answer": c}
        for c in ("red", "blue", "red")
    ]
    (d / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import_table(d / "t.jsonl", d / "shards")
    (d / "t2.jsonl").write_text(json.dumps({"image": "red.png", "caption": "a red square"}) + "\n")
    import_table(d / "t2.jsonl", d / "captions")
    return d


def test_vqa_scores_the_questions_of_imported_shards(vqa_shards, exported_vlm, tmp_path, capsys):
    out = tmp_path / "vqa.json"
    rc, stdout, err = _exit(
        ["eval", "vqa", "--ckpt", str(exported_vlm), "--data", str(vqa_shards / "shards")]
        + ["--no-blind", "--out", str(out)],
        capsys,
    )
    assert rc == 0, err
    assert "VQA exact match on 3 questions" in stdout and "Traceback" not in err
    res = json.loads(out.read_text())
    assert res["n"] == 3 and res["majority_answers"] == {"unknown": "red"}


def test_vqa_on_shards_without_questions_is_one_line(vqa_shards, exported_vlm, capsys, monkeypatch):
    import vlm.generate

    monkeypatch.setattr(vlm.generate, "load_eval_model", lambda *a: pytest.fail("model loaded"))
    rc, _, err = _exit(
        ["eval", "vqa", "--ckpt", str(exported_vlm), "--data", str(vqa_shards / "captions")],
        capsys,
    )
    line = _one_line(err)
    assert rc == 2 and "its shards hold no VQA questions" in line, line


@pytest.mark.parametrize(
    "command", ["vqa", "probe", "ppl", "ct-start"], ids=["vqa", "probe", "ppl", "ct-start"]
)
def test_a_data_folder_that_does_not_exist_needs_build(
    command, exported_vlm, tmp_path, capsys, monkeypatch
):
    """A typo in --data builds nothing: one line naming --build, before the model loads."""
    import vlm.generate

    _no_build(monkeypatch)
    monkeypatch.setattr(vlm.generate, "load_eval_model", lambda *a: pytest.fail("model loaded"))
    typo = tmp_path / "data" / "defualt"
    argv = {
        "vqa": ["eval", "vqa", "--ckpt", str(exported_vlm), "--data", str(typo)],
        "probe": ["eval", "probe", "--ckpt", str(exported_vlm), "--data", str(typo)],
        "ppl": ["eval", "ppl", "--ckpt", str(exported_vlm), "--default-dir", str(typo)],
        "ct-start": ["eval", "ct-start", str(exported_vlm), "--data", str(typo)],
    }[command]
    rc, _, err = _exit(argv, capsys)
    line = _one_line(err)
    assert rc == 2 and f"{typo} does not exist; add --build" in line, line
    assert not typo.exists() and not typo.parent.exists()


def test_build_builds_the_missing_dataset_after_the_model_loaded(
    exported_vlm, tmp_path, capsys, monkeypatch
):
    """With --build the dataset is built (after the model loaded: a bad model costs no build)."""
    import data_pipelines.default_dataset as dd
    import vlm.generate

    order = []
    real_load = vlm.generate.load_eval_model
    monkeypatch.setattr(
        vlm.generate, "load_eval_model", lambda *a: order.append("model") or real_load(*a)
    )

    def build(path, *a, **k):
        order.append("build")
        raise SystemExit(0)  # the build itself is not what is tested here

    monkeypatch.setattr(dd, "ensure_default_dataset", build)
    target = tmp_path / "new"
    _exit(["eval", "vqa", "--ckpt", str(exported_vlm), "--data", str(target), "--build"], capsys)
    assert order == ["model", "build"]


@pytest.mark.parametrize("what", ["a text file", "a folder of other files"])
def test_data_that_is_not_a_dataset_is_one_line(what, exported_vlm, tmp_path, capsys, monkeypatch):
    import vlm.generate

    _no_build(monkeypatch)
    monkeypatch.setattr(vlm.generate, "load_eval_model", lambda *a: pytest.fail("model loaded"))
    if what == "a text file":
        data = tmp_path / "notes.txt"
        data.write_text("some text\n")
        argv = ["eval", "ppl", "--ckpt", str(exported_vlm), "--data", str(data)]
        says = "is not a webdataset shard"
    else:
        data = tmp_path / "mine"
        data.mkdir()
        (data / "photo.jpg").write_bytes(b"x")
        argv = ["eval", "vqa", "--ckpt", str(exported_vlm), "--data", str(data)]
        says = "holds files but no default dataset"
    rc, _, err = _exit(argv, capsys)
    line = _one_line(err)
    assert rc == 2 and says in line, line


# ------------------------------------------------------------------------------------------------
# vlm flops
@pytest.mark.parametrize(
    "flag,value",
    [("--seq-len", "0"), ("--seq-len", "-5"), ("--bytes-per-el", "0"), ("--ratio", "0.5")]
    + [("--ratio", "nan"), ("--loop-layers", "0"), ("--concept-heads", "-1"), ("--tol", "-1")],
)
def test_flops_arguments_are_refused_when_parsed(flag, value, capsys):
    rc, _, err = _exit(["flops", flag, value], capsys)
    assert rc == 2 and "Traceback" not in err and f"argument {flag}" in err, err


def test_flops_plot_that_cannot_be_written_is_refused_first(tmp_path, capsys, monkeypatch):
    import vlm.flops_cli

    monkeypatch.setattr(
        vlm.flops_cli, "comparison_table", lambda *a, **k: pytest.fail("computed before the check")
    )
    (tmp_path / "f").write_text("a file")
    for plot, says in (
        (tmp_path / "f" / "x.png", "is a file, not a folder"),
        (tmp_path, "is a folder; give a file name"),
    ):
        rc, _, err = _exit(["flops", "--plot", str(plot)], capsys)
        line = _one_line(err)
        assert rc == 2 and line.startswith("error: --plot") and says in line, line


def test_flops_plot_on_a_read_only_mount(read_only_dir, capsys):
    rc, _, err = _exit(["flops", "--plot", str(read_only_dir / "x.png")], capsys)
    line = _one_line(err)
    assert rc == 2 and f"cannot write in {read_only_dir}" in line, line


# ------------------------------------------------------------------------------------------------
# --out before the work
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "model", "--quick", "--out", "{f}"],
        ["experiment", "dynamic-vs-fixed", "--out", "{f}"],
        ["scaling", "fit", "{run}", "--out", "{f}"],
        ["scaling", "sweep", "--out", "{f}"],
        ["data", "train-tokenizer", "{run}", "--vocab-size", "300", "--out", "{f}"],
    ],
    ids=["bench", "experiment", "scaling fit", "scaling sweep", "train-tokenizer"],
)
def test_out_a_file_is_one_line_before_the_work(argv, tmp_path, capsys, monkeypatch):
    import importlib

    real = importlib.import_module

    def no_part(name, *a, **k):
        if name.startswith("eval.bench.") and name != "eval.bench.common":
            pytest.fail("a benchmark part ran before --out was checked")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_part)
    f = tmp_path / "f"
    f.write_text("a file")
    (tmp_path / "run").mkdir()
    t0 = time.time()
    rc, _, err = _exit([a.format(f=f, run=tmp_path / "run") for a in argv], capsys)
    line = _one_line(err)
    assert rc == 2 and str(f) in line and "file" in line, line
    assert f.read_text() == "a file" and time.time() - t0 < 30
