"""Batched generation and scoring (ConceptMoEChat) and transformers' generate on the exported model."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from vlm.generate import ConceptMoEChat
from vlm.model.hf import save_pretrained


@pytest.fixture(scope="module")
def chat(tiny_vlm):
    return ConceptMoEChat(*tiny_vlm())


def img(seed):
    return Image.fromarray(
        np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    )


def test_batched_generation_equals_one_prompt_at_a_time(chat):
    prompts = ["<image>what colour?", "a much longer text-only prompt here", "<image><image>two"]
    images = [[img(0)], [], [img(1), img(2)]]
    batched = chat.generate(prompts, images, max_new_tokens=6)
    alone = [chat.generate([p], [i], max_new_tokens=6)[0] for p, i in zip(prompts, images)]
    assert batched == alone


def test_loglikelihood_matches_the_full_forward(chat):
    ctx, cont = "<image>the answer is", " red"
    ((ll, greedy),) = chat.loglikelihood([ctx], [cont], [[img(3)]])
    batch = chat.prompt_batch([ctx + cont], [[img(3)]])
    n = int((batch.doc_ids >= 0).sum())
    ids = chat.tokenizer.encode(cont)
    logits = chat.model(batch).logits[0, :n].float()
    logp = torch.log_softmax(logits, -1)
    ref = sum(logp[n - len(ids) - 1 + j, t].item() for j, t in enumerate(ids))
    assert ll == pytest.approx(ref, abs=1e-4)
    assert greedy == all(
        logits[n - len(ids) - 1 + j].argmax().item() == t for j, t in enumerate(ids)
    )
    # batched with another context of a different length: same score
    (ll2, _), _ = chat.loglikelihood([ctx, "short"], [cont, " x"], [[img(3)], []])
    assert ll2 == pytest.approx(ll, abs=1e-4)


def test_stop_strings_and_compression_stats(chat):
    chat.reset_stats()
    out = chat.generate(
        ["hello"], None, max_new_tokens=8, stop=[chat.tokenizer.decode(chat.tokenizer.encode("e"))]
    )
    assert "e" not in out[0]
    stats = chat.compression_stats()
    assert stats["tokens/text"] > 0 and stats["compression/ratio"] >= 1.0


def test_sampling_is_reproducible_with_a_seed_and_leaves_the_callers_rng_alone(chat):
    prompts, images = ["<image>\nwhat is this?", "a"], [[img(1)], []]
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    kw = dict(max_new_tokens=12, temperature=1.5, top_p=0.9)
    a = chat.generate(prompts, images, seed=7, **kw)
    assert torch.equal(torch.rand(1), before)  # the global RNG did not move
    assert chat.generate(prompts, images, seed=7, **kw) == a
    assert any(chat.generate(prompts, images, seed=s, **kw) != a for s in (8, 9, 10))


def test_transformers_generate_on_the_exported_model(chat, tmp_path):
    save_pretrained(chat.model, tmp_path, chat.tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = "plain text prompt"
    ours = chat.generate([prompt], None, max_new_tokens=5)[0]
    batch = chat.prompt_batch([prompt])
    ids = batch.input_ids[:, : int((batch.doc_ids >= 0).sum())]
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=None,
    )
    assert chat.tokenizer.decode(out[0, ids.shape[1] :].tolist()) == ours


def test_image_only_prompt_generates(chat):
    """A caption task's prompt is just the image: valid for generation (training data would reject it)."""
    out = chat.generate(["<image>"], [[img(5)]], max_new_tokens=3)
    assert len(out) == 1 and isinstance(out[0], str)


def test_stop_on_a_special_token_string(chat, monkeypatch):
    """`<|end|>` is a special token: the stop check must see it although the returned text hides specials."""
    tok = chat.tokenizer
    script = tok.encode("yes") + [tok.end_id] + tok.encode("What")
    calls = {"n": 0}

    def scripted(input_ids=None, **kw):  # the model "says" the script, one token per forward
        t = script[min(calls["n"], len(script) - 1)]
        calls["n"] += 1
        logits = torch.zeros(*input_ids.shape, chat.model.model_cfg.vocab_size)
        logits[:, -1, t] = 1.0
        return CausalLMOutputWithPast(logits=logits)

    monkeypatch.setattr(chat.hf, "forward", scripted)
    out = chat.generate(["q"], None, max_new_tokens=8, stop=["<|end|>"])
    assert out == ["yes"] and calls["n"] == len(tok.encode("yes")) + 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_generation_equals_recompute(chat, temperature):
    """The default (prefill once, one cached step per token) against re-running the whole prefix each token."""
    prompts = [
        "<image>\nwhat is this?",
        "a",
        "<image> and <image> compared over a longer prompt",
        "no image here",
    ]
    images = [[img(1)], [], [img(2), img(3)], []]
    kw = dict(max_new_tokens=40, temperature=temperature, seed=3)
    assert chat.generate(prompts, images, **kw) == chat.generate(
        prompts, images, use_cache=False, **kw
    )


