"""vlm.train.ds_internals reaches into DeepSpeed's private parts for checkpointing and resharding:
written for DeepSpeed 0.19. Each is pinned here: a new DeepSpeed fails this test until each
function is checked against it (then update the pin)."""

from __future__ import annotations

import collections
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
        "universal_optimizer_file, zero_optimizer_file, zero_fragments, zero_write) against "
        "it, then "
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

    # zero_optimizer_file: the engine's name of a ZeRO 1-2 rank's optimizer file
    fake = SimpleNamespace()
    fake._get_zero_ckpt_prefix = lambda dp, bf16_mode: DeepSpeedEngine._get_zero_ckpt_prefix(
        fake, dp, bf16_mode
    )
    got = DeepSpeedEngine._get_rank_zero_ckpt_name(fake, str(tmp_path), "ds", 0, 3, False)
    assert Path(got) == tmp_path / "ds" / "zero_pp_rank_3_mp_rank_00_optim_states.pt", got
    got = DeepSpeedEngine._get_rank_zero_ckpt_name(fake, str(tmp_path), "ds", 0, 3, True)
    assert Path(got).name == "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt", got
    zero_name_src = inspect.getsource(DeepSpeedEngine._get_zero_ckpt_name)
    assert "dist.get_rank(group=self.optimizer.dp_process_group)" in zero_name_src
    # zero_fragments: the keys of the engine's optimizer file and of stage_1_and_2's state_dict
    from deepspeed.checkpoint import constants
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert constants.OPTIMIZER_STATE_DICT == "optimizer_state_dict"
    assert constants.BASE_OPTIMIZER_STATE == "base_optimizer_state"
    assert constants.SINGLE_PARTITION_OF_FP32_GROUPS == "single_partition_of_fp32_groups"
    assert constants.PARAM_SLICE_MAPPINGS == "param_slice_mappings"
    sd_src = inspect.getsource(DeepSpeedZeroOptimizer.state_dict)
    for part in ("state_dict[BASE_OPTIMIZER_STATE] = self.optimizer.state_dict()",
                 "state_dict[PARAM_SLICE_MAPPINGS] = self._param_slice_mappings"):  # fmt: skip
        assert part in sd_src, part
    # zero_write: each parameter's fragment in its group's flat fp32 partition
    map_src = inspect.getsource(DeepSpeedZeroOptimizer._create_param_mapping)
    assert "self.bit16_groups[i]" in map_src and "self.param_names[lp]" in map_src
    assert "lp._hp_mapping.get_hp_fragment_address()" in map_src
    import importlib

    # (deepspeed.utils re-exports a class of the module's name)
    tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")
    assert "self._hp_mapping.lp_fragment_address" in inspect.getsource(
        tensor_fragment.set_full_hp_param
    )
    init_src = inspect.getsource(DeepSpeedZeroOptimizer.__init__)
    assert "self.single_partition_of_fp32_groups" in init_src


def test_zero_fragments_and_zero_write_move_a_parameter_between_partition_layouts():
    """A parameter split over two writers' partitions, read back and written into one reader's
    partition at another offset: the reader asks for its fragment's elements only, and every
    value lands where the reader keeps it."""
    from deepspeed.utils.tensor_fragment import fragment_address

    from vlm.train.ds_internals import zero_fragments, zero_write

    w = torch.arange(6.0)
    m, v = w + 10, w + 20

    def writer(lo, hi, pad):  # the writer's partition: [pad junk values, its fragment]
        part = lambda t: torch.cat([torch.full((pad,), -1.0), t[lo:hi]])  # noqa: E731
        return {
            "optimizer_state_dict": {
                "single_partition_of_fp32_groups": [part(w)],
                "base_optimizer_state": {
                    "state": {0: {"step": 3, "exp_avg": part(m), "exp_avg_sq": part(v)}}
                },
                "param_slice_mappings": [{"w": fragment_address(numel=hi - lo, start=pad)}],
            }
        }

    pieces = [f for sd in (writer(0, 4, 1), writer(4, 6, 0)) for f in zero_fragments(sd)]
    whole = {k: torch.cat([p[1][k] for p in pieces]) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    assert torch.equal(whole["fp32"], w) and torch.equal(whole["exp_avg_sq"], v)
    whole["step"] = pieces[0][2]
    lp = torch.nn.Parameter(torch.zeros(2, 3))
    lp._hp_mapping = SimpleNamespace(
        get_hp_fragment_address=lambda: fragment_address(numel=4, start=1),
        lp_fragment_address=fragment_address(numel=4, start=2),
    )
    flat = torch.zeros(5)
    zopt = SimpleNamespace(
        optimizer=SimpleNamespace(state=collections.defaultdict(dict)),  # as torch keeps it
        bit16_groups=[[lp]],
        single_partition_of_fp32_groups=[flat],
        param_names={lp: "w"},
    )
    asked = []

    def part(name, start, numel):  # elements [start, start + numel) of the flattened parameter
        asked.append((name, start, numel))
        return {k: t[start : start + numel] if k != "step" else t for k, t in whole.items()}

    zero_write(zopt, part)
    assert asked == [("w", 2, 4)], f"zero_write asked for {asked}, not w's elements 2..5"
    state = zopt.optimizer.state[flat]
    assert torch.equal(flat, torch.tensor([0.0, 2, 3, 4, 5]))
    assert torch.equal(state["exp_avg"], torch.tensor([0.0, 12, 13, 14, 15]))
    assert torch.equal(state["exp_avg_sq"], torch.tensor([0.0, 22, 23, 24, 25]))
    assert state["step"] == 3


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


def test_the_zero3_internals_are_those_they_were_written_for(tmp_path):
    """vlm.train.expert_regroup_zero3's DeepSpeed insides, each pinned: the model-states file's
    name, the attributes a parameter's partition and group live in, the flat fp32 partitions
    whose (lazy) Adam state the local setters write into, the persistent parameters gathered again
    after a load."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    from vlm.train import ds_internals

    assert deepspeed.__version__.startswith("0.19."), (
        f"DeepSpeed {deepspeed.__version__}: check vlm.train.ds_internals (zero3_model_file, "
        "zero3_partition_group, zero3_write_partition, zero3_adam_state, zero3_rewritten) "
        "against it, then update this pin"
    )
    fake = SimpleNamespace(checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: True)
    got = DeepSpeedEngine._get_ckpt_name(fake, str(tmp_path), "ds", pp_placeholder=3)
    assert Path(got) == ds_internals.zero3_model_file(tmp_path / "ds", 3), got
    src = lambda f: inspect.getsource(f)  # noqa: E731
    assert 'getattr(param, "ds_process_group", self.dp_process_group)' in src(
        Stage3._get_param_partition_group
    )
    assert "self.optimizer.state[fp32_param][optim_state_key]" in src(
        Stage3._get_fp32_opt_state_partition
    )
    assert "fp32_param = self.fp32_partitioned_groups_flat[group_idx]" in src(
        Stage3._get_fp32_opt_state_partition
    )
    assert "param.ds_tensor" in src(Stage3._create_fp16_partitions_with_defragmentation)
    assert "persistent_parameters[0].all_gather" in src(Stage3.checkpoint_event_epilogue)
    assert "_partition_all_parameters" in src(Stage3.checkpoint_event_prologue)
