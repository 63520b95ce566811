"""A value logged per step is added in one place and reaches every sink under one name: the step's
`StepRecord`, from the accumulator's sums by name (one all-reduce, sorted by key) to metrics.jsonl,
TensorBoard, W&B and the run's summary. The sinks here are the real ones: TensorBoard's event file
and W&B's offline run are read back.

Legend: B rows, T tokens, D width.
"""

import json

import pytest
import torch

from vlm.train import metrics, metrics_sinks


def _tensorboard_scalars(tb_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def _wandb_history(run_dir) -> dict[int, dict]:
    """What an offline W&B run logged, by step (its run-*.wandb record log, read back)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    ds = datastore.DataStore()
    ds.open_for_scan(str(path))
    steps = {}
    while (data := ds.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item
            }
            steps.setdefault(items["_step"], {}).update(items)
    return steps


def _numbers(rec: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in rec.items()
        if k != "step" and isinstance(v, (int, float)) and v is not None
    }


def test_every_number_of_every_logged_line_is_in_tensorboard_at_its_step(
    tiny_data, tiny_config, make_trainer, tmp_path, torch_globals
):
    cfg = tiny_config(tiny_data, logging={"log_every": 1, "eval_every": 2})
    run = tmp_path / "run"
    assert make_trainer(cfg, run).train() == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tb = _tensorboard_scalars(run / "tb")
    for rec in lines:
        for key, value in _numbers(rec).items():
            assert key in tb and rec["step"] in tb[key], f"{key} at step {rec['step']}"
            assert tb[key][rec["step"]] == pytest.approx(value, rel=1e-6), key
    last = _numbers(lines[-1])
    # the loss terms, the data's counters and the held-out evaluation among them
    for key in ("loss/lm", "loss/ratio", "loss/balance", "tokens", "tokens/text", "val/loss/lm"):
        assert key in last, key
    summary = json.loads((run / "summary.json").read_text())["last"]
    assert _numbers(summary) == pytest.approx(last)


def test_a_value_added_in_one_place_reaches_every_sink(
    tiny_data, tiny_config, make_trainer, tmp_path, torch_globals, monkeypatch
):
    """A statistic added where a micro-batch's metrics are added (`add_output`) reaches
    metrics.jsonl, TensorBoard, W&B (a real offline run, read back) and the summary, unrenamed."""
    pytest.importorskip("wandb")
    made = metrics.StepAccumulator.add_output

    def planted(self, out, batch, *args, **kwargs):
        made(self, out, batch, *args, **kwargs)
        self.add_mean("planted/hidden_mean", out.final_BTD.float().mean() * 10, 10)

    monkeypatch.setattr(metrics.StepAccumulator, "add_output", planted)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tiny_config(tiny_data, logging={"report_to": ["tensorboard", "wandb"], "log_every": 1})
    run = tmp_path / "run"
    assert make_trainer(cfg, run).train() == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("planted/hidden_mean" in r for r in lines if not r.get("skipped"))
    last = lines[-1]
    tb = _tensorboard_scalars(run / "tb")
    assert tb["planted/hidden_mean"][last["step"]] == pytest.approx(last["planted/hidden_mean"])
    logged = _wandb_history(run)[last["step"]]
    for key, value in _numbers(last).items():
        assert logged.get(key) == pytest.approx(value, rel=1e-6), key
    summary = json.loads((run / "summary.json").read_text())["last"]
    assert summary["planted/hidden_mean"] == last["planted/hidden_mean"]


def test_a_skipped_step_is_a_record_too():
    rec = metrics.StepRecord(4, False).timed(lr=1e-3, seconds=0.5)
    assert rec.scalars == {"step": 4, "skipped": True, "lr": 1e-3, "step_time_s": 0.5}
    done = metrics.StepRecord(4, True, {"tokens": 100}).timed(lr=1e-3, seconds=0.5)
    assert done.scalars["tokens_per_s"] == 200 and "skipped" not in done.scalars


def test_sums_are_reduced_by_name_in_one_collective_and_means_derived_from_them():
    acc = metrics.StepAccumulator(torch.device("cpu"))
    acc.add_mean("loss/x", 25.0, 10)  # a mean over 10 tokens
    acc.add_mean("compression/y", 3.0, 0)  # no weight anywhere: no value
    acc.add_count("tokens", 10)
    acc.add("load/layer0", torch.tensor([3.0, 1.0]))
    calls = []

    def two_ranks(flat):  # two ranks holding the same sums
        calls.append(flat.numel())
        return 2 * flat

    rec = acc.record(7, two_ranks)
    assert len(calls) == 1 and rec.step == 7 and rec.applied
    assert rec.scalars["loss/x"] == pytest.approx(2.5) and rec.scalars["compression/y"] is None
    assert rec.scalars["tokens"] == 20 and isinstance(rec.scalars["tokens"], int)
    assert rec.scalars["moe/max_over_mean/layer0"] == pytest.approx(1.5)
    assert torch.equal(rec.loads["load/layer0"], torch.tensor([6.0, 2.0], dtype=torch.float64))
    # earlier runs' names are read as today's
    assert metrics_sinks.current_names({"lm_loss": 1.0, "val/lm_loss": 2.0, "aux_loss": 3.0}) == {
        "loss/lm": 1.0,
        "val/loss/lm": 2.0,
        "loss/ratio": 3.0,
    }
