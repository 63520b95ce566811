"""Serving measured: tokens/s and time to first token through vLLM against `vlm chat`'s generation
(`ConceptMoEChat.generate`), for a ConceptMoE and its MoE baseline (the same model with chunking
off), at batch 1 and 8; the concept cache's bytes against a per-token cache; and how many requests
of max-model-len tokens vLLM admits at once for each, in the same cache memory (`--cache-gib`).

Legend: B rows, V vocabulary.

    .venv/bin/python -m vlm.serve.bench --out runs/serve_bench

Runs in the project's venv and the vLLM half in the serve venv (`make serve-venv`), one engine at a
time; every figure is the best of 3 (`vlm chat`'s: of two rounds of 3, before and after the
engines), each engine computing on one core. Both models are built here with random weights
(seeded) and exported: the numbers measure the engines, not a trained model (the realized
compression ratio is printed with them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

WORDS = (
    "the cat sat on a red mat while two blue birds sang over the old stone "
    "wall near the river and a child counted clouds shaped like boats"
).split()
SERVE_PY = Path(__file__).resolve().parents[2] / ".venv-serve" / "bin" / "python"


def build_exports(out: Path, seed: int = 0) -> dict[str, Path]:
    """A small ConceptMoE VLM (byte tokenizer; head_dim 64, a head size vLLM's CPU kernels
    take as it is) and its MoE baseline, exported to out/{conceptmoe,baseline}/final; an
    image at out/image.png."""
    from PIL import Image

    from data_pipelines.tokenizer import load_tokenizer
    from vision.config import VisionConfig
    from vision.image_processor import ImageProcessorConfig
    from vision.navit import NaViTConfig
    from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
    from vlm.model.hf import save_pretrained
    from vlm.model.multimodal import ConceptMoEVLM

    tok = load_tokenizer("byte")
    vc = VisionConfig(
        processor=ImageProcessorConfig(patch_size=8, min_patches=4, max_patches=64, merge=2),
        encoder=NaViTConfig(hidden_size=64, num_layers=1, num_heads=2, max_grid=32),
    )
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        encoder_layers=2,
        concept_layers=4,
        decoder_layers=2,
        init_std=0.1,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=256),
        chunk=ChunkConfig(target_ratio=2.0),
    )
    baseline = dataclasses.replace(cfg, chunk=ChunkConfig(enabled=False))
    paths = {}
    for name, c in (("conceptmoe", cfg), ("baseline", baseline)):
        final = out / name / "final"
        if not (final / "config.json").is_file():
            torch.manual_seed(seed)
            save_pretrained(ConceptMoEVLM(c, vc).eval(), final, tokenizer=tok)
        paths[name] = final
    img = out / "image.png"
    if not img.is_file():
        pixels = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(img)
    return paths


def prompts(image: Path, n: int = 8, words: int = 24) -> list[dict]:
    """n chat prompts (113-208 tokens with the byte tokenizer); every other one asks
    about the image."""
    out = []
    for i in range(n):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words + 2 * i))
        if i % 2:
            out.append(
                {"prompt": f"<|user|><image>\n{text}?<|end|><|assistant|>", "images": [str(image)]}
            )
        else:
            out.append({"prompt": f"<|user|>{text}<|end|><|assistant|>"})
    return out


def _timed(fn, repeats: int = 3) -> float:
    """The best of `repeats` wall times: the machine's other work only ever adds time."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _rates(gen, n_prompts: int, new_tokens: int) -> dict:
    """gen(k, n): generate n tokens for prompt k alone (k >= 0) or for all prompts at once (k = -1).
    Batch 1: the first two prompts one by one; TTFT: a one-token generation."""
    gen(0, 4)  # warm-up
    one = [_timed(lambda i=i: gen(i, new_tokens)) for i in range(2)]
    return {
        "b1_tok_s": new_tokens / float(np.mean(one)),
        "b1_ttft_s": float(np.mean([_timed(lambda i=i: gen(i, 1)) for i in range(2)])),
        "b8_tok_s": n_prompts * new_tokens / _timed(lambda: gen(-1, new_tokens)),
        "b8_ttft_s": _timed(lambda: gen(-1, 1)),
    }


