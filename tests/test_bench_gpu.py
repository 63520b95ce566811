"""`vlm bench gpu`: the GPU measurement command, checked on the CPU with `--smoke` (toy shapes,
every section: training step and MFU, kernel launches, prefill with forced and learned boundaries,
decode at batch 1 and 8, memory per token with and without selective checkpointing, compiled
training and decoding). It checks what the command writes, never the speed it measures. Without CUDA
and without --smoke it refuses in one line (exit 2). The CUDA instance (marked gpu) runs the same
smoke on the GPU, where the memory and kernel counts are real."""

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import torch

from eval.bench import gpu
from eval.bench.cli import PARTS
from eval.bench.gpu.devices import peak_bf16
from eval.bench.model import BASELINE
from vlm.cli import main


def _smoke(out, cuda: bool) -> tuple[int, dict, str]:
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        # a CPU test on every machine (a GPU one, or one that fakes a GPU) runs the CPU path
        if not cuda:
            mp.setattr(torch.cuda, "is_available", lambda: False)
        rc = main(["bench", "gpu", "--smoke", "--out", str(out)])
    return rc, json.loads((out / "gpu.json").read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    rc, res, printed = _smoke(out, cuda=False)
    return SimpleNamespace(rc=rc, res=res, printed=printed, out=out)


def _rows(res, section, **setting):
    return [
        r
        for r in res["rows"]
        if r["setting"].get("section") == section
        and all(r["setting"].get(k) == v for k, v in setting.items())
    ]


def _check_every_section(res: dict, cuda: bool) -> None:
    names = list(res["configs"])
    reallocs = [n for n in names if n != BASELINE]
    assert names[0] == BASELINE and set(reallocs) == {
        "more_experts",
        "loop_more_experts",
        "wider_concept",
    }
    assert res["part"] == "gpu" and res["mode"] == "smoke" and res["complete"]
    assert res["errors"] == {}, res["errors"]
    assert {k: v["status"] for k, v in res["sections"].items()} == {k: "done" for k in gpu.SECTIONS}
    assert {"name", "device", "torch", "cuda", "peak", "peak_note"} <= set(res["gpu"])
    s = res["settings"]

    # training step: a row per candidate, the baseline included, with its model FLOPs and MFU (null
    # without a peak)
    train = {r["candidate"]: r for r in _rows(res, "train", mode="eager")}
    assert list(train) == names
    for r in train.values():
        assert r["median"] > 0 and r["train_flops_per_token"] > 0 and r["step_ms"] > 0
        assert {"mfu", "mfu_incl_attn_map"} <= set(r)
        assert (r["mfu"] is None) == (res["gpu"]["peak"] is None)
    assert train[BASELINE]["ratio_vs_baseline"] == 1.0

    # prefill at every length: the baseline, and every reallocation with forced and with learned
    # boundaries, and forced with the training capacity in eval mode too ("tight")
    for T in s["prefill_lens"]:
        rows = {r["candidate"]: r for r in _rows(res, "prefill", seq_len=T)}
        kinds = ("forced", "learned", "forced, tight")
        assert set(rows) == {BASELINE} | {f"{n} ({k})" for n in reallocs for k in kinds}
        for n in reallocs:
            assert rows[f"{n} (forced)"]["R"] == s["ratio"]
            assert rows[f"{n} (forced, tight)"]["eval_capacity_slack"] == 1.25
            assert (
                rows[f"{n} (learned)"]["boundaries"] == "learned"
                and rows[f"{n} (learned)"]["R"] >= 1
            )

    # decode at batch 1 and 8, every candidate, in ms per step
    for B in (1, 8):
        rows = _rows(res, "decode", mode="eager", batch=B)
        assert [r["candidate"] for r in rows] == names and all(
            r["unit"] == "ms" and r["median"] > 0 for r in rows
        )

    # memory per token, with and without selective checkpointing: a figure on CUDA, null with the
    # reason on a CPU
    mem = {(m["candidate"], m["activation_checkpoint"]): m for m in res["memory"]}
    assert set(mem) == {(n, ac) for n in names for ac in ("none", "selective")}
    for m in mem.values():
        if cuda:
            assert m["MiB_per_token"] > 0 and m["peak_step_bytes"] > 0
        else:
            assert m["MiB_per_token"] is None and "CUDA" in m["reason"]

    # kernel launches per step, eager: every candidate's training and decode steps
    launches = {(x["candidate"], x["mode"], x["step"]): x for x in res["launches"]}
    metric = "CUDA kernels per step" if cuda else "operators per step (CPU, non-view aten ops)"
    for n in names:
        for step in ("train", "decode B=8"):
            assert (
                launches[(n, "eager", step)]["per_step"] > 0
                and launches[(n, "eager", step)]["metric"] == metric
            )
    if cuda:
        assert all(launches[(n, "eager", "train")]["host_syncs_per_step"] >= 0 for n in names)

    # compiled: each candidate's training step compiled (with its launches and a row) or unavailable
    # with a reason
    compiled = {r["candidate"]: r for r in _rows(res, "train", mode="compiled")}
    for n in names:
        x = launches[(n, "compiled", "train")]
        if n in compiled:
            assert x["per_step"] > 0 and compiled[n]["compile_s"] >= 0
        else:
            assert (
                x["per_step"] is None
                and res["unavailable"][f"{n} (compiled train)"]
                and x["reason"]
            )
    # ... and each candidate's decode step compiled at both batch sizes or unavailable with a reason
    for n in names:
        for B in (1, 8):
            row = [r for r in _rows(res, "decode", mode="compiled", batch=B) if r["candidate"] == n]
            assert (
                row
                or res["unavailable"].get(f"{n} (compiled decode B={B})")
                or res["unavailable"].get(f"{n} (compiled decode)")
            ), (n, B)
    for x in res["eager_vs_compiled"]:
        assert x["compiled_speedup"] > 0 and x["section"] in ("train", "decode")

    # the targets, as verdicts next to the figures
    assert len(res["targets"]) == 4
    for t in res["targets"]:
        assert {"target", "threshold", "value", "detail", "pass"} <= set(t)
        assert t["pass"] in (True, False, None) and (t["pass"] is None) == (t["value"] is None)


def test_smoke_writes_every_section(smoke):
    assert smoke.rc == 0
    _check_every_section(smoke.res, cuda=False)
    assert (smoke.out / "gpu.png").stat().st_size > 0
    assert "== gpu ==" in smoke.printed
    verdicts = smoke.printed.split("targets (smoke: toy shapes, not meaningful):\n")[
        1
    ].splitlines()[:4]
    assert all(v.split()[0] in ("PASS", "FAIL", "n/a") for v in verdicts), verdicts


def test_without_cuda_it_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        len(err.strip().splitlines()) == 1
        and "CUDA" in err
        and "--smoke" in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "gpu.json").exists()


