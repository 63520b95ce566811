"""Suite-wide settings and the fixtures shared by several test modules.

`make test` runs two pytest workers on two cores, so each uses one torch thread (more threads than
cores makes torch's pool thrash and tests slow down by orders of magnitude).

Shared helpers are fixtures here, never imported from sibling test modules: data (`png`,
`write_text_shards`, `decode_docs`, `batches_equal`, `TINY_DEFAULT`, `tiny_default`), trainer
(`ROOT`, `TINY`, `tiny_data`, `tiny_config`, `write_config`, `load_tiny`, `make_trainer`,
`torch_globals`, `subprocess_env`, `run_train_cli`) and outputs (`read_only_dir`: a folder that
refuses writes). A fixture that gives a helper function returns the function itself, so a test
calls it by the same name.

Devices: the suite is a CPU suite, on a machine with a GPU too. Every test runs on the CPU unless it
is marked `gpu` (the CUDA instances in tests/test_gpu.py; `make test-gpu` runs them). A test that
builds its own tensors and models gets the CPU as torch's default device; the trainer takes its
device from DeepSpeed's accelerator (vlm.train.distributed) and `load_eval_model` from
`vlm.generate.default_device`, and both follow DS_ACCELERATOR, which this file pins to "cpu" for the
test process and for the processes the tests start (they inherit it). With VLM_TEST_FAKE_CUDA=1,
`torch.cuda.is_available()` says True in the test process, as on a GPU machine, so that a CPU test
which silently needs it to be False fails on a CPU-only machine too (tests/test_device_pinning.py
runs a set of them so; `VLM_TEST_FAKE_CUDA=1 make test` runs them all).
"""

import copy
import io
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))

import pytest
import torch
import yaml

torch.set_num_threads(1)

_ROOT = Path(__file__).resolve().parents[1]


# ---- devices (see the module doc)
# ----------------------------------------------------------------------------

# DeepSpeed reads DS_ACCELERATOR once per process, at its first get_accelerator(): set before
# anything imports it.
_USER_DS_ACCELERATOR = os.environ.get("DS_ACCELERATOR")
os.environ["DS_ACCELERATOR"] = "cpu"

# A GPU as the CPU tests would see one: torch.cuda.is_available() True, one device. Process-wide, so
# that module- and session-scoped fixtures see it too. The CPU build of torch then refuses any
# tensor that code sends to "cuda" because is_available() said so, which is the point.
_FAKE_CUDA = os.environ.get("VLM_TEST_FAKE_CUDA") == "1"
if _FAKE_CUDA:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1


# The suite's time on 2 cores is bounded (docs/reliability.md): tests that repeat a check the suite
# makes once (another resharding, the inductor backend besides aot_eager) run with VLM_TEST_EXTENDED=1.
_EXTENDED = os.environ.get("VLM_TEST_EXTENDED") == "1"


def pytest_collection_modifyitems(config, items):
    if not _EXTENDED:
        skip = pytest.mark.skip(
            reason="extended: runs with VLM_TEST_EXTENDED=1 (make test-extended)"
        )
        for item in items:
            if item.get_closest_marker("extended") is not None:
                item.add_marker(skip)
    if _FAKE_CUDA:
        skip = pytest.mark.skip(
            reason="VLM_TEST_FAKE_CUDA=1 fakes a GPU for the CPU tests; gpu tests need a real one"
        )
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_tests_see_the_machine_as_it_is(request, monkeypatch):
    """The CPU pin is for the CPU tests: a test marked `gpu` gets the user's DS_ACCELERATOR back
    (unset: DeepSpeed detects the GPU), and DeepSpeed detects again instead of keeping an
    accelerator an earlier test chose."""
    if request.node.get_closest_marker("gpu") is None:
        return
    if _USER_DS_ACCELERATOR is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", _USER_DS_ACCELERATOR)
    real_accelerator = sys.modules.get("deepspeed.accelerator.real_accelerator")
    if real_accelerator is not None:
        monkeypatch.setattr(real_accelerator, "ds_accelerator", None)


# ---- data
# ------------------------------------------------------------------------------------------------


def _tiny_default_config():
    from data_pipelines.default_dataset import DefaultDatasetConfig

    return DefaultDatasetConfig(
        train_scenes=120,
        val_scenes=20,
        test_scenes=20,
        interleaved_docs=16,
        text_docs=60,
        shard_max_count=50,
    )


def _png(
    w: int = 40, h: int = 30, colour=(255, 0, 0), fmt: str = "PNG", mode: str = "RGB"
) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (w, h), colour if mode == "RGB" else 0).save(buf, fmt)
    return buf.getvalue()


