"""`vlm chat`: multi-turn image chat in the terminal; piped input gives one answer per line and exit code 0.

Legend: D width, P patches.
"""

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
    assert "".join(pieces) == first  # the streamed pieces make up the answer
    conv.ask("and now?")
    assert [t["role"] for t in conv.turns] == ["user", "assistant", "user", "assistant"]
    assert (
        conv.turns[0]["content"].startswith("<image>\n")
        and len(conv.images) == 1
        and conv.pending == []
    )
    assert (
        "cannot use image" in conv.attach(str(exported.parent / "broken.png"))
        and conv.pending == []
    )


def test_piped_lines_give_one_answer_each(exported):
    from vlm.generate import load_eval_model

    out = io.StringIO()
    lines = [
        "hello",
        f"/image {exported.parent / 'a.png'}",
        "describe it",
        "/image /nonexistent.png",
        "/reset",
        "bye",
    ]
    assert run_chat(load_eval_model(exported), lines, out=out, max_new_tokens=4) == 0
    text = out.getvalue()
    assert (
        text.count("model> ") == 3 and "conversation cleared" in text and "cannot use image" in text
    )


def test_vlm_chat_command_reads_stdin_and_exits_0(exported, subprocess_env):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlm.cli",
            "chat",
            "--ckpt",
            str(exported),
            "--max-new-tokens",
            "3",
            "--image",
            str(exported.parent / "a.png"),
        ],
        input="first question\nsecond question\n",
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("model> ") == 2
    bad = subprocess.run(
        [sys.executable, "-m", "vlm.cli", "chat", "--ckpt", "/nonexistent"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert (
        bad.returncode == 2
        and "no exported model there" in bad.stderr
        and "Traceback" not in bad.stderr
    )


def test_piped_input_skips_oversized_and_undecodable_lines_and_answers_the_rest(
    exported, subprocess_env
):
    """The probes: one 5 MB line (it ran 600 s and took 13.9 GB) and a non-UTF-8 byte (a traceback,
    and nothing after it answered). Both are skipped with a message; the line after them is
    answered; exit 0."""
    data = b"first\n" + b"y" * 5_000_000 + b"\n" + b"caf\xe9 au lait\n" + b"last\n"
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.cli", "chat", "--ckpt", str(exported), "--max-new-tokens", "2"],
        input=data,
        capture_output=True,
        env=subprocess_env(),
        timeout=300,
    )
    out = proc.stdout.decode()
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert out.count("model> ") == 2
    assert "[line skipped: longer than 131072 bytes]" in out
    assert "[line skipped: not UTF-8 text (byte 0xe9 at position 3)]" in out


def test_a_turn_over_the_prompt_limit_is_refused_before_the_model_sees_it(exported):
    from vlm.generate import load_eval_model

    chat = load_eval_model(exported)
    calls = []
    real = chat.generate
    chat.generate = lambda *a, **k: calls.append(1) or real(*a, **k)
    out = io.StringIO()
    assert (
        run_chat(
            chat, ["x" * 120, "x" * 401, "short"], out=out, max_new_tokens=2, max_prompt_tokens=50
        )
        == 0
    )
    text = out.getvalue()
    # 120 characters are under the cheap bound (50 x 8) but over 50 tokens: counted, refused; 401
    # never tokenized
    assert (
        text.count("[cannot answer: prompt too long: the conversation would exceed 50 tokens") == 2
    )
    assert len(calls) == 1  # only "short" reached the model


def test_images_are_kept_at_the_size_the_model_sees_and_bounded_per_conversation(
    exported, tmp_path
):
    """A 3000 x 2000 upload is held at its patch grid's size (the processor then sees the same
    pixels as from the original file), and a conversation holds at most max_images of them."""
    import numpy as np
    import torch
    from PIL import Image

    from vlm.generate import load_eval_model

    chat = load_eval_model(exported)
    big = tmp_path / "big.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).resize((3000, 2000)).save(
        big
    )
    conv = Conversation(chat, max_images=2)
    assert "attached" in conv.attach(str(big))
    held = conv.pending[0]
    p = chat.processor.cfg.patch_size
    # 16 patches of 4x4, not 6 Mpx
    assert held.width * held.height <= chat.processor.cfg.max_patches * p * p
    direct, kept = chat.processor(str(big)), chat.processor(held)
    assert direct.grid == kept.grid and torch.equal(direct.patches_PD, kept.patches_PD)
    assert "attached" in conv.attach(str(big))
    assert "holds 2 images already" in conv.attach(str(big)) and len(conv.pending) == 2
    conv.reset()
    assert "attached" in conv.attach(str(big))


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--max-new-tokens", "-1", "must be a whole number of tokens >= 1, got -1"),
        ("--max-new-tokens", "0", "must be a whole number of tokens >= 1, got 0"),
        ("--temperature", "nan", "must be a finite number >= 0 (0: greedy), got nan"),
        ("--temperature", "-5", "must be a finite number >= 0 (0: greedy), got -5"),
        ("--temperature", "inf", "must be a finite number >= 0 (0: greedy), got inf"),
        ("--max-prompt-tokens", "0", "must be a whole number of tokens >= 1, got 0"),
    ],
)
def test_bad_generation_options_are_refused_at_start(flag, value, says, capsys):
    """The probes: these were accepted, then failed turn by turn or were ignored (a
    negative temperature decoded greedily; --max-prompt-tokens 0 skipped every line as
    "longer than 0 bytes"). Refused when parsed, before the model is looked for; the prompt
    limit's message counts tokens."""
    from vlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["chat", "--ckpt", "/nonexistent", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"vlm chat: error: argument {flag}: {says}" in err
    assert "Traceback" not in err and "bytes" not in err
