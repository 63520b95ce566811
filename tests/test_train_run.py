"""`vlm train` in one process: run directory, dashboard, export, non-finite steps. The global
parser in training: tests/test_train_global_parser.py.

Legend: B rows, T tokens, D width.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest
import torch
import yaml

REQUIRED = [
    "step",
    "data/wait_s",
    "data/wait_share",
    "loss",
    "loss/lm",
    "loss/ratio",
    "loss/balance",
    "lr",
    "tokens_per_s",
    "compression/ratio",
    "compression/text",
    "compression/image",
    "boundary_p/text",
    "boundary_p/image",
    "loss/text_only",
    "loss/image_text",
    "nonfinite_steps",
    "skipped/corrupt_image",
]


def _tb(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(
        str(run_dir / "tb"), size_guidance={"images": 0, "tensors": 0, "histograms": 0}
    )
    ea.Reload()
    return ea


def _hf_logits_match(run_dir, module, tokenizer):
    from transformers import AutoModelForCausalLM

    import vlm.model.hf  # noqa: F401  (registers the architecture)
    from configs.batch import PackedBatch

    hf = AutoModelForCausalLM.from_pretrained(str(run_dir / "final")).eval()
    ids = tokenizer.encode("a red circle left of a blue square")
    module.eval()
    with torch.no_grad():
        ref = module(PackedBatch.from_documents([ids])).logits
        got = hf(input_ids=torch.tensor([ids])).logits
    module.train()
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_train_single_process_run_dir(
    tiny_data, tmp_path, torch_globals, make_trainer, tiny_config
):

    run_dir = tmp_path / "run"
    tr = make_trainer(tiny_config(tiny_data), run_dir)
    assert tr.train() == 0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["compression/ratio"] >= 1
        # the loader's wait is part of the step's wall time
        assert 0 <= r["data/wait_s"] <= r["step_time_s"] and 0 <= r["data/wait_share"] <= 1
    assert all("val/loss/lm" in r for r in recs if r["step"] % 2 == 0)
    # bits per byte of the text-only samples: the byte tokenizer's targets are bytes or 0-byte
    # specials (eos), so bpb / (loss / ln 2) = tokens / bytes >= 1, exactly 1 when no eos is a
    # target. The two metrics are separate float divisions of the same sums, so an exact 1 may come
    # out a rounding below it (just under 1 was seen on a GPU machine): allowed 8 float32 roundings
    # (8 * 2^-24 ~ 5e-7), far below the 1 / bytes (bytes: a few hundred here) that one byte too many
    # would take off
    for r in recs:
        if r["loss/text_only"] is not None:
            assert 1.0 - 8 * 2.0**-24 <= r["bpb/text"] / (r["loss/text_only"] / math.log(2)) < 1.5
    assert any(r.get("val/bpb/text") for r in recs)
    assert all(r["text/embed_norm"] > 0 for r in recs)
    assert any(
        r.get("vision/token_norm", 0) > 0 and r.get("vision/token_spread", 0) > 0 for r in recs
    )
    assert recs[0]["lr"] < recs[1]["lr"]  # warm-up
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["hidden_size"] == 32 and saved["train"]["max_steps"] == 4
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["exit_code"] == 0
    ea = _tb(run_dir)
    tags = ea.Tags()
    for t in (
        "compression/text",
        "compression/image",
        "boundary_p/image",
        "loss/image_text",
        "target/ratio",
        "tokens_per_s",
        "val/loss/lm",
    ):
        assert t in tags["scalars"], t
    assert "concepts/image" in tags["images"]
    assert any(h.startswith("boundary_p_hist/") for h in tags["histograms"])
    assert any(h.startswith("expert_load/") for h in tags["histograms"])
    from tensorboard.util import tensor_util

    text = (
        tensor_util.make_ndarray(ea.Tensors("concepts/text/text_summary")[-1].tensor_proto)
        .item()
        .decode()
    )
    assert "|" in text and len(text) > 20
    _hf_logits_match(run_dir, tr.run.engine.module, tr.run.tokenizer)
    card = (run_dir / "final" / "README.md").read_text()  # the model card written at export
    assert (
        "compression" in card
        and "![training report](report.png)" in card
        and "| hidden size |" in card
    )
    assert (run_dir / "final" / "report.png").stat().st_size > 0


def test_mup_zero1_grad_accum_export(tiny_data, tmp_path, torch_globals, tiny_config, make_trainer):
    """muP (logit scale folded into the export), ZeRO-1 and two micro-batches per step."""

    cfg = tiny_config(
        tiny_data,
        params={"mup": True, "mup_base_width": 16},
        deepspeed={"zero_stage": 1},
        optim={"grad_accum": 2},
        train={"max_steps": 2},
        logging={"eval_every": 0},
    )
    run_dir = tmp_path / "run"
    tr = make_trainer(cfg, run_dir)
    assert tr.run.logit_scale == pytest.approx(0.5)
    assert tr.train() == 0
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["step"] == 2 and rec["loss/lm"] > 0
    _hf_logits_match(run_dir, tr.run.engine.module, tr.run.tokenizer)


def _nan_hook(out, k):
    return dataclasses.replace(out, final_BTD=out.final_BTD + float("nan"))


def _nan_grad_hook(out, k):
    """A finite loss whose gradient is NaN: d/dx sqrt(|x - x|) is inf * 0 at 0."""
    poison = (out.final_BTD - out.final_BTD.detach()).abs().sqrt()
    return dataclasses.replace(out, final_BTD=out.final_BTD + poison)


def _snapshot(tr):
    return {n: p.detach().clone() for n, p in tr.run.engine.module.named_parameters()} | {
        n: b.detach().clone()
        for n, b in tr.run.engine.module.named_buffers()
        if n.endswith("expert_bias")
    }


@pytest.mark.parametrize("zero_stage,grad_accum,bad_micro", [(0, 1, 0), (0, 2, 1), (1, 2, 0)])
def test_nonfinite_step_is_skipped(
    tiny_data, tmp_path, torch_globals, zero_stage, grad_accum, bad_micro, tiny_config, make_trainer
):
    cfg = tiny_config(
        tiny_data, deepspeed={"zero_stage": zero_stage}, optim={"grad_accum": grad_accum}
    )
    tr = make_trainer(cfg, tmp_path / "run")
    it = iter(tr.run.loader)
    window = lambda: [next(it) for _ in range(grad_accum)]  # noqa: E731
    tr.after_step(tr.train_step(window()))
    before = _snapshot(tr)
    opt_before = copy.deepcopy(tr.run.optimizer.state_dict()["state"])
    epoch = tr.run.scheduler.last_epoch
    res = tr.train_step(
        window(), loss_hook=lambda out, k: _nan_hook(out, k) if k == bad_micro else out
    )
    tr.after_step(res)
    assert not res.applied and tr.nonfinite_total == 1 and tr.nonfinite_in_row == 1
    after = _snapshot(tr)
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed the model"
    assert tr.run.scheduler.last_epoch == epoch
    # DeepSpeed counts the skipped step itself (on the plain fp32 path the optimizer reports it as
    # an overflow)
    assert (
        tr.run.engine.skipped_steps == 1
        and tr.run.engine.global_steps == tr.step == 2
        and not tr.run.engine.was_step_applied()
    )
    # no stale gradient of the skipped window survives into the next step
    assert all(p.grad is None or not p.grad.any() for p in tr.run.engine.module.parameters())
    opt_after = tr.run.optimizer.state_dict()["state"]
    assert all(
        torch.equal(a, b)
        for k in opt_before
        for a, b in zip(opt_before[k].values(), opt_after[k].values())
        if torch.is_tensor(a)
    )
    assert all(
        float(m.load_accum.abs().sum()) == 0
        for m in tr.run.engine.module.modules()
        if hasattr(m, "load_accum")
    )
    res = tr.train_step(window())
    tr.after_step(res)
    assert res.applied and tr.nonfinite_in_row == 0
    after2 = _snapshot(tr)
    assert any(not torch.equal(after[n], after2[n]) for n in after)
    assert all(torch.isfinite(v).all() for v in after2.values())


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_finite_loss_with_nonfinite_gradient_is_skipped(
    tiny_data, tmp_path, torch_globals, zero_stage, tiny_config, make_trainer
):
    cfg = tiny_config(tiny_data, deepspeed={"zero_stage": zero_stage})
    tr = make_trainer(cfg, tmp_path / "run")
    it = iter(tr.run.loader)
    tr.after_step(tr.train_step([next(it)]))
    before = _snapshot(tr)
    res = tr.train_step([next(it)], loss_hook=_nan_grad_hook)
    tr.after_step(res)
    assert not res.applied and tr.nonfinite_total == 1
    after = _snapshot(tr)
    assert all(torch.equal(before[n], after[n]) for n in before), (
        "a NaN gradient reached the weights"
    )
    res = tr.train_step([next(it)])
    assert res.applied and all(torch.isfinite(p).all() for p in tr.run.engine.module.parameters())


def test_nonfinite_in_a_row_stops_with_checkpoint(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 10, "max_nonfinite_in_row": 2},
        checkpoint={"save_every": 0},
        logging={"eval_every": 0},
    )
    run_dir = tmp_path / "run"
    trainer = {}  # from the second step on, every micro-batch's loss is NaN
    tr = make_trainer(
        cfg, run_dir, loss_hook=lambda out, k: _nan_hook(out, k) if trainer["it"].step >= 1 else out
    )
    trainer["it"] = tr
    assert tr.train() == 1
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in recs] == [False, True, True]
    assert recs[-1]["nonfinite_steps"] == 2
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000003"]
    assert not (run_dir / "final").exists()


def test_loss_weighting_gives_the_global_token_mean(
    tiny_data, tmp_path, torch_globals, tiny_config, make_trainer
):
    """Two one-row micro-batches update the model exactly like one two-row batch: each micro-batch's
    LM loss is weighted by its share of the step's labelled tokens (chunking and balance loss off so
    that nothing else depends on how rows are grouped)."""
    from configs.batch import PackedBatch
    from data_pipelines.loader import build_loader
    from vlm.train.metrics import labelled_counts

    def trainer(rows, ga, name):
        cfg = tiny_config(
            tiny_data,
            data={"rows_per_batch": rows},
            optim={"grad_accum": ga},
            logging={"eval_every": 0},
        )
        cfg["model"]["chunk"]["enabled"] = False
        cfg["loss"] = {"balance": 0.0}
        return make_trainer(cfg, tmp_path / name)

    whole, split = trainer(2, 1, "whole"), trainer(1, 2, "split")
    it = iter(build_loader(split.run.cfg.data, split.run.tokenizer, 0, 1))
    a, b = next(it), next(it)
    na, nb = int(labelled_counts(a)[0]), int(labelled_counts(b)[0])
    assert na != nb, "pick rows with different label counts so the weighting matters"
    whole.after_step(whole.train_step([PackedBatch.stack([a, b])]))
    split.after_step(split.train_step([a, b]))
    pw, ps = (
        dict(whole.run.engine.module.named_parameters()),
        dict(split.run.engine.module.named_parameters()),
    )
    for n in pw:
        torch.testing.assert_close(ps[n], pw[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_zero3_trains_and_exports(tiny_data, tmp_path, torch_globals, tiny_config, make_trainer):
    """ZeRO-3 partitions parameters; the chunker's outputs must stay traceable through module outputs."""

    cfg = tiny_config(
        tiny_data, deepspeed={"zero_stage": 3}, train={"max_steps": 2}, logging={"eval_every": 0}
    )
    run_dir = tmp_path / "run"
    tr = make_trainer(cfg, run_dir)
    assert tr.train() == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in lines)
    assert (run_dir / "final" / "config.json").is_file()
    # the banner counts the whole model, not this rank's ZeRO-3 partition (0 before)
    from vlm.model.multimodal import ConceptMoEVLM

    whole = sum(p.numel() for p in ConceptMoEVLM(tr.run.cfg.model, tr.run.cfg.vision).parameters())
    assert f"model: {whole:,} parameters ({whole:,} trainable)" in tr.run.banner[0]


