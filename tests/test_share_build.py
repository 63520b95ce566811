"""Each rank builds and loads only its share of the model (issue 48 item 2), with the weights a whole
build makes for the same seed: the whole build sliced (an expert shard's rows, a ZeRO-3 partition's
flat range) or cast (bf16), tensor by tensor, bit-equal; the generator left where the whole build
leaves it, so that everything drawn after (the vision tower, dropout, the data order) is the same.
Loading reads only the rows a rank keeps."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from rank_processes import join_world

from vlm.model import share_init
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.share_init import draw_normal_into
from vlm.model.shares import Sharding, share_of
from vlm.train import build_share
from vlm.train.build_share import build_vlm, consume_build

# every kind of tensor the LLM has: routed, shared and Grove experts, a linear dechunk residual
# (identity-initialised), joint decoding, sizes that 16 does not divide
MC = ModelConfig(
    vocab_size=263,
    hidden_size=36,
    num_heads=4,
    num_kv_heads=2,
    head_dim=10,
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=20,
        num_shared_experts=1,
        shared_hidden=12,
        grove_groups=2,
        grove_lambda=0.25,
    ),
    chunk=ChunkConfig(residual="linear"),
    init_std=0.2,
)


def _vision():
    from vision.config import VisionConfig
    from vision.image_processor import ImageProcessorConfig
    from vision.navit import NaViTConfig

    return VisionConfig(
        processor=ImageProcessorConfig(patch_size=4, min_patches=4, max_patches=16, merge=2),
        encoder=NaViTConfig(hidden_size=16, num_layers=1, num_heads=2, max_grid=16),
    )


@pytest.fixture
def small_chunks(monkeypatch):
    """Draws cut into chunks of 48 elements, so that the tiny model's tensors take the chunked path."""
    monkeypatch.setattr(share_init, "CHUNK", 48)
    monkeypatch.setattr(build_share, "CHUNK", 48)


def _whole(seed: int = 0):
    torch.manual_seed(seed)
    model = ConceptMoEVLM(MC, _vision())
    return {n: p.detach() for n, p in model.named_parameters()}, torch.rand(4)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 47, 48, 49, 63, 96, 97, 100, 1000, 1001])
