"""Sequence parallelism's refusals (vlm.train.sequence_shard): each layout the split cannot compute
exactly is one line naming the setting, before any collective."""

from __future__ import annotations

import pytest

from configs.config import ConfigError
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig
from vlm.train import sequence_shard
from vlm.train.distributed import ProcessGroups
from vlm.train.layout import ParallelLayout


def _model(**kw) -> ConceptMoELM:
    base = dict(vocab_size=32, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4)
    return ConceptMoELM(ModelConfig(**{**base, **kw}))


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"chunk": ChunkConfig(router="topk")}, "chunk.router: topk"),
        ({"chunk": ChunkConfig(grid_aware_boundaries=True)}, "grid_aware_boundaries"),
        ({"attention_window": 8}, "attention_window"),
        ({"num_heads": 2, "num_kv_heads": 1, "head_dim": 8}, "must divide the attention's 2"),
    ],
)
def test_what_the_model_cannot_split_is_one_line(kw, words):
    layout = ParallelLayout(world=4, rank=1, sequence=4)
    with pytest.raises(ConfigError) as e:
        sequence_shard.set_up(_model(**kw), layout, ProcessGroups())
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_model_it_can_split_gets_its_shard():
    model = _model()
    shard = sequence_shard.set_up(
        model, ParallelLayout(world=4, rank=3, sequence=2), ProcessGroups()
    )
    assert model.sequence_shard is shard and (shard.rank, shard.size) == (1, 2)
    assert shard.span(2048) == (1024, 2048)
    assert sequence_shard.set_up(_model(), ParallelLayout(world=2, rank=0), ProcessGroups()) is None


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["data.row_tokens=1001"], "does not divide data.row_tokens=1001"),
        (["deepspeed.zero_stage=3"], "zero_stage=3"),
        (["train.global_parser=false"], "global_parser"),
    ],
)
def test_what_the_trainer_cannot_split_is_one_line(overrides, words):
    from vlm.train.config import load_train_config

    cfg = load_train_config(None, ["parallel.sequence=2", *overrides])
    with pytest.raises(ConfigError) as e:
        sequence_shard.check(cfg, ParallelLayout(world=2, rank=0, sequence=2))
    assert words in str(e.value) and "\n" not in str(e.value)
