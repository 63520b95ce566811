"""Fast guards for what only the slow tier caught (issue 36, item 5): five planted bugs that
`make test-fast` (`pytest -m "not slow"`) let through. Each test here fails on its bug and
runs in seconds:

Legend: B rows, T tokens.

1. the per-document ratio loss averaged over documents instead of weighted by n_d / N;
2. the statistics pass counting MoE loads a second time (its `load_accum` not put back);
3. a pretrained SigLIP / CLIP tower whose intermediate size is not a multiple of its width (SigLIP:
   4304 / 1152);
4. a one-image question/answer row from an importer counted as a caption instead of a chat sample
   (its guard: tests/test_data_vqa_counts_as_chat.py);
5. a stop signal (the flag its handler sets) that ends the run without saving, in the vision warm-up
   and in training.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from configs.batch import PackedBatch


# ======================================== 1. per-document ratio loss: n_d / N weights
def _eq4(F_: float, G: float, R: float) -> float:
    """ConceptMoE eq. 4 written out again (plain floats), so the expectation does not reuse the code under test."""
    return R / (R - 1) * ((R - 1) * F_ * G + (1 - F_) * (1 - G))


# Three documents of unequal length, each with its own boundary count and p: (tokens, boundaries, p
# of every token)
_DOCS = [
    (2, 2, 0.9),  # every token a boundary (ratio 1): below the band, target R/s
    (6, 1, 0.2),  # ratio 6: above the band, target R*s
    (12, 6, 0.5),
]  # ratio 2: inside the band, eq. 4 is 1
_R, _SLACK = 2.0, 1.25


def _doc_term(docs, N: float) -> float:
    """sum_d n_d / N * eq4(F_d, G_d, R_d), R_d the document's own ratio clamped into [R/s, R*s]."""
    total = 0.0
    for n, b, p in docs:
        R_d = min(max(n / b, _R / _SLACK), _R * _SLACK)
        total += n / N * _eq4(b / n, p, R_d)
    return total


def test_document_ratio_loss_weights_each_document_by_its_share_of_the_tokens():
    from vlm.model.ratio_loss import document_ratio_loss

    n = torch.tensor([float(d[0]) for d in _DOCS])
    b = torch.tensor([float(d[1]) for d in _DOCS])
    psum = torch.tensor([d[0] * d[2] for d in _DOCS])
    N = float(n.sum())
    want = _doc_term(_DOCS, N)
    # the bug: a mean over documents
    averaged = sum(_doc_term([d], d[0]) for d in _DOCS) / len(_DOCS)
    # (the fixture tells them apart)
    assert abs(want - averaged) > 0.05
    got = document_ratio_loss(n, b, psum, torch.tensor(N), _R, _SLACK)
    assert float(got) == pytest.approx(want, rel=1e-6), (
        f"got {float(got)}, documents averaged would be {averaged}"
    )
    # an empty slot (padding, another row's spare) adds nothing
    pad = document_ratio_loss(
        torch.cat([n, torch.zeros(2)]),
        torch.cat([b, torch.zeros(2)]),
        torch.cat([psum, torch.zeros(2)]),
        torch.tensor(N),
        _R,
        _SLACK,
    )
    assert float(pad) == pytest.approx(want, rel=1e-6)
    # micro-batches holding parts of the documents, each weighted by the global N, sum to the whole
    parts = [
        document_ratio_loss(n[s], b[s], psum[s], torch.tensor(N), _R, _SLACK)
        for s in (slice(0, 2), slice(2, 3))
    ]
    assert float(sum(parts)) == pytest.approx(want, rel=1e-6)


def _packed_row(docs, pad: int = 2):
    """One row holding `docs` back to back, then padding: doc ids, p and boundaries as the chunk module sees them."""
    doc, p, bnd = [], [], []
    for d, (n, nb, pv) in enumerate(docs):
        doc += [d] * n
        p += [pv] * n
        bnd += [True] * nb + [False] * (n - nb)
    doc += [-1] * pad
    p += [0.0] * pad
    bnd += [False] * pad
    return torch.tensor([doc]), torch.tensor([p]), torch.tensor([bnd])


