"""Issue 45, exports: `vlm convert` never writes over its source or over another model, and every
loader of an export refuses, in one line, what would otherwise run silently wrong or end in a
traceback: tokenizer files swapped for another model's (chat answered empty and `eval vqa` scored
0.0 % with exit 0), missing or garbage; a config.json that is not an object or whose top-level
hidden_size contradicts its model section; a garbage generation_config.json (transformers fell back
to eos 2); a processor_config.json whose patch size is not the model's (transformers' generate
failed deep in the vision tower). `vlm chat --image` of a missing file, a folder, a FIFO or a file
that is no image is refused before the model loads."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vlm.model.weights_check import CHECKSUMS, SKIP_CHECKSUM_ENV, WeightsError


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """Another model's tokenizer files: a BPE trained on a few sentences (300 ids)."""
    from data_pipelines.tokenizer import train_bpe

    out = tmp_path_factory.mktemp("other_tok")
    train_bpe(["the red square is left of the blue circle"] * 50, 300).save(out)
    return out


def _copy(exported_vlm: Path, tmp_path: Path) -> Path:
    final = tmp_path / "final"
    shutil.copytree(exported_vlm, final)
    return final


def _swap_tokenizer(final: Path, other: Path) -> None:
    for name in ("tokenizer.json", "vlm_tokenizer.json", "tokenizer_config.json"):
        if (other / name).is_file():
            shutil.copy(other / name, final / name)


def _cli(argv, ROOT, subprocess_env, stdin="what is this?\n", timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "vlm.cli", *argv],
        cwd=ROOT,
        env=subprocess_env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if "[WARNING]" not in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# tokenizer files
@pytest.mark.parametrize("checksums", [True, False], ids=["recorded", "older export"])
def test_swapped_tokenizer_files_are_refused_by_chat_and_eval(
    checksums, exported_vlm, other_tokenizer, tmp_path, ROOT, subprocess_env
):
    """An export records its tokenizer files' SHA-256 beside its weights' (a swap fails the
    check); one written before that is checked against its config.json (vocabulary, special ids)."""
    final = _copy(exported_vlm, tmp_path)
    _swap_tokenizer(final, other_tokenizer)
    if not checksums:
        (final / CHECKSUMS).unlink()
    chat = _cli(["chat", "--ckpt", str(final)], ROOT, subprocess_env)
    vqa = _cli(
        ["eval", "vqa", "--ckpt", str(final), "--data", str(tmp_path / "nodata"), "--build"],
        ROOT,
        subprocess_env,
    )
    for done, start in ((chat, "vlm chat: "), (vqa, "config error: ")):
        line = _one_line(done.stderr)
        assert done.returncode == 2 and line.startswith(start), (done.returncode, done.stderr)
        if checksums:
            assert "tokenizer.json: SHA-256 is" in line and "tokenizer changed since" in line
            assert f"{SKIP_CHECKSUM_ENV}=1" in line, line
        else:
            assert re.search(
                r"the tokenizer's vocab size is 2\d\d, the model's config.json says 266", line
            )
        assert "model>" not in done.stdout
    assert not (tmp_path / "nodata").exists()  # refused before the dataset was built


@pytest.mark.parametrize("damage", ["missing", "garbage", "not an object"])
@pytest.mark.parametrize("checksums", [True, False], ids=["recorded", "older export"])
def test_missing_or_garbage_tokenizer_files_are_one_line(damage, checksums, exported_vlm, tmp_path):
    from vlm.generate import load_eval_model

    final = _copy(exported_vlm, tmp_path)
    if not checksums:
        (final / CHECKSUMS).unlink()
    for name in ("tokenizer.json", "vlm_tokenizer.json"):
        if damage == "missing":
            (final / name).unlink()
        else:
            (final / name).write_text("{garbage" if damage == "garbage" else "[1, 2]")
    with pytest.raises(WeightsError) as e:
        load_eval_model(final)
    msg = str(e.value)
    assert "\n" not in msg and str(final) in msg and "tokenizer" in msg, msg


# ------------------------------------------------------------------------------------------------
# config.json, generation_config.json, processor_config.json
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _edit_json(f: Path, fn) -> None:
    f.write_text(json.dumps(fn(json.loads(f.read_text()))))


