"""The CPU tests do not silently depend on `torch.cuda.is_available()` being False.

On a machine with a GPU, code that picks "cuda" because it is available sends a CPU test's model
there, where it meets references made on the CPU: a device mismatch, or other numerics under
tolerances and bit-for-bit checks made for the CPU. So every CPU test pins its device: tensors and
models it builds itself are on torch's default device, the CPU; the trainer and `load_eval_model`
follow DS_ACCELERATOR, which tests/conftest.py pins to "cpu".

Here a GPU is faked on a CPU-only machine (`torch.cuda.is_available()` True, one device), as it
would look to the tests on a GPU machine: the places that choose a device must still choose the CPU,
and a set of CPU tests that cross them must still pass (run again with VLM_TEST_FAKE_CUDA=1,
conftest's switch). A line such as `device = "cuda" if torch.cuda.is_available() else "cpu"` on
their path fails them: the CPU build of torch refuses the CUDA tensor. On a machine with a GPU the
fake changes nothing and the same checks hold for real.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CPU = torch.device("cpu")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda reports one GPU, and DeepSpeed chooses its accelerator again (it keeps its first choice)."""
    from deepspeed.accelerator import real_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)


def test_the_fake_looks_like_a_gpu_to_code_that_is_not_pinned(fake_cuda, monkeypatch):
    """Without the suite's pin the device choosers pick CUDA under the fake: the checks below are not vacuous."""
    from deepspeed.accelerator import get_accelerator

    from vlm.generate import default_device

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert default_device() == "cuda"
    assert get_accelerator().device_name() == "cuda"


def test_the_suite_pins_the_cpu():
    assert os.environ.get("DS_ACCELERATOR") == "cpu"


def test_the_trainer_runs_on_the_cpu(fake_cuda):
    from deepspeed.accelerator import get_accelerator

    from vlm.train.distributed import init_distributed

    assert get_accelerator().device_name() == "cpu"
    assert init_distributed().device == CPU


def test_load_eval_model_puts_the_model_on_the_cpu(fake_cuda, exported_vlm):
    from vlm.generate import default_device, load_eval_model

    assert default_device() == "cpu"
    chat = load_eval_model(exported_vlm)
    assert chat.device == CPU and all(p.device == CPU for p in chat.model.parameters())
    assert chat.generate(["hello"], None, max_new_tokens=2)


def test_attention_backends_for_cpu_tensors_are_cpu_backends(fake_cuda):
    """The choice follows the tensors' device, not what the machine has."""
    from vision.image_processor import grid_coords
    from vision.packing import build_layout, pick_backend
    from vlm.model.attention import resolve_backend

    assert resolve_backend("auto", CPU) == "docs"
    with pytest.raises(RuntimeError, match="flash-attn"):
        resolve_backend("flash", CPU)
    # two images
    layout = build_layout(torch.cat([grid_coords(2, 2)] * 2), torch.tensor([[2, 2], [2, 2]]), 1)
    assert pick_backend(torch.zeros(8, 4), layout, "auto") == "per_image"
    with pytest.raises(RuntimeError, match="flash-attn"):
        pick_backend(torch.zeros(8, 4, dtype=torch.bfloat16), layout, "flash")


def test_rng_state_round_trips_without_touching_cuda(fake_cuda):
    """A CPU run's checkpoint holds no CUDA generator states (it drew nothing from them), and saving
    or restoring one does not call into CUDA because a GPU is said to be there."""
    from vlm.train.checkpoint import rng_state, set_rng_state

    state = rng_state()
    assert "cuda" not in state
    want = torch.rand(3)
    torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), want)


# Each crosses a place that chooses a device (or that would, written carelessly): the trainer
# through DeepSpeed's accelerator and export; the trainer's RNG state; ConceptMoEChat and
# load_eval_model (lmms-eval's adapter); model-level cached decoding; the attention and NaViT
# backend choice; the precision checks' CPU instances.
REPRESENTATIVE = [
    "tests/test_train_run.py::test_train_single_process_run_dir",
    "tests/test_train_resume.py::test_trainer_state_loads_tensors_only",
    "tests/test_generate.py::test_loglikelihood_matches_the_full_forward",
    "tests/test_generate.py::test_cached_generation_equals_recompute",
    "tests/test_eval_real_model.py::test_lmms_adapter_loads_and_answers_with_exported_model",
    "tests/test_kv_cache.py::test_cached_decoding_equals_full_recompute[greedy-conceptmoe]",
    "tests/test_vision_navit.py::test_attention_backends_agree",
    "tests/test_gpu.py",
]


def test_cpu_tests_pass_with_a_faked_gpu(ROOT, subprocess_env, tmp_path):
    import xml.etree.ElementTree as ET

    env = {k: v for k, v in subprocess_env().items() if not k.startswith(("PYTEST_", "VLM_TEST_"))}
    env["VLM_TEST_FAKE_CUDA"] = "1"
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            *REPRESENTATIVE,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    cases = ET.parse(report).getroot().iter("testcase")
    ran = {f"{c.get('classname')}.{c.get('name')}": c.find("skipped") for c in cases}
    assert len(ran) >= 15, ran
    # every CPU test ran; only the CUDA instances were skipped
    assert all(skip is None or "cuda" in name or "flash" in name for name, skip in ran.items()), ran