def _write_text_shards(directory: Path, n: int, per_shard: int, prefix: str = "t") -> list[str]:
    """Text-only samples whose text names them ("doc 17 ..."), so a packed batch can be decoded back."""
    from data_pipelines.schema import Sample
    from data_pipelines.writer import ShardWriter

    texts = [f"doc {i} " + "x" * (i % 23) for i in range(n)]
    with ShardWriter(directory, prefix, max_count=per_shard) as w:
        for i, t in enumerate(texts):
            w.write(Sample(key=f"{prefix}{i:05d}", kind="text", text=t))
    return texts


def _batches_equal(a, b) -> bool:
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def _decode_docs(batch, tok) -> list[str]:
    """Text of every document in a packed batch (specials dropped)."""
    out = []
    for r in range(batch.input_ids.shape[0]):
        ids, doc = batch.input_ids[r], batch.doc_ids[r]
        for d in doc.unique().tolist():
            if d >= 0:
                out.append(tok.decode(ids[doc == d].tolist()))
    return out


def _seeded_lm(cfg, seed: int = 0):
    from vlm.model.conceptmoe import ConceptMoELM

    torch.manual_seed(seed)
    return ConceptMoELM(cfg).eval()


def _rand_docs(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def png():
    """png(w=40, h=30, colour=(255, 0, 0), fmt="PNG", mode="RGB") -> the encoded image's bytes."""
    return _png


@pytest.fixture(scope="session")
def write_text_shards():
    """write_text_shards(directory, n, per_shard, prefix="t") -> the n texts written as text-only shards."""
    return _write_text_shards


@pytest.fixture(scope="session")
def batches_equal():
    """batches_equal(a, b): every tensor field of two packed batches equal (None where the other is None)."""
    return _batches_equal


@pytest.fixture(scope="session")
def decode_docs():
    """decode_docs(batch, tok) -> the text of every document in a packed batch."""
    return _decode_docs


@pytest.fixture(scope="session")
def seeded_lm():
    """seeded_lm(cfg, seed=0): a ConceptMoELM built after torch.manual_seed(seed), in eval mode."""
    return _seeded_lm


@pytest.fixture(scope="session")
def rand_docs():
    """rand_docs(vocab, lengths, seed): one document per length, random ids in 3..vocab-1 (above the specials)."""
    return _rand_docs


@pytest.fixture(scope="session")
def TINY_DEFAULT():
    """A small default-dataset config (seconds to build)."""
    return _tiny_default_config()


@pytest.fixture(scope="session")
def tiny_default(tmp_path_factory) -> Path:
    """The default dataset built with TINY_DEFAULT, shared by the tests of the session."""
    from data_pipelines.default_dataset import build_default

    return build_default(
        tmp_path_factory.mktemp("data") / "default", _tiny_default_config(), progress=False
    )


# ---- trainer
# ---------------------------------------------------------------------------------------------

_TINY = {
    "model": {
        "vocab_size": 272,
        "hidden_size": 32,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 16,
        "encoder_layers": 1,
        "concept_layers": 1,
        "decoder_layers": 1,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
        "chunk": {"enabled": True, "target_ratio": 2.0, "merge": "sum"},
    },
    "vision": {
        "processor": {"patch_size": 14, "min_patches": 4, "max_patches": 16, "merge": 2},
        "encoder": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "max_grid": 16},
        "projector": {"kind": "linear"},
    },
    "data": {
        "tokenizer": "byte",
        "row_tokens": 128,
        "rows_per_batch": 2,
        "shuffle_buffer": 16,
        "pack_buffer": 8,
        "num_workers": 0,
    },
    "optim": {
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_steps": 2,
        "schedule": "cosine",
        "clip": 1.0,
        "grad_accum": 1,
    },
    "deepspeed": {"zero_stage": 0},
    "logging": {
        "log_every": 1,
        "eval_every": 2,
        "eval_batches": 1,
        "histogram_every": 2,
        "progress": False,
    },
    "checkpoint": {"save_every": 2, "keep_last": 2},
    # the default run warms its fresh tower up for 1000 steps and trains it at half the LLM's rate:
    # the tiny runs test the trainer, not the recipe
    "vision_warmup": {"steps": 0},
    "params": {"vision_lr_mult": 1.0, "projector_lr_mult": 1.0},
    "train": {
        "stage": "vl",
        "max_steps": 4,
        "seed": 0,
        "deterministic": True,
        "vqa_eval": False,
        "threads": 1,
    },
}


def _sources(data_dir: Path, split: str) -> list[dict]:
    from data_pipelines.default_dataset import default_sources

    return default_sources(data_dir, split)


def _tiny_config(data_dir: Path, **sections) -> dict:
    """The tiny config as a dict; `sections` update whole sections shallowly, e.g. optim={"grad_accum": 2}."""
    cfg = copy.deepcopy(_TINY)
    cfg["data"]["sources"] = _sources(data_dir, "train")
    cfg["logging"]["eval_sources"] = _sources(data_dir, "val")
    for name, upd in sections.items():
        if upd is None:
            cfg[name] = None
        else:
            cfg.setdefault(name, {}).update(upd)
    return cfg


