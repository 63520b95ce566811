"""Greedy generation through vLLM's offline engine, as JSON: what tests/test_serve.py compares with
`vlm chat`. Runs in the serve venv:

    .venv-serve/bin/python -m vlm.serve.offline RUN/final requests.json out.json ['{engine args}']

requests.json: {"max_tokens": N, "batches": [[{"prompt": str, "images": [png path, ...]}, ...]]};
each batch goes to the engine at once (vLLM batches its requests). out.json: {"batches":
[[{"token_ids": [...], "prompt_token_ids": [...], "text": str}, ...]], "seconds": [...], "cache":
{...}} (`cache_figures`: what vLLM allocated, and how many requests it admits at once).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def engine_inputs(llm, requests: list[dict]) -> list[dict]:
    """vLLM prompts for the project's (text with `<image>`, image paths): `<bos>` in front, as the
    project's processor puts it (vlm.model.processing), and the images decoded."""
    from PIL import Image

    bos = llm.get_tokenizer().bos_token
    out = []
    for r in requests:
        text = r["prompt"] if not bos or r["prompt"].startswith(bos) else bos + r["prompt"]
        p: dict = {"prompt": text}
        if r.get("images"):
            p["multi_modal_data"] = {"image": [Image.open(i).convert("RGB") for i in r["images"]]}
        out.append(p)
    return out


def cache_figures(llm) -> dict:
    """vLLM's cache as the engine sized it: the token block (tokens per page), the pages (blocks),
    the tokens they hold, and the requests of max-model-len tokens it admits at once (its
    "maximum concurrency"); for a ConceptMoE also the concept state's layout (layout.py's
    `plan_state`) and how full a state page is (1: no padding)."""
    from vlm.serve.layout import state_bytes, token_page_bytes
    from vlm.serve.model import _configs, _plan

    cfg = llm.llm_engine.vllm_config
    cache = cfg.cache_config
    out = {
        "block_size": cache.block_size,
        "kv_blocks": cache.num_gpu_blocks,
        "kv_cache_tokens": cache.kv_cache_size_tokens,
        "max_concurrency": cache.kv_cache_max_concurrency,
        "max_model_len": cfg.model_config.max_model_len,
    }
    mc, _ = _configs(cfg)
    if mc.chunk.enabled:
        plan, dtype = _plan(cfg), cfg.model_config.dtype
        page = token_page_bytes(mc, cache.block_size, dtype)
        out.update(
            state_layers=plan.layers,
            state_entries=plan.entries,
            concept_capacity=plan.capacity,
            state_page_fill=state_bytes(mc, plan, dtype) / plan.layers / page,
        )
    return out


def run(final_dir: str, requests: dict, **engine) -> dict:
    from vllm import LLM, SamplingParams

    from vlm.serve.engine import engine_kwargs

    llm = LLM(**engine_kwargs(final_dir, **engine))
    # vlm chat stops at <eos> only; the caller cuts there
    params = SamplingParams(temperature=0.0, max_tokens=requests["max_tokens"], ignore_eos=True)
    out: dict = {"batches": [], "seconds": [], "cache": cache_figures(llm)}
    for batch in requests["batches"]:
        t0 = time.perf_counter()
        res = llm.generate(engine_inputs(llm, batch), params, use_tqdm=False)
        out["seconds"].append(time.perf_counter() - t0)
        out["batches"].append(
            [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "text": o.outputs[0].text,
                    "prompt_token_ids": list(o.prompt_token_ids),
                }
                for o in res
            ]
        )
    return out


def main(argv: list[str] | None = None) -> None:
    final_dir, req, dst, *rest = argv if argv is not None else sys.argv[1:]
    engine = json.loads(rest[0]) if rest else {}
    result = run(final_dir, json.loads(Path(req).read_text()), **engine)
    Path(dst).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