def test_transformers_generate_uses_the_concept_cache_with_left_padding(chat, tmp_path):
    """A left-padded batch through `generate(use_cache=True)`: the same tokens as without the cache
    and as the project's own decoding, and the cache it carries is the project's InferenceCache."""
    from vlm.model.cache import InferenceCache

    save_pretrained(chat.model, tmp_path, chat.tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompts = ["a short one", "a considerably longer plain text prompt"]
    ours = chat.generate(prompts, None, max_new_tokens=8)
    rows = [chat.tokenizer.encode(p) for p in prompts]
    rows = [[chat.tokenizer.bos_id] + r for r in rows]
    T = max(len(r) for r in rows)
    ids = torch.tensor([[chat.tokenizer.pad_id] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    seen = []
    step = hf.vlm.step
    hf.vlm.step = lambda *a: (seen.append(type(a[1])), step(*a))[1]
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    cached, full = hf.generate(ids, use_cache=True, **kw), hf.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached, full)
    assert [chat.tokenizer.decode(r[T:].tolist()) for r in cached] == ours
    assert seen and set(seen) == {InferenceCache}  # the cached steps ran


def test_cached_loglikelihood_equals_one_forward_per_pair(chat):
    """Shared contexts encoded once and continued from their caches score as full forwards do."""
    contexts = [
        "<image>\nwhat colour?",
        "<image>\nwhat colour?",
        "plain question",
        "<image>\nwhat colour?",
    ]
    # the last one shares the text, not the image
    images = [[img(1)], [img(1)], [], [img(2)]]
    conts = ["red", "a longer answer", "x", "blue"]
    cached = chat.loglikelihood(contexts, conts, images)
    full = chat.loglikelihood(contexts, conts, images, use_cache=False)
    assert [g for _, g in cached] == [g for _, g in full]
    assert all(abs(a - b) < 1e-4 for (a, _), (b, _) in zip(cached, full))
    assert len({round(a, 4) for a, _ in cached}) == 4  # four different scores


def test_transformers_options_hidden_states_checkpointing_and_clear_refusals(chat, tmp_path):
    save_pretrained(chat.model, tmp_path, chat.tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[chat.tokenizer.bos_id] + chat.tokenizer.encode("some text to score")])
    out = hf(ids, output_hidden_states=True)
    cfg = hf.vlm.model_cfg
    assert len(out.hidden_states) == cfg.encoder_layers + cfg.decoder_layers + 2
    torch.testing.assert_close(hf.vlm.lm.lm_head(out.hidden_states[-1]), out.logits)
    assert hf(ids).hidden_states is None

    hf.train()
    grads, calls = [], []
    block = hf.vlm.lm.decoder[0]
    forward = block.forward
    block.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]
    for enable in (False, True):
        (hf.gradient_checkpointing_enable if enable else hf.gradient_checkpointing_disable)()
        hf.zero_grad()
        torch.manual_seed(0)  # the same sampled boundaries both times
        hf(ids, labels=ids).loss.backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in hf.vlm.lm.parameters() if p.grad is not None])
        )
    assert hf.is_gradient_checkpointing
    # once without, twice (forward + recompute) with
    assert len(calls) == 3
    # the same gradients, activations recomputed
    torch.testing.assert_close(grads[0], grads[1])
    with pytest.raises(ValueError, match="does not support output_attentions"):
        hf(ids, output_attentions=True)


def test_on_tokens_streams_every_rows_tokens_as_they_grow(chat):
    prompts, images = ["<image>\nwhat is this?", "a longer text prompt"], [[img(4)], []]
    seen = []
    out = chat.generate(
        prompts,
        images,
        max_new_tokens=7,
        on_tokens=lambda rows: seen.append([list(r) for r in rows]),
    )
    assert 1 <= len(seen) <= 7
    for earlier, later in zip(seen, seen[1:]):  # each row only grows, by at most one token a step
        assert all(l[: len(e)] == e and len(l) - len(e) <= 1 for e, l in zip(earlier, later))
    assert (
        [chat.tokenizer.decode(r) for r in seen[-1]]
        == out
        == chat.generate(prompts, images, max_new_tokens=7)
    )