def _write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _load_tiny(cfg: dict):
    from configs.config import from_dict
    from vlm.train.config import TrainConfig

    return from_dict(TrainConfig, copy.deepcopy(cfg))


def _make_trainer(cfg_dict, run_dir, resume=None, **kwargs):
    from vlm.train.trainer import Trainer

    return Trainer(_load_tiny(cfg_dict), run_dir, resume=resume, log=lambda *_: None, **kwargs)


def _subprocess_env() -> dict:
    env = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_train_cli(
    args: list[str], cwd: Path, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "vlm.train", *args],
        cwd=cwd,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"vlm train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def ROOT() -> Path:
    """The repository root."""
    return _ROOT


@pytest.fixture(scope="session")
def TINY() -> dict:
    """The tiny training config as a dict (shared: copy before changing it)."""
    return _TINY


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small default dataset (seconds to build), shared by all trainer tests of the session."""
    from data_pipelines.default_dataset import DefaultDatasetConfig, build_default

    out = tmp_path_factory.mktemp("train_data") / "default"
    build_default(
        out,
        DefaultDatasetConfig(
            train_scenes=48,
            val_scenes=12,
            test_scenes=12,
            interleaved_docs=8,
            text_docs=48,
            shard_max_count=16,
        ),
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def tiny_config():
    """tiny_config(data_dir, **sections) -> the tiny config dict reading `data_dir` (sections updated shallowly)."""
    return _tiny_config


@pytest.fixture(scope="session")
def write_config():
    """write_config(cfg, path) -> path, the config written as YAML."""
    return _write_config


@pytest.fixture(scope="session")
def load_tiny():
    """load_tiny(cfg_dict) -> the validated TrainConfig."""
    return _load_tiny


@pytest.fixture(scope="session")
def make_trainer():
    """make_trainer(cfg_dict, run_dir, resume=None, **Trainer kwargs) -> a quiet Trainer."""
    return _make_trainer


@pytest.fixture(scope="session")
def subprocess_env():
    """subprocess_env() -> os.environ without distributed settings, with the repository on PYTHONPATH."""
    return _subprocess_env


@pytest.fixture(scope="session")
def run_train_cli():
    """run_train_cli(args, cwd, timeout=600, check=True) -> the finished `python -m vlm.train ARGS` process."""
    return _run_train_cli


@pytest.fixture
def torch_globals():
    """The trainer sets deterministic algorithms and thread counts; give other tests their state back."""
    det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- a tiny VLM with the
# byte tokenizer
def _tiny_vlm():
    """(ConceptMoEVLM, byte tokenizer): the small vision + ConceptMoE model the generation tests share."""
    from data_pipelines.tokenizer import load_tokenizer
    from vision.config import VisionConfig
    from vision.image_processor import ImageProcessorConfig
    from vision.navit import NaViTConfig
    from vlm.model.config import ModelConfig, MoEConfig
    from vlm.model.multimodal import ConceptMoEVLM

    tok = load_tokenizer("byte")
    vc = VisionConfig(
        processor=ImageProcessorConfig(patch_size=4, min_patches=4, max_patches=16, merge=2),
        encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16),
    )
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        init_std=0.2,
    )
    return ConceptMoEVLM(cfg, vc), tok


@pytest.fixture(scope="module")
def tiny_vlm():
    """tiny_vlm() -> (ConceptMoEVLM, tokenizer), a fresh copy each call (same seed, same weights)."""
    return _tiny_vlm


@pytest.fixture(scope="module")
def exported_vlm(tmp_path_factory):
    """RUN/final of the tiny VLM exported with its tokenizer; RUN/a.png is an image, RUN/broken.png is not."""
    import numpy as np
    from PIL import Image

    from vlm.model.hf import save_pretrained

    model, tok = _tiny_vlm()
    out = tmp_path_factory.mktemp("run") / "final"
    save_pretrained(model, out, tokenizer=tok)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
        out.parent / "a.png"
    )
    (out.parent / "broken.png").write_bytes(b"\x89PNG not really")
    return out


# ---- folders that refuse writes
@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nothing can be written into (for the commands that write an output): chmod 555 for a
    user; as root (whom chmod does not stop) a read-only tmpfs where mounting is allowed; skipped
    elsewhere. Checked by trying to write into it."""
    d = tmp_path / "ro"
    d.mkdir()
    mounted = False
    if os.geteuid() != 0:
        d.chmod(0o555)
    elif (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True
        ).returncode
        == 0
    ):
        mounted = True
    else:
        pytest.skip(
            "running as root (chmod does not stop root) and mounting a read-only tmpfs is "
            "not allowed; the tests of a file in the way of --out cover the same check"
        )
    try:
        try:
            (d / "probe").write_bytes(b"x")
        except OSError:
            pass
        else:
            pytest.skip(f"{d} could not be made read-only here")
        yield d
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        else:
            d.chmod(0o755)
