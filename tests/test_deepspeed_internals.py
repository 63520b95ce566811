"""Every use of DeepSpeed's insides outside the checkpoint code (issue 52): each is one named
function, and each is pinned here to the DeepSpeed it was written for (0.19), with what of
DeepSpeed it relies on checked as far as a test can without processes: a new DeepSpeed fails here,
naming the function to check, before it fails a run. (vlm.train.distributed.deepspeed_expert_groups
is pinned the same way in tests/test_parallel_layout.py.)

Legend: E experts, D width, F expert hidden width.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import deepspeed
import pytest
import torch

WRITTEN_FOR = "0.19."

# function -> what it does with DeepSpeed's insides
PINNED = {
    "vlm.train.distributed.skip_deepspeed_shm_build": "replaces deepspeed.comm.torch.build_shm_op",
    "vlm.train.engine.report_step": "sets an optimizer's overflow / _global_grad_norm",
    "vlm.train.engine.load_checkpoints_safely": "replaces engine.checkpoint_engine.load",
    "vlm.train.engine.safe_load": "allows ZeRO's pickled classes by their module paths",
    "vlm.train.expert_parallel.mark_expert": "sets a parameter's allreduce / group_name",
    "vlm.train.expert_parallel.deepspeed_view": "subclasses DeepSpeed's MoE / AutoEP layer",
    "vlm.model.shares.zero3_partition": "ZeRO-3's partition of a tensor over ranks",
    "vlm.plan.shares.PERSISTENCE_THRESHOLD": "ZeRO-3's default persistence threshold",
    "vlm.plan.states.ALLREDUCE_BUFFER": "the engine's all-reduce buffer size",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_each_use_is_pinned_to_the_deepspeed_it_was_written_for(name):
    assert deepspeed.__version__.startswith(WRITTEN_FOR), (
        f"DeepSpeed {deepspeed.__version__}: {name} {PINNED[name]}, written for "
        f"{WRITTEN_FOR}x; check it against this DeepSpeed, then update the pin"
    )


def test_the_shm_builder_is_what_the_torch_backend_calls():
    import importlib

    from vlm.train.distributed import skip_deepspeed_shm_build

    # (by module path: the attribute deepspeed.comm.torch is the torch package itself)
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    assert callable(getattr(ds_torch, "build_shm_op", None)), "build_shm_op is gone"
    assert "build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__), (
        "TorchBackend no longer builds its shm op through build_shm_op: "
        "skip_deepspeed_shm_build skips nothing"
    )
    real = ds_torch.build_shm_op
    try:
        skip_deepspeed_shm_build()
        assert ds_torch.build_shm_op() is None
    finally:
        ds_torch.build_shm_op = real


def test_the_engine_reads_the_optimizer_report_where_report_step_writes_it():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from vlm.train.engine import SkipNonFiniteAdamW, report_step

    src = inspect.getsource(DeepSpeedEngine._take_model_step)
    for attr in ("self.optimizer.overflow", "self.optimizer._global_grad_norm"):
        assert attr in src, f"DeepSpeedEngine._take_model_step no longer reads {attr}"
    w = torch.nn.Parameter(torch.ones(2))
    opt = SkipNonFiniteAdamW([w], lr=0.1, clip=lambda params: torch.tensor(3.0))
    assert opt.overflow is False
    w.grad = torch.tensor([float("nan"), 1.0])
    opt.step()
    assert opt.overflow is True and not hasattr(opt, "_global_grad_norm")
    w.grad = torch.ones(2)
    opt.step()
    assert opt.overflow is False and float(opt._global_grad_norm) == 3.0
    report_step(opt, skipped=True)
    assert opt.overflow is True


def test_the_engine_loads_every_checkpoint_file_through_its_checkpoint_engine():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    from vlm.train.engine import load_checkpoints_safely, safe_load

    src = inspect.getsource(DeepSpeedEngine)
    assert "checkpoint_engine.load(" in src and "torch.load(" not in src.replace(
        "checkpoint_engine.load(", ""
    ), "DeepSpeedEngine reads a checkpoint file other than through checkpoint_engine.load"
    assert list(inspect.signature(TorchCheckpointEngine.load).parameters)[:3] == [
        "self",
        "path",
        "map_location",
    ]
    engine = SimpleNamespace(checkpoint_engine=SimpleNamespace(load=torch.load))
    load_checkpoints_safely(engine)
    assert engine.checkpoint_engine.load is safe_load


def test_safe_load_allows_the_classes_zero_pickles(tmp_path):
    """ZeRO's optimizer files hold a few plain-data classes: safe_load allows them by the module
    paths they have in this DeepSpeed (a moved class would refuse every ZeRO checkpoint)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from vlm.train.engine import safe_load

    path = tmp_path / "optim.pt"
    torch.save({"stage": ZeroStageEnum.weights, "scaler": LossScaler(1.0)}, path)
    got = safe_load(path)
    assert got["stage"] == ZeroStageEnum.weights and isinstance(got["scaler"], LossScaler)