def test_nonfinite_weights_are_never_exported(
    tiny_data, tmp_path, torch_globals, make_trainer, tiny_config
):
    from vlm.train.export import export_final
    from vlm.train.report import summary_lines

    tr = make_trainer(tiny_config(tiny_data), tmp_path / "run")
    with torch.no_grad():
        next(tr.run.engine.module.parameters())[0].fill_(float("nan"))
    assert (
        export_final(
            tr.run.engine, tr.run.dir, tr.run.tokenizer, tr.run.logit_scale, tr.run.is_main, tr.log
        )
        is None
    )
    assert (
        not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / ".tmp-final").exists()
    )
    lines = summary_lines([{"step": 1, "loss/lm": 1.0}], {}, None, tmp_path / "run", 1.0, 0, {})
    assert "no final/ exported" in lines[-1] and "final" not in lines[-1].replace(
        "no final/ exported", ""
    )


def _listening_addresses() -> list[str]:
    """Local addresses of this process's listening TCP sockets (Linux /proc)."""
    import os
    from pathlib import Path

    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN, one of ours
                out.append(cols[1].split(":")[0])
    return out


@pytest.mark.skipif(
    not __import__("pathlib").Path("/proc/net/tcp").exists(), reason="needs Linux /proc"
)
def test_one_process_run_listens_on_loopback_only(
    tiny_data, tmp_path, torch_globals, make_trainer, tiny_config
):
    make_trainer(tiny_config(tiny_data), tmp_path / "run")
    addrs = _listening_addresses()
    everywhere = {"00000000", "00000000000000000000000000000000"}
    assert not everywhere & set(addrs), f"a listener on all interfaces: {addrs}"


def test_a_redirected_log_gets_plain_progress_lines(
    tiny_data, tmp_path, tiny_config, write_config, run_train_cli, ROOT
):
    """No carriage-return progress bars when stderr is not a terminal: periodic `train step k/N` lines instead."""
    cfg = tiny_config(
        tiny_data, train={"max_steps": 4}, logging={"progress": True, "eval_every": 0}
    )
    proc = run_train_cli(
        ["--config", str(write_config(cfg, tmp_path / "c.yaml")), "--out", str(tmp_path / "run")],
        cwd=ROOT,
    )
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    assert "train step 4/4" in proc.stderr
    # the share of the step spent waiting for data, in every progress line
    assert re.search(r"train step 4/4 .*data \d+%", proc.stderr)
