"""Decode tokens/s and KV-cache bytes of ConceptMoE against its MoE baseline, per context length and
batch size.

Legend: B rows, J key/value heads, C KV cache entries, d head width.

Every model gets caches filled to the context length (random keys and values: decode cost depends on
how much is cached, not on what) and then decodes `steps` tokens per round. ConceptMoE's caches hold
the context's T/R concepts and its boundaries fire at rate 1/R (forced, as a trained model at
realized ratio R does). The step has fixed shapes (it can be compiled and captured as a CUDA graph):
every row runs the concept model every step and the rows whose boundary did not fire keep their
caches, so what ConceptMoE saves per step is the concept model's shorter attention (T/R cached
concepts), not its MoE. Between rounds the caches are rewound to the context (not timed), so every
round decodes the same positions. A round's figure is batch * steps / its total time: a ConceptMoE
step costs more when boundaries fire, and a stream of tokens at ratio R pays the mean over steps.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

import torch

from eval.bench import common
from eval.bench.model import BASE, BASELINE
from vlm.model.cache import ChunkState, InferenceCache
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.reallocate import reallocate

PART = "decode"


@dataclass
class Settings:
    contexts: list[int] = field(default_factory=lambda: [1024, 4096, 8192, 16384])
    batches: list[int] = field(default_factory=lambda: [1, 8])
    ratio: float = 2.0
    steps: int = 16  # decoded tokens per round
    repeats: int = 5
    warmup: int = 1


SETTINGS = {
    "full": Settings(),
    "quick": Settings(contexts=[1024, 4096], steps=8, repeats=5),
    "smoke": Settings(contexts=[64], batches=[2], steps=2, repeats=2),
}


def filled_cache(
    model: ConceptMoELM, B: int, T: int, ratio: float | None, steps: int, gen
) -> InferenceCache:
    """Caches as a prompt of T tokens (T/R concepts) would leave them, with room for `steps` more."""
    cfg, D = model.cfg, model.cfg.hidden_size
    like = torch.zeros((), dtype=torch.float32)
    cache = model.allocate_inference_cache(B, T + steps, like)
    n_concepts = T if ratio is None else max(1, round(T / ratio))
    cache.concept = model._caches(
        cfg.c_kv_heads, len(cfg.concept_schedule), B, n_concepts + steps, like
    )
    if model.cross:  # DLCM's decoder: one key/value per concept in each cross-attending layer
        cache.cross = model._caches(
            cfg.num_kv_heads, cfg.num_joint_layers, B, n_concepts + steps, like
        )
    filled = [(c, T) for c in cache.encoder + cache.decoder] + [
        (c, n_concepts) for c in cache.concept + cache.cross
    ]
    for c, n in filled:
        c.k_BJCd[:, :, :n].normal_(generator=gen)
        c.v_BJCd[:, :, :n].normal_(generator=gen)
        c.len_B.fill_(n)
    cache.len_B = torch.full((B,), T, dtype=torch.long)
    cache.used_tokens, cache.used_concepts = T, n_concepts
    if model.chunker is not None:
        cache.chunk = ChunkState(
            torch.randn(B, D, generator=gen),
            torch.zeros(B, D),
            torch.zeros(B, dtype=torch.long),
            torch.randn(B, D, generator=gen),
            torch.full((B,), n_concepts, dtype=torch.long),
        )
    return cache


def rewinder(cache: InferenceCache):
    """A function that puts the cache back to its current lengths and chunk state (the entries
    written past them are overwritten by the next round)."""
    caches = cache.encoder + cache.concept + cache.decoder + cache.cross
    lens = [c.len_B.clone() for c in caches]
    len_B = cache.len_B.clone()
    chunk = (
        None if cache.chunk is None else [getattr(cache.chunk, f.name) for f in fields(ChunkState)]
    )

    used = cache.used_tokens, cache.used_concepts

    def rewind():
        for c, n in zip(caches, lens):
            c.len_B.copy_(n)
        cache.len_B = len_B.clone()
        cache.used_tokens, cache.used_concepts = used
        if chunk is not None:
            cache.chunk = ChunkState(*(None if t is None else t.clone() for t in chunk))

    return rewind


def decoder(model: ConceptMoELM, B: int, T: int, ratio: float | None, steps: int, seed: int = 0):
    """A self-timed round of `steps` decode steps from a context of T, and the KV bytes per sequence."""
    gen = torch.Generator().manual_seed(seed)
    cache = filled_cache(model, B, T, ratio, steps, gen)
    kv_bytes = (cache.token_bytes() + cache.concept_bytes() + cache.cross_bytes()) / B
    rewind = rewinder(cache)
    with torch.no_grad():  # each step's input [B, D] and (ConceptMoE) boundaries [B]
        xs = model.embed(torch.randint(0, model.cfg.vocab_size, (steps, B), generator=gen))
    fires = torch.rand(steps, B, generator=gen) < (1.0 / ratio if ratio else 1.0)

    @torch.no_grad()
    def round_() -> float:
        rewind()
        t0 = time.perf_counter()
        for i in range(steps):  # one step per token is what decoding is
            model.step(xs[i], cache, force_B=fires[i] if ratio else None)
        return time.perf_counter() - t0

    return round_, kv_bytes


def run(s: Settings, log=print) -> dict:
    torch.manual_seed(0)
    base = BASE.baseline()
    models = {
        BASELINE: (base, None),
        **{k: (v, s.ratio) for k, v in reallocate(base, s.ratio).items()},
    }
    built = {name: ConceptMoELM(cfg).eval() for name, (cfg, _) in models.items()}
    out = []
    for T in s.contexts:
        for B in s.batches:
            fns, kv = {}, {}
            for name, (_, r) in models.items():
                fns[name], kv[name] = decoder(built[name], B, T, r, s.steps)
            secs = common.measure(fns, s.repeats, s.warmup)
            extra = {
                n: {"kv_bytes_per_seq": kv[n], "kv_ratio": kv[n] / kv[BASELINE]} for n in models
            }
            rs = common.rows(
                common.per_second(secs, B * s.steps),
                BASELINE,
                {"context": T, "batch": B},
                "decode tokens/s",
                "tok/s",
                extra,
            )
            out += rs
            log(
                f"  decode T={T} B={B}: "
                + ", ".join(f"{r['candidate']} x{r['ratio_vs_baseline']:.2f}" for r in rs)
            )
            del fns
    return common.result(
        PART,
        asdict(s),
        out,
        notes=[
            "KV bytes per sequence at the context length (fp32 caches); kv_ratio vs the baseline"
        ],
        base_config={k: v for k, v in vars(BASE).items() if isinstance(v, (int, float, str))},
    )


def plot(res: dict, path) -> None:
    common.plot(
        res,
        path,
        x="context",
        panels=("batch",),
        ylabel="decode tokens/s vs MoE baseline",
        title=f"decode, realized R = {res['settings']['ratio']:g}",
    )