def test_gpu_is_not_part_of_all():
    assert "gpu" not in PARTS


def test_device_peaks_are_dense_bf16_and_an_unknown_device_has_none():
    assert peak_bf16("NVIDIA H100 80GB HBM3")["tflops"] == 989.4
    assert peak_bf16("NVIDIA H100 PCIe")["tflops"] == 756.5
    assert peak_bf16("NVIDIA H200")["tflops"] == 989.4
    assert peak_bf16("NVIDIA GH200 480GB")["match"] == "GH200"
    assert peak_bf16("NVIDIA A100-SXM4-80GB")["tflops"] == 312.0
    assert peak_bf16("NVIDIA A10G")["approximate"] and peak_bf16("NVIDIA L40S")["tflops"] == 362.05
    assert (
        peak_bf16("NVIDIA L4")["tflops"] == 121.0
        and peak_bf16("NVIDIA GeForce RTX 4090")["tflops"] == 165.2
    )
    assert peak_bf16("NVIDIA RTX A1000") is None and peak_bf16("Tesla T4") is None


def test_launch_counts_read_the_profilers_events():
    from torch.autograd import DeviceType

    def ev(name, device, activity=None, children=()):
        return SimpleNamespace(
            name=name, device_type=device, activity_type=activity, cpu_children=list(children)
        )

    mm = ev("aten::mm", DeviceType.CPU, "cpu_op")
    events = [
        ev("aten::linear", DeviceType.CPU, "cpu_op", [mm]),
        mm,
        ev("aten::add", DeviceType.CPU, "cpu_op"),
        ev("cudaLaunchKernel", DeviceType.CPU, "cuda_runtime"),
        ev("cudaStreamSynchronize", DeviceType.CPU, "cuda_runtime"),
        # the one that ends the profile
        ev("cudaDeviceSynchronize", DeviceType.CPU, "cuda_runtime"),
        ev("ampere_bf16_gemm", DeviceType.CUDA, "kernel"),
        ev("elementwise_kernel", DeviceType.CUDA, "kernel"),
        ev("Memcpy DtoH (Device -> Pinned)", DeviceType.CUDA, "gpu_memcpy"),
        # an older profiler: no activity type
        ev("triton_poi_fused_0", DeviceType.CUDA, None),
    ]
    got = gpu.launch_counts(events, cuda=True, steps=2)
    assert (
        got["per_step"] == 1.5
        and got["memcpy_per_step"] == 0.5
        and got["host_syncs_per_step"] == 0.5
    )
    got = gpu.launch_counts(events, cuda=False, steps=1)
    assert got["per_step"] == 2  # aten::mm and aten::add: aten::linear runs no kernel of its own


def test_cuda_memory_probe_measures_what_the_step_adds(monkeypatch):
    state = {"allocated": 100, "peak": 0}

    def reset(device=None):
        state["peak"] = state["allocated"]

    def step():
        state["peak"] = max(state["peak"], state["allocated"] + 50)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dev = gpu.Device()
    dev.cuda, dev.device = True, torch.device("cpu")
    assert dev.step_peak_bytes(step) == 50
    dev.cuda = False
    assert dev.step_peak_bytes(step) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_smoke_on_cuda_counts_kernels_and_memory(tmp_path):
    rc, res, _ = _smoke(tmp_path, cuda=True)
    assert rc == 0
    _check_every_section(res, cuda=True)