def measure_project(final: Path, reqs: list[dict], new_tokens: int) -> dict:
    """`vlm chat`'s generation (greedy, cached), and the caches' bytes after batch 8. On one
    thread: vLLM's CPU worker computes on one core (it binds one and leaves the other to its front
    end), and one thread does not stall on a core that other work holds."""
    from vlm.generate import load_eval_model

    torch.set_num_threads(1)

    chat = load_eval_model(final, device="cpu")
    text = [r["prompt"] for r in reqs]
    imgs = [[Path(i).read_bytes() for i in r.get("images", [])] for r in reqs]

    def gen(k: int, n: int):
        chat.generate(
            text if k < 0 else text[k : k + 1], imgs if k < 0 else imgs[k : k + 1], max_new_tokens=n
        )

    res = _rates(gen, len(text), new_tokens)
    chat.reset_stats()
    gen(-1, 1)
    res["ratio"] = chat.compression_stats().get("compression/ratio", 1.0)
    res.update(cache_bytes(chat, text, imgs, new_tokens))
    return res


def cache_bytes(chat, text, imgs, new_tokens: int) -> dict:
    """Bytes per request of the project's caches after the prompt and `new_tokens` greedy tokens:
    the token layers' KV, the concept model's (one entry per realized concept), and what the concept
    model's would hold with one entry per token."""
    batch = chat.prompt_batch(text, imgs)
    out, cache = chat.model.prefill(batch, new_tokens)
    tok = out.last_logits_BV.argmax(-1)
    for _ in range(new_tokens - 1):
        tok = chat.model.step(tok, cache).argmax(-1)
    B, tokens = len(text), int(cache.len_B.sum())
    concept = cache.concept_bytes()
    per_concept = concept / max(1, int(cache.concept[0].len_B.sum())) if cache.concept else 0
    return {
        "token_kv_bytes": cache.token_bytes() / B,
        "concept_bytes": concept / B,
        "concept_per_token_bytes": per_concept * tokens / B,
        "tokens_per_request": tokens / B,
    }