@pytest.mark.parametrize("command", ["chat", "eval vqa", "demo"])
def test_a_config_json_that_is_not_an_object_is_one_line(
    command, exported_vlm, tmp_path, ROOT, subprocess_env
):
    final = _copy(exported_vlm, tmp_path)
    (final / "config.json").write_text("[1, 2, 3]")
    argv = {
        "chat": ["chat", "--ckpt", str(final)],
        "eval vqa": ["eval", "vqa", "--ckpt", str(final), "--data", str(tmp_path / "d"), "--build"],
        "demo": ["demo", "--ckpt", str(final), "--port", str(_free_port())],
    }[command]
    done = _cli(argv, ROOT, subprocess_env, timeout=120)
    line = _one_line(done.stderr)
    assert done.returncode == 2, done.stderr
    assert "config.json: not a readable model config (a JSON list, not an object)" in line, line


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda c: {**c, "hidden_size": 64}, "hidden_size is 64 but the model section builds 32"),
        (lambda c: {**c, "vocab_size": 9999}, "vocab_size is 9999 but the model section builds"),
        (lambda c: {**c, "model": "oops"}, "'model' is str, not a mapping"),
    ],
    ids=["hidden_size", "vocab_size", "model a string"],
)
def test_a_config_json_that_contradicts_its_model_section_is_refused(
    edit, says, exported_vlm, tmp_path
):
    """Before, the top-level hidden_size won: the config loaded and reported a width the built
    model does not have."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from configs.config import ConfigError
    from vlm.model.hf import load_vlm

    final = _copy(exported_vlm, tmp_path)
    _edit_json(final / "config.json", edit)
    with pytest.raises(WeightsError) as e:
        load_vlm(final)
    assert says in str(e.value) and str(final / "config.json") in str(e.value), str(e.value)
    # transformers' own loaders read the config first: the same line, as a ConfigError
    for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ConfigError) as e:
            load(final)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "text,says",
    [
        ("{not json", "not a readable generation config"),
        ('"just a string"', "a JSON str, not an object"),
        ('{"eos_token_id": "end"}', "eos_token_id 'end' is not a token id"),
        ('{"eos_token_id": [258, 100000]}', "eos_token_id 100000 is not an id of the model"),
    ],
)
def test_a_garbage_generation_config_is_refused_not_replaced_by_defaults(
    text, says, exported_vlm, tmp_path
):
    from transformers import AutoModelForCausalLM

    from vlm.model.hf import load_vlm

    final = _copy(exported_vlm, tmp_path)
    (final / "generation_config.json").write_text(text)
    for load in (lambda: load_vlm(final), lambda: AutoModelForCausalLM.from_pretrained(final)):
        with pytest.raises(WeightsError) as e:
            load()
        assert "generation_config.json" in str(e.value) and says in str(e.value), str(e.value)


@pytest.mark.parametrize("text", ["{not json", "[258]", '{"eos_token_id": "end"}'])
def test_a_garbage_generation_config_of_a_convert_source_is_one_line(text, tmp_path):
    """A transformers source (Qwen3-MoE, Mixtral) is read for its stop ids before its weights."""
    from vlm.model.convert import source_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(WeightsError) as e:
        source_token_ids(tmp_path)
    assert str(tmp_path / "generation_config.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key,value", [("patch_size", 8), ("merge", 1), ("mean", [0.5, 0.5, 0.5])])
def test_a_processor_config_that_disagrees_with_the_model_is_refused_when_loading(
    key, value, exported_vlm, tmp_path
):
    from transformers import AutoModelForCausalLM

    from vlm.generate import load_eval_model

    final = _copy(exported_vlm, tmp_path)
    _edit_json(
        final / "processor_config.json",
        lambda c: {**c, "image_processor": {**c["image_processor"], key: value}},
    )
    for load in (
        lambda: AutoModelForCausalLM.from_pretrained(final),
        lambda: load_eval_model(final),
    ):
        with pytest.raises(WeightsError) as e:
            load()
        msg = str(e.value)
        assert f"image_processor.{key} is {value!r}" in msg and f"vision.processor.{key}" in msg


def test_a_good_export_still_loads_everywhere(exported_vlm):
    from transformers import AutoModelForCausalLM, AutoProcessor

    from vlm.generate import load_eval_model

    AutoModelForCausalLM.from_pretrained(exported_vlm)
    AutoProcessor.from_pretrained(exported_vlm)
    assert load_eval_model(exported_vlm).generate(["hi"], None, max_new_tokens=2)


# ------------------------------------------------------------------------------------------------
# vlm convert
@pytest.fixture(scope="module")
def baseline(tiny_vlm, tmp_path_factory):
    """An exported MoE baseline (chunking off) with a model card beside it."""
    from vlm.model.hf import save_pretrained

    model, tok = tiny_vlm()
    out = tmp_path_factory.mktemp("base") / "final"
    save_pretrained(type(model)(model.model_cfg.baseline(), model.vision_cfg), out, tok)
    (out / "README.md").write_text("the baseline's card")
    return out


def _convert(src: Path, out: Path, *extra: str) -> int:
    from vlm.cli import main

    return main(["convert", str(src), "--out", str(out), "--encoder-layers", "1", *extra])


@pytest.mark.parametrize("where", ["the source", "inside the source", "around the source"])
def test_convert_never_writes_over_its_source(where, baseline, tmp_path, capsys):
    src = tmp_path / "run" / "final"
    shutil.copytree(baseline, src)
    before = _digests(tmp_path / "run")
    out = {"the source": src, "inside the source": src / "ct", "around the source": src.parent}
    assert _convert(src, out[where]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("config error: --out") and "the source folder" in line, line
    assert _digests(tmp_path / "run") == before


def test_convert_into_a_folder_holding_another_model_needs_overwrite_and_replaces_it_whole(
    baseline, exported_vlm, tmp_path, capsys
):
    """Before, the weights, config and tokenizer were replaced without a word (exit 0) and the old
    README and processor config stayed beside them."""
    from vlm.model.hf import load_vlm
    from vlm.model.weights_check import verify_checksums

    out = tmp_path / "other"
    shutil.copytree(exported_vlm, out)
    (out / "README.md").write_text("another model's card")
    before = _digests(out)
    assert _convert(baseline, out) == 2
    line = _one_line(capsys.readouterr().err)
    assert "already holds a model" in line and "--overwrite" in line, line
    assert _digests(out) == before

    assert _convert(baseline, out, "--overwrite") == 0
    names = sorted(p.name for p in out.iterdir())
    assert "README.md" not in names and "processor_config.json" not in names, names
    assert not any(n.startswith(".") for n in names), names
    load_vlm(out)
    verify_checksums(out)
    assert "tokenizer.json" in json.loads((out / CHECKSUMS).read_text())["files"]


# ------------------------------------------------------------------------------------------------
# vlm chat --image
@pytest.fixture
def images(tmp_path, exported_vlm):
    (tmp_path / "notes.txt").write_text("not an image")
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "folder.png").mkdir()
    return {
        "missing": (tmp_path / "nope.png", "no such file"),
        "text": (tmp_path / "notes.txt", "not an image"),
        "FIFO": (tmp_path / "pipe.png", "a FIFO (named pipe), not an image file"),
        "folder": (tmp_path / "folder.png", "a folder, not an image file"),
        "not decodable": (exported_vlm.parent / "broken.png", "not an image"),
    }


@pytest.mark.parametrize("kind", ["missing", "text", "FIFO", "folder", "not decodable"])
def test_chat_image_that_cannot_be_used_is_refused_before_the_model_loads(
    kind, images, exported_vlm, monkeypatch, capsys
):
    """Before: a line, then the turn answered without the image, exit 0 (a FIFO: blocked)."""
    import vlm.generate
    from vlm.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model loaded before --image was checked")

    monkeypatch.setattr(vlm.generate, "load_eval_model", no_load)
    path, says = images[kind]
    assert main(["chat", "--ckpt", str(exported_vlm), "--image", str(path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"vlm chat: --image {path}: ") and says in line, line


def test_a_fifo_attached_in_the_chat_is_never_opened(images, exported_vlm):
    """`/image PIPE` in a conversation: a message, no wait for a writer; the chat goes on; the
    same given to run_chat as a first-turn image ends it with 2 before any turn."""
    import io

    from vlm.chat_cli import run_chat
    from vlm.generate import load_eval_model

    chat = load_eval_model(exported_vlm)
    out = io.StringIO()
    pipe = images["FIFO"][0]
    opened, stop = [], threading.Event()

    def watch():  # a reader that opened the FIFO is freed (and seen): broken code ends, not hangs
        while not stop.is_set():
            try:
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
                opened.append(True)
            except OSError:
                pass
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert run_chat(chat, [f"/image {pipe}", "hello"], out=out, max_new_tokens=2) == 0
        assert run_chat(chat, ["hello"], out=io.StringIO(), images=[str(pipe)]) == 2
    finally:
        stop.set()
        watcher.join()
    assert "a FIFO (named pipe), not an image file" in out.getvalue()
    assert out.getvalue().count("model> ") == 1 and not opened
