"""MoE -> ConceptMoE conversion: with all boundaries forced on, the converted model reproduces the source."""

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from configs.batch import PackedBatch
from configs.config import ConfigError
from vlm.cli import main
from vlm.model.config import ConvertConfig, ModelConfig, MoEConfig
from vlm.model.convert import convert
from vlm.model.hf import load_vlm, save_pretrained
from vlm.model.multimodal import ConceptMoEVLM

COMMON = dict(
    vocab_size=113,
    hidden_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)


def qwen3(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        **COMMON,
    )
    m = Qwen3MoeForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path)
    return m


def mixtral(tmp_path):
    torch.manual_seed(1)
    m = MixtralForCausalLM(
        MixtralConfig(intermediate_size=16, num_local_experts=4, **COMMON)
    ).eval()
    m.save_pretrained(tmp_path)
    return m


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 113, (2, 24), generator=g)
    T = ids.shape[1]
    return PackedBatch(
        ids,
        torch.full_like(ids, -100),
        torch.zeros_like(ids),
        torch.arange(T).expand(2, T),
        torch.zeros_like(ids),
    ), ids


@pytest.mark.parametrize("make", [qwen3, mixtral])
def test_transformers_moe_conversion_is_lossless(tmp_path, make):
    src = make(tmp_path)
    model, base = convert(tmp_path, ConvertConfig(encoder_layers=1, decoder_layers=2))
    model.eval()
    assert model.model_cfg.chunk.enabled and model.model_cfg.concept_layers == 2
    b, ids = batch()
    with torch.no_grad():
        ref = src(input_ids=ids).logits
        got = model(b, force="all").logits
        free = model(b).logits  # the chunker left to itself merges tokens: not the source network
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(free, ref, atol=1e-3)


def test_own_baseline_conversion_is_lossless_and_reallocates(tmp_path):
    torch.manual_seed(2)
    cfg = ModelConfig(
        vocab_size=113,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=3,
        decoder_layers=1,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=16),
    )
    src = ConceptMoEVLM(cfg.baseline()).eval()
    save_pretrained(src, tmp_path / "base")
    model, _ = convert(tmp_path / "base", ConvertConfig(encoder_layers=1, decoder_layers=1))
    b, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(b, force="all").logits, src(b).logits, rtol=1e-5, atol=1e-5
        )
    # Reallocation through the CLI: more active experts in the concept model, written in
    # transformers format.
    rc = main(
        [
            "convert",
            str(tmp_path / "base"),
            "--out",
            str(tmp_path / "ct"),
            "--encoder-layers",
            "1",
            "--decoder-layers",
            "1",
            "--concept-top-k",
            "4",
            "--ratio",
            "2",
        ]
    )
    assert rc == 0
    ct = load_vlm(tmp_path / "ct")
    assert ct.model_cfg.c_moe.top_k == 4 and ct.model_cfg.moe.top_k == 2
    # chunk + joint only
    assert sum(p.numel() for p in ct.parameters()) > sum(p.numel() for p in src.parameters())


def test_conversion_rejects_bad_inputs(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        convert(tmp_path, ConvertConfig())
    qwen3(tmp_path)
    with pytest.raises(ConfigError, match="concept layer"):
        convert(tmp_path, ConvertConfig(encoder_layers=3, decoder_layers=2))
    # checked when made, as `vlm convert` makes it
    with pytest.raises(ConfigError, match="target_ratio must be > 1"):
        ConvertConfig(target_ratio=1.0)
    assert main(["convert", str(tmp_path), "--out", str(tmp_path / "out"), "--ratio", "1"]) == 2
    assert not (tmp_path / "out").exists()


def test_converted_tokens_keep_their_own_state_with_real_boundaries(
    tmp_path, tiny_vlm, tiny_default
):
    """The "delta" residual: with all boundaries on the conversion is the source; with real ones a
    chunk's tokens get different decoder inputs (their own state plus the concept model's update),
    and the start-of-CT loss measured by `vlm eval ct-start` reports both next to the source's."""
    import dataclasses

    from eval.ct_start import random_boundaries, start_losses

    vlm_model, tok = tiny_vlm()
    src = type(vlm_model)(vlm_model.model_cfg.baseline(), vlm_model.vision_cfg).eval()
    save_pretrained(src, tmp_path / "base", tok)
    model, _ = convert(
        tmp_path / "base", ConvertConfig(encoder_layers=1, decoder_layers=1, target_ratio=1.5)
    )
    b, _ = batch()
    force = random_boundaries(b.doc_ids, 3.0, seed=0)
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("z", args[0])

    model.lm.decoder[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model.eval()(b, force=force)
    z, row = seen["z"][0], force[0]
    inside = [
        t for t in range(1, z.shape[0]) if not row[t] and not row[t - 1] and b.doc_ids[0, t] >= 0
    ]
    # not one input per chunk
    assert inside and all(not torch.allclose(z[t], z[t - 1]) for t in inside)
    losses = start_losses(str(tmp_path / "base"), 1.5, 1, str(tiny_default))
    assert losses["converted, all boundaries"] == pytest.approx(losses["source MoE"], rel=1e-4)
    assert all(v > 0 for v in losses.values())
    assert dataclasses.asdict(model.model_cfg.chunk)["residual"] == "delta"


def test_grove_upcycling_keeps_the_source_and_bounds_lambda(tmp_path):
    """Grove 3.4: `vlm convert --grove-groups G` adds adjugate experts whose down-projections start
    at zero, so the converted model (all boundaries on) still computes the source; lambda above g/n
    is refused."""
    torch.manual_seed(3)
    cfg = ModelConfig(
        vocab_size=113,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=1,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=16),
    )
    src = ConceptMoEVLM(cfg.baseline()).eval()
    save_pretrained(src, tmp_path / "base")
    model, _ = convert(
        tmp_path / "base",
        ConvertConfig(
            encoder_layers=1, decoder_layers=1, grove_groups=4, grove_hidden=8, grove_lambda=0.25
        ),
    )
    adj = {n: p for n, p in model.named_parameters() if ".moe.adj_" in n}
    # gate, up, down in each of the 4 MoE layers
    assert len(adj) == 3 * 4
    assert all(not p.any() for n, p in adj.items() if "adj_down" in n)
    assert all(0.003 < p.std() < 0.012 for n, p in adj.items() if "adj_down" not in n)
    b, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(b, force="all").logits, src(b).logits, rtol=1e-5, atol=1e-5
        )
    with pytest.raises(ConfigError, match="grove_lambda=0.6 must be in"):
        convert(
            tmp_path / "base",
            ConvertConfig(encoder_layers=1, decoder_layers=1, grove_groups=4, grove_lambda=0.6),
        )


@pytest.mark.parametrize("make", [qwen3, mixtral])
def test_convert_check_prints_the_largest_logit_difference(tmp_path, make, capsys):
    make(tmp_path / "src")
    rc = main(
        [
            "convert",
            str(tmp_path / "src"),
            "--out",
            str(tmp_path / "ct"),
            "--encoder-layers",
            "1",
            "--decoder-layers",
            "2",
            "--check",
        ]
    )
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("check:")][0]
    assert rc == 0 and "ok" in line
    assert float(line.split("every boundary on: ")[1].split()[0]) < 1e-4