def test_the_ratio_loss_adds_the_token_weighted_document_term_and_micro_batches_sum_to_the_batch():
    """vlm.train.losses.ratio_loss_value: the band's term is document_weight * sum_d n_d / N eq4_d
    on top of the batch term, N the group's global token count, so two micro-batches (under the
    global parser's sums) add up to the whole batch's term."""
    from types import SimpleNamespace

    from vlm.model.config import ChunkConfig
    from vlm.train.losses import ratio_loss_value

    weight = 3.0  # loss.document
    band = ChunkConfig(router="linear", target_ratio=_R, document_slack=_SLACK)
    plain = ChunkConfig(router="linear", target_ratio=_R)
    N = float(sum(d[0] for d in _DOCS))

    def doc_term(docs, glob=None):
        doc, p, b = _packed_row(docs)
        chunks = SimpleNamespace(p_BT=p, b_BT=b)
        return float(
            ratio_loss_value(chunks, doc, None, band, glob, document_weight=weight)[0]
            - ratio_loss_value(chunks, doc, None, plain, glob)[0]
        )

    whole = doc_term(_DOCS)
    assert whole == pytest.approx(weight * _doc_term(_DOCS, N), rel=1e-5), (
        f"document term {whole}, want {weight * _doc_term(_DOCS, N)} (n_d / N weights)"
    )
    # two micro-batches: the global parser hands each the whole batch's sums (boundaries, sum of
    # p, tokens)
    glob = torch.tensor([[sum(d[1] for d in _DOCS), sum(d[0] * d[2] for d in _DOCS), N]])
    parts = [doc_term(_DOCS[:2], glob), doc_term(_DOCS[2:], glob)]
    assert sum(parts) == pytest.approx(whole, rel=1e-5), (
        f"micro-batch shares {parts} do not sum to {whole}"
    )


# ======================================== 2. the statistics pass leaves the MoE loads as they were
def _balancing_lm():
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=16,
            loss_free_balancing=True,
        ),
        chunk=ChunkConfig(target_ratio=2.0),
    )
    return ConceptMoELM(cfg).train()


def _micro_batches(micro: int, T: int = 40) -> list[PackedBatch]:
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(micro):
        lengths = [13 + 2 * k, 9, T - 24 - 2 * k]
        out.append(
            PackedBatch.from_documents(
                [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths], row_len=T
            )
        )
    return out


def _moe_loads(model) -> torch.Tensor:
    from vlm.model.moe import MoE

    return torch.cat([m.load_accum.clone() for m in model.modules() if isinstance(m, MoE)])


def _settings(model, seed: int = 0):
    from vlm.model.training_controls import TrainingControls
    from vlm.train.layout import ParallelLayout
    from vlm.train.loss_config import LossConfig
    from vlm.train.losses import Loss
    from vlm.train.step import StepSettings

    return StepSettings(
        Loss(model.cfg, LossConfig(balance=0.0)), TrainingControls(model), seed,
        ParallelLayout(1, 0), torch.device("cpu"),
    )  # fmt: skip


def test_the_statistics_pass_leaves_the_moe_loads_as_they_were():
    from vlm.train.step import statistics_pass

    model = _balancing_lm()
    window = _micro_batches(3)
    with torch.no_grad():
        # a training forward counts its loads (what the pass must not add to)
        model(window[0])
    before = _moe_loads(model)
    assert float(before.sum()) > 0
    sums = statistics_pass(model, window, 0, _settings(model))
    assert set(sums) == {"ratio"} and float(sums["ratio"][0, 2]) == sum(
        int((b.doc_ids >= 0).sum()) for b in window
    )
    after = _moe_loads(model)
    assert torch.equal(after, before), (
        f"loads after the statistics pass {after.tolist()}, before {before.tolist()}"
    )


