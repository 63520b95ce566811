"""A value logged per step travels through one record: the step's `StepRecord`, from the
accumulator's sums to metrics.jsonl, TensorBoard and W&B alike. A value added where the step's means
are made reaches every sink, and every sink receives the same line."""

import json

import pytest
import torch

from vlm.train import metrics


class Recorder:
    """Stands in for a sink (the dashboard, the W&B tracker) and keeps what it was handed."""

    seen: dict[str, list] = {}

    def __init__(self, name):
        self.name = name
        Recorder.seen[name] = []

    def scalars(self, rec):
        Recorder.seen[self.name].append(dict(rec))

    def pictures(self, step, image, text):
        pass

    def histograms(self, step, chunking, loads):
        Recorder.seen[self.name + "/histograms"] = Recorder.seen.get(
            self.name + "/histograms", []
        ) + [step]

    def document_histograms(self, step, hist, loss, names):
        pass

    def close(self):
        pass


def test_a_value_made_with_the_step_means_reaches_every_sink_unchanged(
    tiny_data, tiny_config, make_trainer, tmp_path, torch_globals, monkeypatch
):
    made = metrics.step_scalars

    def planted(vec, *args, **kwargs):  # the one place a step's means are made
        return {
            **made(vec, *args, **kwargs),
            "planted/tokens_twice": 2 * int(vec[metrics.IDX["tokens/all"]]),
        }

    monkeypatch.setattr(metrics, "step_scalars", planted)
    monkeypatch.setattr(metrics, "Dashboard", lambda *a, **k: Recorder("tensorboard"))
    monkeypatch.setattr(metrics, "WandbTracker", lambda *a, **k: Recorder("wandb"))
    cfg = tiny_config(
        tiny_data,
        logging={"report_to": ["tensorboard", "wandb"], "log_every": 1, "histogram_every": 1},
    )
    run = tmp_path / "run"
    assert make_trainer(cfg, run).train() == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "planted/tokens_twice" in r]
    assert len(steps) == cfg["train"]["max_steps"]
    assert all(r["planted/tokens_twice"] == 2 * r["tokens"] > 0 for r in steps)
    for sink in ("tensorboard", "wandb"):
        assert [metrics.finite_or_none(r) for r in Recorder.seen[sink]] == lines, sink
    assert Recorder.seen["tensorboard/histograms"] == [r["step"] for r in steps]


def test_a_skipped_step_is_a_record_too():
    rec = metrics.StepRecord(4, False).timed(lr=1e-3, seconds=0.5)
    assert rec.scalars == {"step": 4, "skipped": True, "lr": 1e-3, "step_time_s": 0.5}
    done = metrics.StepRecord(4, True, {"tokens": 100}).timed(lr=1e-3, seconds=0.5)
    assert done.scalars["tokens_per_s"] == 200 and "skipped" not in done.scalars


def test_the_record_of_an_accumulator_holds_its_global_means_and_the_tensors_drawn():
    acc = metrics.StepAccumulator(torch.device("cpu"))
    acc.parts.append(
        torch.zeros(len(metrics.FIELDS), dtype=torch.float64).index_fill(
            0, torch.tensor([metrics.IDX["n_lab"], metrics.IDX["tokens/all"]]), 10.0
        )
    )
    acc.parts[0][metrics.IDX["lm_sum"]] = 25.0
    acc.loads["layer0"] = torch.tensor([3.0, 1.0])
    doubled = acc.record(7, lambda flat: 2 * flat)  # two ranks holding the same sums
    assert doubled.step == 7 and doubled.applied
    assert doubled.scalars["lm_loss"] == pytest.approx(2.5) and doubled.scalars["tokens"] == 20
    assert doubled.scalars["moe/max_over_mean/layer0"] == pytest.approx(1.5)
    assert torch.equal(doubled.loads["load/layer0"], torch.tensor([6.0, 2.0], dtype=torch.float64))
    assert doubled.groups is not None and doubled.groups[0].shape[1:] == (2, metrics.NBINS)
