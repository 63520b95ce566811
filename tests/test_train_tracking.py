"""`logging.report_to`: metrics go to TensorBoard and/or Weights & Biases (offline, no network)."""

import re

import pytest

wandb = pytest.importorskip("wandb")


def test_a_run_logs_to_wandb_offline_and_a_resume_continues_the_same_run(
    tiny_data, tiny_config, make_trainer, tmp_path, torch_globals, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tiny_config(tiny_data, logging={"report_to": ["wandb"], "wandb_project": "test"})
    run = tmp_path / "run"
    assert make_trainer(cfg, run).train() == 0
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    run_id = (run / "wandb_id").read_text()
    assert runs[0].name.endswith(run_id)
    assert not (run / "tb").exists()  # TensorBoard was not asked for
    cfg["train"]["max_steps"] = 6
    assert make_trainer(cfg, run, resume=True).train() == 0
    assert (run / "wandb_id").read_text() == run_id  # the same wandb run continues
    # wandb names an offline run's folder offline-run-<time>-<id>, adding -1, -2 when two start in
    # one second
    names = [p.name for p in (run / "wandb").glob("offline-run-*")]
    same_run = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?")
    assert len(names) == 2 and all(same_run.fullmatch(n) for n in names), names


def test_an_unknown_reporter_is_refused_by_name(tiny_data, tiny_config, load_tiny):
    from configs.config import ConfigError

    with pytest.raises(ConfigError, match="logging.report_to entry 'mlflow'"):
        load_tiny(tiny_config(tiny_data, logging={"report_to": ["tensorboard", "mlflow"]}))