def test_a_step_with_the_statistics_pass_counts_each_token_once_in_the_balancing_loads(monkeypatch):
    """train_step, global parser, 2 micro-batches: what the MoE layers hold for the balancing
    update after the step is exactly the loads of the step's real passes (each routed token slot
    once), not twice."""
    from vlm.train.distributed import init_distributed
    from vlm.train.engine import initialize
    from vlm.train.step import train_step

    micro = 2
    model = _balancing_lm()
    init_distributed()
    engine = initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": micro,
            "train_batch_size": micro,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 0},
            "bf16": {"enabled": False},
            "steps_per_print": 10**12,
            "zero_allow_untested_optimizer": True,
        },
    )
    window = _micro_batches(micro)
    handed = []  # what the step hands the balancing update, across ranks (here: one)

    def model_statistics(flat):
        handed.append(flat.clone())
        return flat

    from vlm.model.moe import MoE
    from vlm.train import collectives

    monkeypatch.setattr(collectives, "model_statistics", model_statistics)
    res = train_step(engine, window, 0, _settings(model, seed=3))
    assert res.applied and len(handed) == 1
    # the real passes' loads, all layers
    real = float(sum(v.sum() for v in res.loads.values()))
    n_loads = sum(m.num_experts for m in model.modules() if isinstance(m, MoE))
    held = float(handed[0][:n_loads].sum())
    n_moe = len(res.loads)
    tokens = sum(int((b.doc_ids >= 0).sum()) for b in window)
    assert real > 0 and held == pytest.approx(real), (
        f"the MoE layers hold {held} routed slots for the balancing step, the real passes routed {real}"
    )
    # the encoder and decoder layers route every real token top_k = 2 times (the concept layer
    # fewer): an upper bound
    assert held <= n_moe * 2 * tokens


# ======================================== 3. a pretrained tower whose MLP is not a whole multiple
# of its width (model type, width, heads, intermediate size, layers, patch): SigLIP so400m's own
# widths (4304 / 1152 = 3.736..., one layer of it), a small SigLIP and CLIP at the same kind of
# ratio, and a width where width * (intermediate / width) comes back one short in floating point
# (240 / 176: 176 * 1.3636... = 239.99999999999997)
_TOWERS = [
    ("siglip", 1152, 16, 4304, 1, 14),
    ("siglip", 32, 2, 120, 2, 8),
    ("clip", 32, 2, 120, 2, 8),
    ("siglip", 176, 2, 240, 1, 8),
]


@pytest.mark.parametrize(
    "kind,width,heads,inter,layers,patch",
    _TOWERS,
    ids=["siglip-so400m-widths", "siglip-3.75", "clip-3.75", "siglip-240-of-176"],
)
def test_a_pretrained_tower_whose_mlp_is_not_a_multiple_of_its_width_loads_whole(
    kind, width, heads, inter, layers, patch, tmp_path
):
    """The encoder's MLP has the checkpoint's intermediate size, read as it is (not rebuilt from
    width * a ratio), and every tower tensor lands in it."""
    transformers = pytest.importorskip("transformers")
    from configs.config import from_dict
    from vision.config import VisionConfig

    torch.manual_seed(0)
    common = dict(
        hidden_size=width,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=4 * patch,
        patch_size=patch,
    )
    if kind == "siglip":
        hf = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common))
    else:
        hf = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**common))
    hf.save_pretrained(tmp_path)
    src = {k.removeprefix("vision_model."): v.detach() for k, v in hf.state_dict().items()}
    del hf
    # an encoder section that says otherwise: the folder's architecture wins
    cfg = from_dict(
        VisionConfig,
        {
            "processor": {"patch_size": 16, "min_patches": 4, "max_patches": 64, "merge": 2},
            "encoder": {
                "hidden_size": 64,
                "num_layers": 3,
                "num_heads": 4,
                "mlp_ratio": 4.0,
                "max_grid": 32,
                "merger": "none",
            },
            "timm_checkpoint": str(tmp_path),
        },
    )
    # a part that does not match raises ConfigError("the tower does not match")
    enc = cfg.build(16).encoder
    assert not enc.load_report.mismatches(), str(enc.load_report)
    for i in range(layers):
        fc1, fc2 = enc.blocks[i].mlp.fc1, enc.blocks[i].mlp.fc2
        assert tuple(fc1.weight.shape) == (inter, width), (
            f"block {i}: fc1 {tuple(fc1.weight.shape)}, want {inter}"
        )
        assert torch.equal(fc1.weight, src[f"encoder.layers.{i}.mlp.fc1.weight"])
        assert torch.equal(fc1.bias, src[f"encoder.layers.{i}.mlp.fc1.bias"])
        assert torch.equal(fc2.weight, src[f"encoder.layers.{i}.mlp.fc2.weight"])
    # and the tower runs: one 4 x 4-patch image
    grid = torch.tensor([[4, 4]])
    coords = torch.stack(
        torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1
    ).reshape(-1, 2)
    with torch.no_grad():
        out = enc(torch.randn(16, 3 * patch * patch), coords, grid)
    assert torch.isfinite(out).all()


