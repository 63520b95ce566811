"""Sizes that cannot be allocated are refused from the config in one line (exit 2), before the run folder exists."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "override",
    [
        "model.hidden_size=99999999999999999999",
        "model.hidden_size=4000000",
        "model.moe.num_experts=50000000",
    ],
)
def test_vlm_train_refuses_a_model_that_cannot_be_allocated(
    tiny_data, tmp_path, tiny_config, write_config, ROOT, subprocess_env, override
):
    path = write_config(tiny_config(tiny_data), tmp_path / "c.yaml")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.train", "--config", str(path), "--out", str(run), override],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert (
        lines[0].startswith("config error: model: ")
        and "to build in float32, more than this machine's" in lines[0]
    )
    assert not run.exists()


def test_the_estimate_is_a_lower_bound_close_to_the_real_count(tiny_data, tiny_config, load_tiny):
    """The refusal never hits a model that could be built (the estimate is at most the real count),
    and it is tight enough to matter (within 10 % on the tiny VLM)."""
    from configs.config import ConfigError
    from vlm.model.multimodal import ConceptMoEVLM
    from vlm.train.sizes import check_buildable

    cfg = load_tiny(tiny_config(tiny_data))
    real = sum(p.numel() for p in ConceptMoEVLM(cfg.model, cfg.vision).parameters())
    check_buildable(cfg, limit=4 * real)  # exactly enough memory for the float32 weights: accepted
    with pytest.raises(ConfigError, match="parameters need"):
        check_buildable(cfg, limit=int(0.9 * 4 * real))
    lo, hi = int(0.9 * real), real
    while hi - lo > 1:  # the smallest limit (in parameters) it accepts
        mid = (lo + hi) // 2
        try:
            check_buildable(cfg, limit=4 * mid)
            hi = mid
        except ConfigError:
            lo = mid
    assert 0.9 * real < hi <= real