def test_chunked_normal_draws_are_the_whole_tensors_draws(n):
    for start, stop in [(0, n), (0, n // 2), (n // 3, n), (n // 4, 3 * n // 4)]:
        torch.manual_seed(n)
        whole = torch.empty(n).normal_(0.5, 0.02)
        after = torch.rand(3)
        torch.manual_seed(n)
        got = torch.empty(stop - start, dtype=torch.float64)
        draw_normal_into(got, n, 0.5, 0.02, start, chunk=16)
        assert torch.equal(got, whole[start:stop].double()), (n, start, stop)
        assert torch.equal(torch.rand(3), after), f"{n} draws advanced the generator differently"


@pytest.mark.parametrize(
    "sharding",
    [
        Sharding(world=2, rank=0, expert=2),
        Sharding(world=2, rank=1, expert=2),
        Sharding(bf16=True),
        Sharding(world=4, rank=3, expert=4, bf16=True),
    ],
    ids=["expert-rank-0", "expert-rank-1", "bf16", "expert-rank-3-of-4-bf16"],
)
def test_a_shard_build_is_the_whole_build_sliced(sharding, small_chunks):
    whole, after = _whole()
    torch.manual_seed(0)
    model = build_vlm(MC, _vision(), sharding)
    assert torch.equal(torch.rand(4), after), "the generator is not where a whole build leaves it"
    for name, p in model.named_parameters():
        s = share_of(sharding, name, whole[name].shape)
        want = whole[name][s.rows[0] : s.rows[1]]
        # the LLM in the training dtype; the vision tower whole in fp32 (its warm-up trains it so)
        want = want.to(sharding.dtype) if name.startswith("lm.") else want
        assert p.dtype == want.dtype and p.shape == want.shape, name
        assert torch.equal(p.detach(), want), f"{name} differs from the whole build's"
    for m in (m for m in model.modules() if hasattr(m, "w_gate_EDF")):  # held from construction on
        E = m.num_experts // sharding.expert
        for w in m.routed_expert_weights():
            assert w.shape[0] == E and w.untyped_storage().nbytes() == w.numel() * w.element_size()
    # what the size check and `vlm plan` count is what was built
    held = sum(p.numel() * p.element_size() for p in model.lm.parameters())
    assert build_share.build_bytes(MC, sharding)[0] == held


def test_a_consume_build_advances_the_generator_as_a_whole_build():
    _, after = _whole(seed=3)
    torch.manual_seed(3)
    consume_build(MC, _vision())
    assert torch.equal(torch.rand(4), after)


def test_init_from_reads_only_the_rows_a_rank_keeps(tmp_path, monkeypatch, small_chunks):
    from vlm.model import share_load
    from vlm.model.hf import save_pretrained
    from vlm.train.stages import load_pretrained_weights

    torch.manual_seed(5)
    src = ConceptMoEVLM(MC)
    save_pretrained(src, tmp_path / "src")
    stored = dict(src.state_dict())
    reads: list[tuple[str, int, int]] = []
    rows = share_load.Safetensors.rows

    def recorded(self, name, a, b):
        reads.append((name, a, b))
        return rows(self, name, a, b)

    monkeypatch.setattr(share_load.Safetensors, "rows", recorded)
    sharding = Sharding(world=2, rank=1, expert=2, bf16=True)
    model = build_vlm(MC, None, sharding)
    load_pretrained_weights(model, tmp_path / "src", [300], sharding)
    for name, p in model.named_parameters():
        w = stored[name]
        if name in ("lm.embed.weight", "lm.lm_head.weight"):  # grown to 300 rows by their mean
            w = torch.cat([w, w.mean(0, keepdim=True).expand(300 - w.shape[0], -1)])
        s = share_of(sharding, name, w.shape)
        assert torch.equal(p.detach(), w[s.rows[0] : s.rows[1]].to(torch.bfloat16)), name
    expert_reads = [(a, b) for n, a, b in reads if n.endswith("_EDF") or n.endswith("_EFD")]
    assert expert_reads and set(expert_reads) == {(2, 4)}, "a rank read experts it does not keep"


def test_the_size_check_counts_this_ranks_share(tiny_data, tiny_config, load_tiny):
    """Eight ranks on a node that cannot hold eight whole fp32 models: ZeRO-3's shares are built,
    ZeRO 0's whole models are refused in one line."""
    from configs.config import ConfigError
    from vlm.train.sizes import check_buildable, rank_share_bytes

    zero0 = load_tiny(tiny_config(tiny_data))
    zero3 = load_tiny(tiny_config(tiny_data, deepspeed={"zero_stage": 3}))
    share0, share3 = rank_share_bytes(zero0, 8, 5)[0], rank_share_bytes(zero3, 8, 5)[0]
    assert share3 < share0 / 2
    check_buildable(zero3, limit=8 * share3, env=(8, 5, 8))
    with pytest.raises(
        ConfigError, match=r"to build in float32, more than .* x 8 ranks on this node;"
    ) as err:
        check_buildable(zero0, limit=8 * share3, env=(8, 5, 8))
    assert "\n" not in str(err.value)


def test_transformers_moe_rows_are_the_converted_tensors(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from vlm.model.config import ConvertConfig
    from vlm.model.convert import hf_model_config, hf_state_dict_to_ours
    from vlm.model.share_load import TransformersMoE

    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=4)
    hf = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            moe_intermediate_size=8,
            num_experts=4,
            head_dim=4,
            num_key_value_heads=2,
            num_experts_per_tok=2,
            **common,
        )
    )
    hf.save_pretrained(tmp_path)
    base = hf_model_config(hf.config, ConvertConfig(encoder_layers=1, decoder_layers=1))
    want = hf_state_dict_to_ours(hf.state_dict(), base)
    stored = TransformersMoE(tmp_path, base)
    assert set(stored.shapes()) == set(want)
    for name, w in want.items():
        assert stored.shapes()[name] == tuple(w.shape), name
        assert torch.equal(stored.rows(name, 1, 3), w[1:3]), name


# ---------------------------------------------------------------- ZeRO-3, two processes
def _zero3_worker(rank: int, world: int, port: int, src: str) -> None:
    join_world(rank, world, port)
    torch.set_num_threads(1)
    from vlm.train.distributed import init_distributed

    init_distributed()
    for bf16 in (False, True):
        _zero3_build_and_load(rank, world, src, bf16)