def measure_vllm(final: Path, reqs: list[dict], new_tokens: int, **engine) -> dict:
    from vllm import LLM, SamplingParams

    from vlm.serve.engine import engine_kwargs
    from vlm.serve.offline import cache_figures, engine_inputs

    llm = LLM(**engine_kwargs(final, **engine))
    inputs = engine_inputs(llm, reqs)

    def gen(k: int, n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(inputs if k < 0 else inputs[k : k + 1], params, use_tqdm=False)

    res = _rates(gen, len(inputs), new_tokens)
    res.update(cache_figures(llm))
    return res


def state_layout(final: Path, vllm: dict) -> dict:
    """vLLM's allocation per request at max-model-len: the concept state as the engine laid it out
    (`vllm`: its `cache_figures`), in its pages, against the same state with one entry per token,
    and the token layers' paged KV in whole token blocks."""
    from vlm.model.hf import ConceptMoEConfig
    from vlm.serve.layout import StatePlan, plan_state, state_bytes, token_page_bytes

    mc, _ = ConceptMoEConfig.from_pretrained(str(final)).build_configs()
    L, block = vllm["max_model_len"], vllm["block_size"]
    page = token_page_bytes(mc, block, torch.float32)
    passes = max(1, len(mc.concept_schedule))
    plan = StatePlan(passes, vllm["state_layers"] // passes, vllm["state_entries"])
    return {
        "state_bytes": state_bytes(mc, plan, torch.float32),
        "state_pages_bytes": plan.layers * page,
        "state_per_token_bytes": state_bytes(mc, plan_state(mc, L, torch.float32), torch.float32),
        "token_kv_bytes": -(-L // block) * (mc.encoder_layers + mc.decoder_layers) * page,
        "capacity": plan.capacity,
        "max_model_len": L,
    }


def table(res: dict) -> str:
    rows = [
        "| model | engine | tok/s b1 | tok/s b8 | TTFT b1 (ms) | TTFT b8 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for model in ("conceptmoe", "baseline"):
        for engine in ("vllm", "vlm chat"):
            r = res[model][engine]
            rows.append(
                f"| {model} | {engine} | {r['b1_tok_s']:.1f} | {r['b8_tok_s']:.1f} "
                f"| {1000 * r['b1_ttft_s']:.0f} | {1000 * r['b8_ttft_s']:.0f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m vlm.serve.bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", default="runs/serve_bench")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument(
        "--cache-gib", type=float, default=1.0, help="both engines' KV cache and concept state"
    )
    p.add_argument("--vllm-only", metavar="JSON", help=argparse.SUPPRESS)  # the serve venv's half
    args = p.parse_args(argv)
    out = Path(args.out)
    reqs = prompts(out / "image.png")
    if args.vllm_only:
        job = json.loads(args.vllm_only)
        res = measure_vllm(
            Path(job["final"]),
            reqs,
            args.new_tokens,
            max_model_len=args.max_model_len,
            concept_capacity=job["capacity"],
            cache_gib=args.cache_gib,
        )
        Path(job["dst"]).write_text(json.dumps(res))
        return
    paths = build_exports(out)
    # the machine's load before and after: other work on it slows every figure
    res: dict = {"loadavg_1min": [os.getloadavg()[0]], "torch": torch.__version__}
    res["cache_gib"] = args.cache_gib
    res.update(
        {
            name: {"vlm chat": measure_project(final, reqs, args.new_tokens)}
            for name, final in paths.items()
        }
    )
    first = {name: res[name]["vlm chat"] for name in paths}
    # the project's eval capacity rule at slack 1.25, for the realized ratio
    R = res["conceptmoe"]["vlm chat"]["ratio"]
    capacity = -(-int(args.max_model_len * 1.25 / R) // 16) * 16
    for name, final in paths.items():
        dst = out / f"vllm_{name}.json"
        job = {
            "final": str(final),
            "capacity": capacity if name == "conceptmoe" else None,
            "dst": str(dst),
        }
        subprocess.run(
            [
                str(SERVE_PY),
                "-m",
                "vlm.serve.bench",
                "--out",
                str(out),
                "--new-tokens",
                str(args.new_tokens),
                "--max-model-len",
                str(args.max_model_len),
                "--cache-gib",
                str(args.cache_gib),
                "--vllm-only",
                json.dumps(job),
            ],
            check=True,
        )
        res[name]["vllm"] = json.loads(dst.read_text())
    # `vlm chat` again, after the engines: each figure the better of the two rounds
    for name, final in paths.items():
        again = measure_project(final, reqs, args.new_tokens)
        res[name]["vlm chat"] = {
            k: (max if k.endswith("tok_s") else min)(v, again[k])
            if k.endswith(("tok_s", "ttft_s"))
            else v
            for k, v in first[name].items()
        }
    res["state"] = state_layout(paths["conceptmoe"], res["conceptmoe"]["vllm"])
    res["loadavg_1min"].append(os.getloadavg()[0])
    (out / "serve_bench.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    for name in paths:
        v = res[name]["vllm"]
        print(f"{name}: admits {v['max_concurrency']:.2f} requests of {v['max_model_len']} tokens")
    print(
        json.dumps(
            {
                k: v
                for k, v in res["conceptmoe"]["vlm chat"].items()
                if "bytes" in k or k in ("ratio", "tokens_per_request")
            }
        )
    )
    print(json.dumps(res["state"]))


if __name__ == "__main__":
    main()
