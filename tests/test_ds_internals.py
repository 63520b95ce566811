"""vlm.train.ds_internals reaches into DeepSpeed's private parts for checkpointing and resharding:
written for DeepSpeed 0.19. Each is pinned here: a new DeepSpeed fails this test until each
function is checked against it (then update the pin)."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import torch


def test_the_deepspeed_internals_are_those_they_were_written_for(tmp_path):
    import deepspeed
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    from vlm.train import ds_internals

    assert deepspeed.__version__.startswith("0.19."), (
        f"DeepSpeed {deepspeed.__version__}: check vlm.train.ds_internals (engine_writes, "
        "moe_optimizer_file, module_file, restore_engine_counters, to_universal, "
        "universal_optimizer_file) against it, then "
        "update this pin"
    )
    # engine_writes: the engine writes every checkpoint file through its checkpoint engine's save
    params = list(inspect.signature(TorchCheckpointEngine.save).parameters)
    assert params == ["self", "state_dict", "path"], params
    src = inspect.getsource(DeepSpeedEngine.save_checkpoint) + inspect.getsource(
        DeepSpeedEngine._save_moe_checkpoint
    )
    assert "self.checkpoint_engine.save(" in src
    assert "zipfile_serialization" in inspect.getsource(TorchCheckpointEngine.__init__)
    # moe_optimizer_file / module_file: the engine's own names
    fake = SimpleNamespace(checkpoint_mp_rank=0)
    got = DeepSpeedEngine._get_optimizer_ckpt_name(fake, str(tmp_path), "ds", 3)
    assert Path(got) == ds_internals.moe_optimizer_file(tmp_path / "ds", 3), got
    fake = SimpleNamespace(checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: False)
    got = DeepSpeedEngine._get_ckpt_name(fake, str(tmp_path), "ds")
    assert Path(got) == ds_internals.module_file(tmp_path / "ds"), got
    # restore_engine_counters: what its _load_checkpoint restores
    load_src = inspect.getsource(DeepSpeedEngine._load_checkpoint)
    for key in ("global_steps", "global_samples", "skipped_steps"):
        assert f"checkpoint['{key}']" in load_src or f"checkpoint.get('{key}'" in load_src, key
    # to_universal: the converter's options
    parser_src = inspect.getsource(ds_to_universal.parse_arguments)
    for opt in ("input_folder", "output_folder", "num_extract_workers", "num_merge_workers",
                "keep_temp_folder", "no_strict", "inject_missing_state"):  # fmt: skip
        assert f"--{opt}" in parser_src, f"ds_to_universal has no --{opt}"
    assert "args.strict" in inspect.getsource(ds_to_universal)
    # universal_optimizer_file: where the converter writes the groups' settings
    assert 'os.path.join(zero_output_folder, "optimizer_state.pt")' in inspect.getsource(
        ds_to_universal
    )
    assert (
        ds_internals.universal_optimizer_file(tmp_path) == tmp_path / "zero" / "optimizer_state.pt"
    )


def test_engine_writes_captures_every_write_and_puts_the_method_back():
    from vlm.train.ds_internals import engine_writes

    class Writer:
        zipfile_serialization = False

        def save(self, state_dict, path):
            raise AssertionError("written by the engine's own writer")

    engine = SimpleNamespace(checkpoint_engine=Writer())
    seen = []
    with engine_writes(engine, lambda sd, path, zipfile: seen.append((path, zipfile))):
        engine.checkpoint_engine.save({"w": torch.ones(1)}, "x.pt")
    assert seen == [("x.pt", False)]
    assert engine.checkpoint_engine.save.__func__ is Writer.save