# ======================================== 5. a stop request saves, in the warm-up and in training
def _stop_at_poll(polls: int, signum: int = signal.SIGINT):
    """A StopFlag raised as its signal handler raises it, seen at poll `polls` + 1 (deterministic:
    no real signal, no timing), as tests/test_train_chain.py simulates a Ctrl-C."""
    from vlm.train.signals import StopFlag

    class StopAtPoll(StopFlag):
        def __init__(self) -> None:
            super().__init__()
            self.left = polls

        @property
        def requested(self) -> bool:
            if self.signum is None:
                self.left -= 1
                if self.left < 0:
                    self.signum = signum
            return self.signum is not None

    return StopAtPoll()


def test_a_stop_in_training_checkpoints_the_last_step_and_returns_the_signal_code(
    tiny_data, tmp_path, tiny_config, make_trainer, torch_globals
):
    """Stop seen after step 3 of 50, with no periodic checkpoint due (save_every 1000): the run
    writes step 3's checkpoint, returns 128 + SIGINT, exports nothing, and the same run resumes from
    that step."""
    from vlm.train.checkpoint import list_checkpoints

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 50},
        checkpoint={"save_every": 1000, "keep_last": 2},
        logging={"eval_every": 0, "histogram_every": 0},
    )
    run = tmp_path / "run"
    tr = make_trainer(cfg, run, stop=_stop_at_poll(3))
    rc = tr.train()
    assert rc == 128 + signal.SIGINT == 130
    n = tr.step
    assert 0 < n < 50
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [n], (
        f"stopped after step {n}; checkpoints: {list_checkpoints(run / 'checkpoints')}"
    )
    assert not (run / "final").exists()
    again = make_trainer(cfg, run, resume=True)
    assert again.run.resume_from == run / "checkpoints" / f"step_{n:08d}"
    again.restore(again.run.resume_from)
    assert again.step == n


def test_a_stop_in_the_vision_warmup_saves_its_state_and_raises_preempted(
    tiny_data, tmp_path, tiny_config, make_trainer, load_tiny, torch_globals
):
    """Stop seen after warm-up step 4 of 50 (its periodic saves come every 5 steps): the warm-up
    saves its state at step 4 and the trainer's construction raises Preempted with 128 + SIGTERM;
    the next start continues from it."""
    from vlm.train.checkpoint import load_state_dir
    from vlm.train.signals import Preempted
    from vlm.train.trainer import Trainer
    from vlm.train.vision_warmup import STATE_NAME

    cfg = tiny_config(
        tiny_data,
        train={"max_steps": 1},
        checkpoint={"save_every": 1000},
        logging={"eval_every": 0, "histogram_every": 0},
        vision_warmup={"steps": 50, "images_per_step": 4, "min_word_count": 2, "held_out": 8},
    )
    run = tmp_path / "run"
    with pytest.raises(Preempted) as info:
        make_trainer(cfg, run, stop=_stop_at_poll(3, signal.SIGTERM))
    assert info.value.code == 128 + signal.SIGTERM == 143
    assert "in the vision warm-up at step 4/50" in str(info.value), str(info.value)
    state = load_state_dir(run / "checkpoints", STATE_NAME, warn=pytest.fail)
    assert state is not None, (
        f"no warm-up state in {run / 'checkpoints' / STATE_NAME} after the stop"
    )
    assert state["step"] == 4 and len(state["losses"]) == 4
    assert not (run / "vision_warmup.json").exists()  # the warm-up did not finish
    lines: list[str] = []
    Trainer(load_tiny(cfg), run, log=lines.append)
    assert any(
        f"continuing from {run / 'checkpoints' / STATE_NAME} at step 4/50" in x for x in lines
    ), lines
    assert json.loads((run / "vision_warmup.json").read_text())["steps"] == 50
