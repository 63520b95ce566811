"""`vlm chat`: multi-turn image chat in the terminal; piped input gives one answer per line and exit code 0."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

from vlm.chat_cli import Conversation, run_chat


@pytest.fixture(scope="module")
def exported(exported_vlm):
    return exported_vlm


def test_conversation_keeps_turns_and_images_in_order(exported):
    from vlm.generate import load_eval_model

    conv = Conversation(load_eval_model(exported), max_new_tokens=5)
    assert "attached" in conv.attach(str(exported.parent / "a.png"))
    pieces = []
    first = conv.ask("what is this?", on_text=pieces.append)
    assert "".join(pieces) == first                      # the streamed pieces make up the answer
    conv.ask("and now?")
    assert [t["role"] for t in conv.turns] == ["user", "assistant", "user", "assistant"]
    assert conv.turns[0]["content"].startswith("<image>\n") and len(conv.images) == 1 and conv.pending == []
    assert "cannot use image" in conv.attach(str(exported.parent / "broken.png")) and conv.pending == []


def test_piped_lines_give_one_answer_each(exported):
    from vlm.generate import load_eval_model

    out = io.StringIO()
    lines = ["hello", f"/image {exported.parent / 'a.png'}", "describe it", "/image /nonexistent.png", "/reset", "bye"]
    assert run_chat(load_eval_model(exported), lines, out=out, max_new_tokens=4) == 0
    text = out.getvalue()
    assert text.count("model> ") == 3 and "conversation cleared" in text and "cannot use image" in text


def test_vlm_chat_command_reads_stdin_and_exits_0(exported, subprocess_env):
    proc = subprocess.run([sys.executable, "-m", "vlm.cli", "chat", "--ckpt", str(exported), "--max-new-tokens", "3",
                           "--image", str(exported.parent / "a.png")],
                          input="first question\nsecond question\n", capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("model> ") == 2
    bad = subprocess.run([sys.executable, "-m", "vlm.cli", "chat", "--ckpt", "/nonexistent"], capture_output=True,
                         text=True, env=subprocess_env(), timeout=300)
    assert bad.returncode == 2 and "no exported model there" in bad.stderr and "Traceback" not in bad.stderr