def _zero3_build_and_load(rank: int, world: int, src: str, bf16: bool) -> None:
    import deepspeed

    from vlm.train.stages import load_pretrained_weights

    whole, after = _whole()
    sharding = Sharding(world=world, rank=rank, zero_stage=3, bf16=bf16)
    torch.manual_seed(0)
    model = build_vlm(MC, _vision(), sharding)
    assert torch.equal(torch.rand(4), after)
    lm = [(n, p) for n, p in model.named_parameters() if n.startswith("lm.")]
    assert lm and all(hasattr(p, "ds_tensor") and p.numel() == 0 for _, p in lm)
    for name, p in lm:  # this rank's partition, as vlm.model.shares says
        s = share_of(sharding, name, whole[name].shape)
        got = p.ds_tensor.view(-1)[: s.numel]
        want = whole[name].reshape(-1)[s.flat[0] : s.flat[1]].to(sharding.dtype)
        assert torch.equal(got, want), f"rank {rank}: {name}'s partition"
    kept = sum(share_of(sharding, n, whole[n].shape).numel for n, _ in lm)
    assert build_share.build_bytes(MC, sharding)[0] == kept * (2 if bf16 else 4)
    with deepspeed.zero.GatheredParameters([p for _, p in lm]):  # and as DeepSpeed gathers it
        for name, p in lm:
            assert torch.equal(p.data, whole[name].to(sharding.dtype)), f"{name} gathered"
    # init_from into the partitions, the vocabulary grown to 300 rows
    stored = dict(torch.load(f"{src}/state.pt"))
    load_pretrained_weights(model, f"{src}/export", [300], sharding)
    lm = [(n, p) for n, p in model.named_parameters() if n.startswith("lm.")]
    with deepspeed.zero.GatheredParameters([p for _, p in lm]):
        for name, p in lm:
            w = stored[name]
            if name in ("lm.embed.weight", "lm.lm_head.weight"):
                w = torch.cat([w, w.mean(0, keepdim=True).expand(300 - w.shape[0], -1)])
            assert torch.equal(p.data, w.to(sharding.dtype)), f"{name} loaded"
    # muP's init scale after the build writes the partitions too
    from vlm.train.param_groups import apply_mup_init

    apply_mup_init(model, 4.0, 4.0)  # hidden matrices x 1/2
    q = dict(lm)["lm.encoder.0.attn.q_proj.weight"]
    with deepspeed.zero.GatheredParameters([q]):
        want = stored["lm.encoder.0.attn.q_proj.weight"].to(sharding.dtype).mul_(0.5)
        assert torch.equal(q.data, want), "muP's scale missed a partition"


@pytest.mark.slow
def test_zero3_ranks_build_and_load_their_partitions(tmp_path):
    """Two gloo ranks, fp32 then bf16: each holds its partition of every LLM tensor from
    construction on, the whole build's values (as vlm.model.shares says and as DeepSpeed gathers
    them), and `train.init_from` (its vocabulary grown) fills the partitions."""
    from vlm.model.hf import save_pretrained

    torch.manual_seed(5)
    src = ConceptMoEVLM(replace(MC))
    save_pretrained(src, tmp_path / "export")
    torch.save(src.state_dict(), tmp_path / "state.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_zero3_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)


def _train_worker(rank: int, world: int, port: int, cfg: dict, run_dir: str) -> None:
    join_world(rank, world, port)
    torch.set_num_threads(1)
    from configs.config import from_dict
    from vlm.train.config import TrainConfig
    from vlm.train.trainer import Trainer

    assert Trainer(from_dict(TrainConfig, cfg), run_dir, log=lambda *_: None).train() == 0


@pytest.mark.slow
def test_a_zero3_checkpoint_is_read_by_rows_from_its_writers_partitions(
    tiny_data, tiny_config, tmp_path
):
    """A ZeRO-3 checkpoint of 2 ranks (the vision encoder frozen: DeepSpeed stores frozen tensors
    apart) read by rows without DeepSpeed's whole reconstruction: the same tensors."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from vlm.train.checkpoint import latest_checkpoint
    from vlm.train.checkpoint_tensors import checkpoint_tensors

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 1},
        params={"freeze": ["vision.encoder"]},
        deepspeed={"zero_stage": 3},
        logging={"eval_every": 0, "histogram_every": 0},
        checkpoint={"save_every": 1},
        vision_warmup={"steps": 0},
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_train_worker, args=(2, port, cfg, str(tmp_path / "run")), nprocs=2, join=True)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    whole = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="ds")
    stored = checkpoint_tensors(ckpt)
    assert stored.shapes() == {k: tuple(v.shape) for k, v in whole.items()}
    for name, w in whole.items():
        n = w.shape[0] if w.dim() else 1
        for a, b in [(0, n), (n // 3, max(n // 3 + 1, n - n // 4)), (n - 1, n)]:
            want = w[a:b] if w.dim() else w
            assert torch.equal(stored.rows(name, a, b), want), (name, a, b)
