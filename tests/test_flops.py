"""`vlm flops`: hand-computed counts, the three reallocation strategies, Table 1, the paper configs, the CLI."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from configs.config import ConfigError, from_dict
from vlm.flops_cli import load_model_config, main
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.flops import (
    attention_map_flops,
    count_params,
    expected_groups_hit,
    flops_per_token,
    kv_cache_bytes,
)
from vlm.model.reallocate import comparison_table, reallocate, search_reallocations

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny() -> ModelConfig:
    """Every counted feature on: GQA + qk-norm, shared + Grove experts, wider concept model with its
    own MoE, loops, linear residual, one joint-decoding layer."""
    return ModelConfig(
        vocab_size=10,
        hidden_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        qk_norm=True,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=1,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=6,
            num_shared_experts=1,
            shared_hidden=5,
            grove_groups=2,
            grove_hidden=3,
        ),
        chunk=ChunkConfig(
            enabled=True,
            router="cosine",
            target_ratio=2.0,
            residual="linear",
            joint_decoding_layers=1,
        ),
        concept_hidden_size=12,
        concept_num_heads=3,
        concept_num_kv_heads=1,
        concept_moe=MoEConfig(num_experts=2, top_k=1, expert_hidden=4),
        loop_start=0,
        loop_end=1,
        loop_times=2,  # schedule [0, 0, 0, 1]: 4 passes
    )


def test_params_by_hand():
    p = count_params(tiny())
    # token layer, D=8: attn norm 8 | q 8*2*4=64, k 8*1*4=32, v 32, o 64, q/k norms 4+4 -> 200
    #                   ffn norm 8 | router 8*4=32, experts 4*3*8*6=576, shared 3*8*5=120, grove 2*3*8*3=144 -> 872
    token_layer = 8 + 200 + 8 + 872
    assert token_layer == 1088
    # concept layer, Dc=12, 3/1 heads of 4: norm 12 | q 144, k 48, v 48, o 144, norms 8 -> 392
    #                                      norm 12 | router 12*2=24, experts 2*3*12*4=288 -> 312
    concept_layer = 12 + 392 + 12 + 312
    assert p["embedding"] == 10 * 8
    assert p["encoder"] == token_layer and p["decoder"] == token_layer
    assert p["concept"] == 2 * concept_layer  # loops add no parameters
    assert p["joint_decoding"] == 64 + 32 + 32 + 8  # cq, ck, cv + concept-input RMSNorm
    assert p["concept_proj"] == 2 * 8 * 12  # up and down
    assert p["chunk"] == 2 * 8 * 8 and p["residual"] == 8 * 8
    assert p["final_norm"] == 8 and p["lm_head"] == 80
    assert p["total"] == 80 + 1088 + 128 + 64 + 192 + 1456 + 1088 + 136 + 8 + 80 == 4320
    # inactive: token layers (4-2)*144 experts + (2 - 5/3)*72 adjugates = 312 each; concept
    # (2-1)*144 each
    assert p["activated"] == pytest.approx(4320 - 2 * 312 - 2 * 144)
    assert p["activated_non_embedding"] == pytest.approx(3408 - 80 - 80)
    assert count_params(replace(tiny(), tie_embeddings=True))["total"] == 4320 - 80
    lin = replace(tiny(), chunk=replace(tiny().chunk, router="linear"))
    assert count_params(lin)["chunk"] == 2 * 8 + 1


def test_flops_by_hand():
    f = flops_per_token(tiny())  # R = 2 from the config
    # token layer MACs: attn 64+32+32+64=192; router 32 + 2 experts 2*144 + shared 120 + grove
    # 5/3*72=120 -> 752 concept layer MACs: attn 144+48+48+144=384; router 24 + 1 expert 144 -> 552;
    # 4 passes / R=2
    assert f["encoder"] == 2 * 752
    assert f["decoder"] == 2 * 752 and f["joint_decoding"] == 2 * 128
    assert f["concept"] == pytest.approx(2 * 4 * 552 / 2)
    assert f["concept_proj"] == pytest.approx(2 * 192 / 2)
    assert f["chunk"] == 2 * 128 and f["residual"] == 2 * 64 and f["lm_head"] == 2 * 80
    assert f["total"] == pytest.approx(2 * 3104)
    assert flops_per_token(tiny(), ratio=4.0)["concept"] == pytest.approx(2 * 4 * 552 / 4)
    with pytest.raises(ValueError, match="R must be >= 1"):
        flops_per_token(tiny(), ratio=0.5)
    # the baseline twin: R = 1 whatever is asked, no chunk, residual or joint projections
    b = tiny().baseline()
    assert flops_per_token(b, ratio=3.0)["total"] == pytest.approx(
        2 * (752 + 192 + 4 * 552 + 752 + 80)
    )
    assert count_params(b)["total"] == 4320 - 128 - 64 - 136


def test_attention_map_and_kv_by_hand():
    cfg = tiny()
    a = attention_map_flops(cfg, seq_len=8)
    # 4 * Hq * hd FLOPs per (query, key) pair; causal 8*9/2 = 36 pairs; concept: 4 passes, 3 heads,
    # M = 4 -> 10
    assert a["encoder"] == a["decoder"] == 4 * 2 * 4 * 36
    assert a["concept"] == 4 * (4 * 3 * 4) * 10
    full = attention_map_flops(cfg, seq_len=8, causal=False)
    assert full["encoder"] == 32 * 64 and full["concept"] == 4 * 48 * 16
    kv = kv_cache_bytes(cfg, seq_len=8, bytes_per_el=2)
    # 2 (K,V) * Hkv * hd * bytes per position; concept: 4 passes over 4 positions
    assert kv["encoder"] == kv["decoder"] == 2 * 1 * 4 * 2 * 8
    assert kv["concept"] == 4 * 2 * 1 * 4 * 2 * 4
    assert kv["total"] == 512
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(cfg, seq_len=0)


def test_expected_groups_hit_matches_enumeration():
    for e, g, k in [(4, 2, 2), (6, 3, 2), (8, 4, 3), (12, 3, 5)]:
        s = e // g
        hits = [len({i // s for i in pick}) for pick in itertools.combinations(range(e), k)]
        assert expected_groups_hit(
            MoEConfig(num_experts=e, top_k=k, grove_groups=g)
        ) == pytest.approx(sum(hits) / len(hits))
    assert expected_groups_hit(MoEConfig(num_experts=8, top_k=2)) == 0.0


def small_baseline(**moe) -> ModelConfig:
    """A small but sensible fine-grained MoE: 64 experts, top-4, 6 concept layers."""
    return ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        encoder_layers=1,
        concept_layers=6,
        decoder_layers=1,
        moe=MoEConfig(**{"num_experts": 64, "top_k": 4, "expert_hidden": 32, **moe}),
        chunk=ChunkConfig(enabled=False),
    )


def _check_matched(base: ModelConfig, found: dict, tol=0.02):
    f0, p0 = flops_per_token(base)["total"], count_params(base)["total"]
    assert set(found) == {"more_experts", "loop_more_experts", "wider_concept"}
    for name, r in found.items():
        cfg = r.config
        assert cfg.chunk.enabled
        cfg.validate()
        assert abs(flops_per_token(cfg)["total"] / f0 - 1) <= tol, name
        assert abs(count_params(cfg)["total"] / p0 - 1) <= tol, name
        assert r.within_tol
    s1, s2, s3 = (found[k].config for k in ("more_experts", "loop_more_experts", "wider_concept"))
    assert s1.c_moe.top_k > base.c_moe.top_k and s1.concept_schedule == base.concept_schedule
    assert len(s2.concept_schedule) > base.concept_layers and s2.c_moe.top_k > base.c_moe.top_k
    assert s3.c_hidden > base.c_hidden and s3.c_heads > base.c_heads


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
@pytest.mark.parametrize(
    "moe", [{}, {"grove_groups": 4, "grove_hidden": 8}, {"num_shared_experts": 1}]
)
def test_three_strategies_match_small_baseline(ratio, moe):
    base = small_baseline(**moe)
    found = search_reallocations(base, ratio)
    _check_matched(base, found)
    # width ~ sqrt(R) reachable (6 heads for 4): the concept model trades experts for width
    if ratio >= 2:
        assert found["wider_concept"].config.c_moe.num_experts < base.c_moe.num_experts


def test_coarse_granularity_is_flagged():
    # 2 experts, 1 concept layer: no integer choice can spend the freed FLOPs within 2 %
    base = replace(
        small_baseline(num_experts=2, top_k=1), encoder_layers=0, decoder_layers=0, concept_layers=1
    )
    r = search_reallocations(base, 4.0)["more_experts"]
    assert not r.within_tol and "exceeds 2%" in r.note and r.mismatch > 0.02
    with pytest.raises(ValueError, match="chunk.enabled"):
        reallocate(tiny(), 2.0)


def test_table1_reductions():
    base = replace(small_baseline(), concept_layers=8)
    r, n = 4.0, 4096
    rows = {row["name"]: row for row in comparison_table(base, r, seq_len=n, causal=False)}
    s1, s2, s3 = rows["more_experts"], rows["loop_more_experts"], rows["wider_concept"]
    # strategy 1: attention map R^2, KV cache R (full attention counts are exact)
    assert s1["attn_reduction_concept"] == pytest.approx(r**2)
    assert s1["kv_reduction_concept"] == pytest.approx(r)
    # strategy 2: R^2 L_C / (L_C + L_loop), R L_C / (L_C + L_loop)
    cfg2 = reallocate(base, r)["loop_more_experts"]
    lc, loop = base.concept_layers, len(cfg2.concept_schedule) - base.concept_layers
    assert loop >= 1
    assert s2["attn_reduction_concept"] == pytest.approx(r**2 * lc / (lc + loop))
    assert s2["kv_reduction_concept"] == pytest.approx(r * lc / (lc + loop))
    # strategy 3: width x sqrt(R) (4 -> 8 heads here) gives R^1.5 and sqrt(R)
    cfg3 = reallocate(base, r)["wider_concept"]
    assert cfg3.c_heads == 8 and cfg3.c_kv_heads == 4
    assert s3["attn_reduction_concept"] == pytest.approx(r**1.5)
    assert s3["kv_reduction_concept"] == pytest.approx(math.sqrt(r))
    # causal counting: R^2 up to the diagonal's O(1/N) share
    causal = comparison_table(base, r, seq_len=32768)[1]
    assert causal["attn_reduction_concept"] == pytest.approx(r**2, rel=1e-3)


def _model_section(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())["model"]


PAPER = {  # file: (paper total params, paper activated params)
    "paper_moe_90b.yaml": (90e9, 2.5e9),
    "paper_ct_90b_top15.yaml": (90e9, None),
    "paper_ct_90b_top11_loop8.yaml": (90e9, None),
    "paper_moe_60b.yaml": (60e9, 2.5e9),
    "paper_vlm_60b.yaml": (60e9, None),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_configs_parse_and_sizes(name):
    cfg = from_dict(ModelConfig, _model_section(name))
    p = count_params(cfg)
    total, active = PAPER[name]
    assert abs(p["total"] / total - 1) < 0.02, p["total"]
    if active:  # "A2.5B": we read it as activated parameters without the embedding tables
        assert abs(p["activated_non_embedding"] / active - 1) < 0.05, p["activated_non_embedding"]
    # one balancing method, as the configs' comments say: loss-free alone (the paper does not state
    # its own)
    for moe in (cfg.moe, cfg.concept_moe or cfg.moe):
        assert moe.loss_free_balancing
    assert yaml.safe_load((CONFIGS / name).read_text())["loss"] == {"balance": 0.0}


@pytest.mark.parametrize(
    "name,baseline",
    [
        ("paper_ct_90b_top15.yaml", "paper_moe_90b.yaml"),
        ("paper_ct_90b_top11_loop8.yaml", "paper_moe_90b.yaml"),
        ("paper_vlm_60b.yaml", "paper_moe_60b.yaml"),
    ],
)
def test_paper_configs_match_their_baselines(name, baseline):
    cfg = load_model_config(CONFIGS / name)
    base = load_model_config(CONFIGS / baseline)
    assert cfg.chunk.enabled and not base.chunk.enabled
    assert abs(flops_per_token(cfg)["total"] / flops_per_token(base)["total"] - 1) < 0.02
    assert abs(count_params(cfg)["total"] / count_params(base)["total"] - 1) < 0.02


def test_reallocate_reproduces_paper_ct_settings():
    base = load_model_config(CONFIGS / "paper_moe_90b.yaml")
    found = search_reallocations(base, 1.5, loop_layers=8)
    _check_matched(base, found)
    s1, s2 = found["more_experts"].config, found["loop_more_experts"].config
    assert (s1.moe.top_k, s1.c_moe.top_k) == (8, 15)  # ConceptMoE-top15
    assert (s2.moe.top_k, s2.c_moe.top_k, s2.loop_end - s2.loop_start) == (8, 11, 8)  # top11-loop8
    ct = load_model_config(CONFIGS / "paper_ct_90b_top11_loop8.yaml")
    assert (ct.loop_start, ct.loop_end, ct.c_moe) == (s2.loop_start, s2.loop_end, s2.c_moe)
    vlm = search_reallocations(
        load_model_config(CONFIGS / "paper_moe_60b.yaml"), 2.0, concept_heads=48
    )
    _check_matched(load_model_config(CONFIGS / "paper_moe_60b.yaml"), vlm)
    # paper 4.2: 1.5x hidden
    assert vlm["wider_concept"].config.c_hidden == 3840


def test_cli_reads_only_model_section(tmp_path, capsys):
    data = {
        "model": _model_section("paper_moe_60b.yaml"),
        "trainer": {"lr": 1e-3},
        "data": {"anything": [1, 2]},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    assert (
        main(["flops", "--config", str(path), "--plain", "--ratio", "2", "--seq-len", "4096"]) == 0
    )
    out = capsys.readouterr().out
    for method in (
        "Baseline (MoE)",
        "Increasing C_moe",
        "Increasing L_C and C_moe",
        "Increasing C_attn and C_moe",
    ):
        assert method in out
    assert (
        main(["flops", "--config", str(path), "--json", "--ratio", "2", "--seq-len", "4096"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)
    expect = comparison_table(from_dict(ModelConfig, data["model"]), 2.0, 4096)
    assert [r["flops_per_token"] for r in rows] == pytest.approx(
        [r["flops_per_token"] for r in expect]
    )
    # overrides as `vlm train` takes them (plain key=value, anywhere): the same table wherever
    # they stand
    assert (
        main(
            [
                "flops",
                "--config",
                str(path),
                "model.moe.top_k=4",
                "--json",
                "--ratio",
                "2",
                "--seq-len",
                "4096",
            ]
        )
        == 0
    )
    plain = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                "flops",
                "--config",
                str(path),
                "--json",
                "--ratio",
                "2",
                "--seq-len",
                "4096",
                "model.moe.top_k=4",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out) == plain and plain != rows


def test_cli_conceptmoe_with_baseline_and_plot(tmp_path, capsys):
    png = tmp_path / "scaling.png"
    assert (
        main(
            [
                "flops",
                "--config",
                str(CONFIGS / "paper_ct_90b_top11_loop8.yaml"),
                "--plain",
                "--baseline",
                str(CONFIGS / "paper_moe_90b.yaml"),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "this config" in out and "C top_k 8->11; loop layers [14,22)x1" in out
    assert png.stat().st_size > 10_000


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {lr: 1}\n")
    assert main(["flops", "--config", str(bad)]) == 2
    assert "no top-level 'model:'" in capsys.readouterr().err
    bad.write_text("model: {moe: {top_k: 99}}\n")
    assert main(["flops", "--config", str(bad)]) == 2
    assert "top_k" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config(tmp_path / "missing.yaml")


def test_analytic_params_equal_the_real_model():
    """count_params must equal sum(p.numel()) of the model it describes, for every feature combination."""
    import dataclasses

    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig

    base = ModelConfig(
        vocab_size=101,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=3,
        decoder_layers=2,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=16,
            num_shared_experts=1,
            shared_hidden=8,
            grove_groups=2,
            grove_hidden=4,
        ),
    )
    variants = [
        base,
        base.baseline(),
        dataclasses.replace(base, tie_embeddings=True),
        dataclasses.replace(
            base, chunk=ChunkConfig(router="linear", residual="linear", joint_decoding_layers=1)
        ),
        dataclasses.replace(
            base,
            concept_hidden_size=48,
            concept_num_heads=6,
            concept_num_kv_heads=3,
            concept_moe=MoEConfig(num_experts=6, top_k=3, expert_hidden=8),
            loop_start=1,
            loop_end=3,
            loop_times=2,
        ),
    ]
    for cfg in variants:
        model = ConceptMoELM(cfg)
        real = sum(p.numel() for p in model.parameters())
        assert count_params(cfg)["total"] == real, cfg


def test_sliding_window_caps_the_token_stacks_attention_map():
    base = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(num_experts=2, top_k=1, expert_hidden=16),
    )
    local = replace(base, attention_window=128)
    full, win = attention_map_flops(base, 4096, 2.0), attention_map_flops(local, 4096, 2.0)
    # the concept model sees everything
    assert win["concept"] == full["concept"]
    per_head = 4.0 * base.num_heads * base.head_dim
    assert win["encoder"] == per_head * (128 * 129 / 2 + (4096 - 128) * 128)
    assert attention_map_flops(local, 100)["encoder"] == attention_map_flops(base, 100)["encoder"]