def test_an_expert_parameter_is_marked_as_deepspeed_marks_its_own():
    from deepspeed.moe.utils import (
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    from vlm.train.expert_parallel import is_expert, mark_expert

    dense, expert = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    mark_expert(expert, "ep_size_2")
    assert (is_moe_param(dense), is_moe_param(expert)) == (False, True)
    assert (is_expert(dense), is_expert(expert)) == (False, True)
    # DeepSpeed's own split of optimizer groups finds the expert group by the name marked
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [dense, expert], "name": "g"}]
    )
    assert [g.get("name") for g in groups if g.get("moe")] == ["ep_size_2"]


def _sharded_moe_model():
    from vlm.model.config import MoEConfig
    from vlm.model.expert_parallel import LoopbackExchange
    from vlm.model.moe import MoE
    from vlm.train.expert_parallel import ExpertParallel

    m = torch.nn.Sequential(MoE(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 16))
    exchange = LoopbackExchange(2, 0)
    m[0].shard_experts(exchange)
    return m, ExpertParallel(2, 0, 1, "ep_size_2", exchange, 0, 0)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_deepspeed_finds_the_expert_marker_and_zero3_reads_its_placement(zero_stage):
    """deepspeed_view: DeepSpeed's engine decides a model has expert parameters by finding an
    instance of its MoE class (ZeRO-3: its AutoEP layer class) among the modules; ZeRO-3 partitions
    a parameter over its expert-data-parallel group by the placement attributes set."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from vlm.train.expert_parallel import deepspeed_view

    src = inspect.getsource(DeepSpeedEngine)
    assert "isinstance(module, MoE)" in src and "isinstance(module, _AutoEPMoELayer)" in src
    placement = inspect.getsource(DeepSpeedZeroOptimizer_Stage3._autoep_expert_parallel_group)
    for attr in ('"ds_zero_placement_family"', '"autoep_expert"', '"ds_zero_partition_group_name"'):
        assert attr in placement, f"ZeRO-3 no longer places AutoEP experts by {attr}"
    model, ep = _sharded_moe_model()
    cls = AutoEPMoELayer if zero_stage == 3 else DeepSpeedMoE
    with deepspeed_view(model, ep, zero_stage):
        markers = [m for m in model.modules() if isinstance(m, cls)]
        assert len(markers) == 1 and markers[0].num_experts == 4
        if zero_stage == 3:
            p = model[0].w_gate_EDF
            assert (p.ds_zero_placement_family, p.ds_zero_partition_group_name) == (
                "autoep_expert",
                "ep_size_2",
            )
    assert not any(isinstance(m, cls) for m in model.modules())  # gone once the engine exists


@pytest.mark.parametrize("numel, ranks", [(10, 4), (12, 4), (7, 8), (1, 3), (100_003, 16)])
def test_zero3_partition_is_deepspeeds(numel, ranks):
    """vlm.model.shares.zero3_partition (what a rank builds and loads of a ZeRO-3 parameter) is
    ZeRO-3's own: the tensor padded to a multiple of the ranks, an equal part each."""
    from deepspeed.runtime.zero.partition_parameters import Init

    from vlm.model.shares import zero3_partition

    init = SimpleNamespace(_partition_world_size=lambda p: ranks)
    init._padding_size = lambda p: Init._padding_size(init, p)
    size = Init._aligned_size(init, SimpleNamespace(ds_numel=numel)) // ranks
    for rank in range(ranks):
        start, stop, got = zero3_partition(numel, ranks, rank)
        assert got == size and start == min(rank * size, numel) and stop == min(start + size, numel)


def test_the_plan_mirrors_deepspeeds_defaults():
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from vlm.plan.shares import PERSISTENCE_THRESHOLD
    from vlm.plan.states import ALLREDUCE_BUFFER

    assert ALLREDUCE_BUFFER == MEMORY_OPT_ALLREDUCE_SIZE
    assert PERSISTENCE_THRESHOLD == DeepSpeedZeroConfig().param_persistence_threshold
