"""Shared pieces of the trainer tests: a tiny default dataset and a tiny training config (no tests here)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "model": {
        "vocab_size": 272, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
        "encoder_layers": 1, "concept_layers": 1, "decoder_layers": 1,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "balance_loss_weight": 0.01},
        "chunk": {"enabled": True, "target_ratio": 2.0, "ratio_loss_weight": 0.03, "merge": "sum"},
    },
    "vision": {
        "processor": {"patch_size": 14, "min_patches": 4, "max_patches": 16, "merge": 2},
        "encoder": {"patch_size": 14, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "merge": 2, "max_grid": 16},
        "projector": {"kind": "linear"},
    },
    "data": {"tokenizer": "byte", "row_tokens": 128, "rows_per_batch": 2, "shuffle_buffer": 16, "pack_buffer": 8,
             "num_workers": 0,
             "processor": {"patch_size": 14, "min_patches": 4, "max_patches": 16, "merge": 2}},
    "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "schedule": "cosine", "clip": 1.0, "grad_accum": 1},
    "deepspeed": {"zero_stage": 0},
    "logging": {"log_every": 1, "eval_every": 2, "eval_batches": 1, "histogram_every": 2, "progress": False},
    "checkpoint": {"save_every": 2, "keep_last": 2},
    "train": {"stage": "vl", "max_steps": 4, "seed": 0, "deterministic": True, "vqa_eval": False, "threads": 1},
}


def _sources(data_dir: Path, split: str) -> list[dict]:
    from data_pipelines.default_dataset import default_sources

    return default_sources(data_dir, split)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small default dataset (seconds to build), shared by all trainer tests of the session."""
    from data_pipelines.default_dataset import DefaultDatasetConfig, build_default

    out = tmp_path_factory.mktemp("train_data") / "default"
    build_default(out, DefaultDatasetConfig(train_scenes=48, val_scenes=12, test_scenes=12, interleaved_docs=8,
                                            text_docs=48, shard_max_count=16), progress=False)
    return out


def tiny_config(data_dir: Path, **sections) -> dict:
    """The tiny config as a dict; `sections` update whole sections shallowly, e.g. optim={"grad_accum": 2}."""
    cfg = copy.deepcopy(TINY)
    cfg["data"]["sources"] = _sources(data_dir, "train")
    cfg["logging"]["eval_sources"] = _sources(data_dir, "val")
    for name, upd in sections.items():
        if upd is None:
            cfg[name] = None
        else:
            cfg.setdefault(name, {}).update(upd)
    return cfg


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def load_tiny(cfg: dict):
    from configs.config import from_dict
    from vlm.train.config import TrainConfig

    return from_dict(TrainConfig, copy.deepcopy(cfg))


def subprocess_env() -> dict:
    env = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_train_cli(args: list[str], cwd: Path, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "vlm.train", *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"vlm train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc
