"""`vlm chat`: multi-turn image chat in the terminal; piped input gives one answer per line and exit code 0."""
from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from data_pipelines.tokenizer import load_tokenizer
from vision.config import VisionConfig
from vision.image_processor import ImageProcessorConfig
from vision.navit import NaViTConfig
from vlm.chat_cli import Conversation, run_chat
from vlm.generate import ConceptMoEChat
from vlm.model.config import MoEConfig, ModelConfig
from vlm.model.hf import save_pretrained
from vlm.model.multimodal import ConceptMoEVLM


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = load_tokenizer("byte")
    vc = VisionConfig(processor=ImageProcessorConfig(patch_size=4, min_patches=4, max_patches=16, merge=2),
                      encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32), init_std=0.2)
    out = tmp_path_factory.mktemp("chat") / "final"
    save_pretrained(ConceptMoEVLM(cfg, vc), out, tokenizer=tok)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(out.parent / "a.png")
    (out.parent / "broken.png").write_bytes(b"\x89PNG not really")
    return out


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
