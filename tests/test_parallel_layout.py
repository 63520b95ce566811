"""The parallel layout (vlm.train.layout): one object says how the ranks share the work, and every
component reads its group, rank and size from it."""

from __future__ import annotations

import pytest

from configs.config import ConfigError
from vlm.train.config import ParallelConfig
from vlm.train.layout import ParallelLayout


def layouts(world: int, **parallel) -> list[ParallelLayout]:
    return [ParallelLayout.of(ParallelConfig(**parallel), world, r) for r in range(world)]


def test_the_world_is_data_times_sequence():
    for lay in layouts(8, sequence=2):
        assert lay.data * lay.sequence == lay.world == 8
        assert (lay.data_rank, lay.sequence_rank) == divmod(lay.rank, 2)
    # the ranks of a row are consecutive; every rank is in exactly one group of each kind
    lay = layouts(8, sequence=2, expert=4)[0]
    assert lay.sequence_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.data_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.expert_data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for groups in (lay.sequence_groups(), lay.data_groups(), lay.expert_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_without_sequence_parallelism_data_parallel_is_the_world():
    """Every layout that existed before the layout object reads as it did: the loader's rank and
    size, the global batch and the boundary noise's micro-batch index (k * ranks + rank)."""
    for world in (1, 2, 4):
        for lay in layouts(world, expert=world):
            assert (lay.data_rank, lay.data) == (lay.rank, world)
            assert [lay.global_micro_batch(k) for k in range(3)] == [
                k * world + lay.rank for k in range(3)
            ]
            assert lay.counts_data


def test_the_ranks_of_a_row_share_its_micro_batches():
    """The sequence ranks of a row read the same micro-batches: the same data rank, the same
    boundary-noise index, and only one of them counts the loader's samples."""
    lays = layouts(4, sequence=2)
    assert [lay.data_rank for lay in lays] == [0, 0, 1, 1]
    assert [lay.global_micro_batch(1) for lay in lays] == [2, 2, 3, 3]
    assert [lay.counts_data for lay in lays] == [True, False, True, False]


def test_expert_groups_are_consecutive_ranks():
    lays = layouts(4, expert=2)
    assert [lay.expert_rank for lay in lays] == [0, 1, 0, 1]
    assert {lay.expert_replicas for lay in lays} == {2}


@pytest.mark.parametrize(
    "world, parallel, says",
    [
        (3, {"expert": 2}, r"parallel.expert=2 does not divide the 3 rank\(s\)"),
        (6, {"sequence": 4}, r"parallel.sequence=4 does not divide the 6 rank\(s\)"),
    ],
)
def test_a_layout_the_ranks_cannot_form_is_one_line(world, parallel, says):
    with pytest.raises(ConfigError, match=says) as e:
        ParallelLayout.of(ParallelConfig(**parallel), world)
    assert "\n" not in str(e.value)


def test_a_degree_below_one_is_refused():
    with pytest.raises(ConfigError, match="parallel.sequence must be >= 1"):
        ParallelConfig(sequence=0)


def test_the_layout_is_recorded_in_checkpoints():
    assert layouts(4, sequence=2, expert=4)[3].as_dict() == {
        "world": 4,
        "data": 2,
        "sequence": 2,
        "expert": 4,
    }


def test_deepspeed_expert_groups_are_made_by_the_version_they_were_written_for():
    """distributed.deepspeed_expert_groups reaches into DeepSpeed's private group API (it has no
    public one outside its own MoE layer): written for 0.19; a new DeepSpeed must be checked
    against it (the function also checks at run time that DeepSpeed put each rank where the layout
    does)."""
    import deepspeed
    from deepspeed.utils import groups

    assert deepspeed.__version__.startswith("0.19."), (
        f"DeepSpeed {deepspeed.__version__}: check vlm.train.distributed.deepspeed_expert_groups "
        "against its group API, then update this pin"
    )
    for name in (
        "_create_expert_and_data_parallel",
        "_get_expert_parallel_group",
        "_get_expert_parallel_group_ranks",
        "_get_expert_parallel_group_dict",
        "_get_expert_data_parallel_group",
    ):
        assert callable(getattr(groups, name, None)), f"deepspeed.utils.groups.{name} is gone"


def test_the_banner_says_how_the_ranks_share_the_work():
    assert layouts(2)[0].describe() == "2 rank(s)"
    assert layouts(8, sequence=2, expert=4)[0].describe() == (
        "8 rank(s) (4 data-parallel x 2 sequence-parallel; experts split over 4)"
    )
