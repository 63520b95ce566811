"""Exported weights are checked before they are trusted: every way in (from_pretrained, AutoModel,
train.init_from, vlm chat, vlm demo, the lmms-eval adapter) refuses a bad export in one line naming
the file and the first bad tensor; a missing tensor never comes from uninitialised memory, and a
pickle is never unpickled."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlm.model.weights_check import WeightsError

EMBED = "vlm.lm.embed.weight"


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling would create the marker file


def _damaged(src, dst, how):
    """A copy of the export `src` at `dst` with its weights damaged `how`; (dst, what the one line must say)."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    w = load_file(f)
    keys = list(w)
    if how in ("float16", "int64", "bool"):
        w[EMBED] = w[EMBED].to(getattr(torch, how))
        save_file(w, f)
        return dst, f"tensor {EMBED} has dtype {how}, the config needs float32"
    if how == "nan":
        w = {k: torch.full_like(v, float("nan")) for k, v in w.items()}
        save_file(w, f)
        return dst, "non-finite values"
    if how == "half_missing":
        save_file({k: w[k] for k in keys[::2]}, f)
        return dst, "is missing (the config needs"
    if how == "shape":
        w[EMBED] = w[EMBED][:-1]
        save_file(w, f)
        return dst, f"tensor {EMBED} has shape"
    if how == "extra":
        w["vlm.surprise"] = torch.zeros(3)
        save_file(w, f)
        return dst, "tensor vlm.surprise is not part of the model"
    if how == "truncated":
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
        return dst, "not a readable safetensors file"
    if how == "pickle":
        f.write_bytes(pickle.dumps({"w": _RunsCode(str(dst / "pwned"))}))
        return dst, "not a readable safetensors file"
    if how == "bin_only":
        f.unlink()
        torch.save(w, dst / "pytorch_model.bin")
        return dst, "pickled weights are never loaded"
    raise AssertionError(how)


KINDS = [
    "float16",
    "int64",
    "bool",
    "nan",
    "half_missing",
    "shape",
    "extra",
    "truncated",
    "pickle",
    "bin_only",
]


@pytest.mark.parametrize("how", KINDS)
def test_from_pretrained_refuses_bad_weights_in_one_line(exported_vlm, tmp_path, how):
    from transformers import AutoModelForCausalLM

    from vlm.model.hf import load_vlm

    bad, says = _damaged(exported_vlm, tmp_path / "final", how)
    with pytest.raises(WeightsError) as e:
        load_vlm(bad)
    msg = str(e.value)
    assert says in msg and str(bad) in msg and "\n" not in msg, msg
    with pytest.raises(WeightsError, match="tensor|safetensors"):
        AutoModelForCausalLM.from_pretrained(str(bad))  # the Auto class reaches the same check
    assert not (bad / "pwned").exists()


def test_a_good_export_still_loads(exported_vlm):
    from vlm.model.hf import load_vlm

    model = load_vlm(exported_vlm)
    want = load_file(exported_vlm / "model.safetensors")
    got = {f"vlm.{k}": v for k, v in model.state_dict().items()}
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_bfloat16_export_loads_with_its_float32_expert_bias(tiny_vlm, tmp_path):
    """A bf16 run exports bf16 weights, but the MoE keeps its expert bias in float32: the check
    expects each tensor in the dtype the model itself gives it, not one dtype for all."""
    from vlm.model.hf import load_vlm, save_pretrained

    model, tok = tiny_vlm()
    save_pretrained(model.bfloat16(), tmp_path / "final", tokenizer=tok)
    dtypes = {v.dtype for v in load_file(tmp_path / "final" / "model.safetensors").values()}
    assert dtypes == {torch.bfloat16, torch.float32}
    assert next(load_vlm(tmp_path / "final").lm.parameters()).dtype == torch.bfloat16


def test_init_from_refuses_int64_weights(exported_vlm, tmp_path):
    """The probe that trained at loss 6.2 million: int64 weights through train.init_from."""
    from configs.config import ConfigError
    from vlm.model.hf import ConceptMoEConfig
    from vlm.model.multimodal import ConceptMoEVLM
    from vlm.train.stages import load_pretrained_weights

    bad, says = _damaged(exported_vlm, tmp_path / "final", "int64")
    model = ConceptMoEVLM(*ConceptMoEConfig.from_pretrained(str(exported_vlm)).build_configs())
    with pytest.raises(ConfigError, match=says):
        load_pretrained_weights(model, bad)


@pytest.mark.parametrize("command", ["chat", "demo"])
def test_chat_and_demo_refuse_bad_weights_in_one_line(
    exported_vlm, tmp_path, subprocess_env, command
):
    if command == "demo":
        pytest.importorskip("gradio")
    bad, says = _damaged(exported_vlm, tmp_path / "final", "half_missing")
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.cli", command, "--ckpt", str(bad)],
        input="hello\n",
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "WARNING" not in ln and ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"vlm {command}: {bad / 'model.safetensors'}: tensor "
    )
    assert says in lines[0], lines
    assert "Traceback" not in proc.stderr and "serving" not in proc.stdout


def test_lmms_adapter_refuses_bad_weights_in_one_line(exported_vlm, tmp_path):
    pytest.importorskip("lmms_eval")
    from eval.lmms_adapter import ConceptMoELMMS

    bad, says = _damaged(exported_vlm, tmp_path / "final", "nan")
    with pytest.raises(SystemExit) as e:
        ConceptMoELMMS(pretrained=str(bad))
    assert (
        says in str(e.value.code)
        and str(bad) in str(e.value.code)
        and "\n" not in str(e.value.code)
    )
