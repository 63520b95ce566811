"""Tables from `vlm bench` JSON (eval/bench/results/, as the bench writes it)
and from launches.json."""

from __future__ import annotations

from typing import Any

from eval.publish.markdown import num, span, table

MODEL, DECODE, REALIZED = (
    "eval/bench/results/model.json",
    "eval/bench/results/decode.json",
    "eval/bench/results/realized.json",
)
LAUNCHES = "docs/results/data/launches.json"
CANDIDATES = {
    "more_experts": "more experts",
    "loop_more_experts": "loop + more experts",
    "wider_concept": "wider concept model",
}
LENGTHS = {1024: "1K", 2048: "2K", 4096: "4K", 8192: "8K", 16384: "16K"}
# the goals' headline cells
BOLD = {("prefill", "more_experts", 16384), ("train", "more_experts", 4096)}


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def _rows(res: dict[str, Any], **setting: Any) -> list[dict[str, Any]]:
    return [r for r in res["rows"] if all(r["setting"].get(k) == v for k, v in setting.items())]


def model_ratio(res: dict[str, Any], mode: str, cand: str, seq_len: int) -> float:
    (row,) = [r for r in _rows(res, mode=mode, seq_len=seq_len) if r["candidate"] == cand]
    return row["ratio_vs_baseline"]


def best(res: dict[str, Any], mode: str, seq_len: int) -> tuple[str, float]:
    """The fastest reallocation at one length: (candidate, ratio)."""
    return max(((c, model_ratio(res, mode, c, seq_len)) for c in CANDIDATES), key=lambda cr: cr[1])


def attention_limit(res: dict[str, Any], cand: str = "more_experts") -> float:
    """The attention-bound prefill time ratio of the split, as the docs state it
    (two decimals: 0.44)."""
    row = [r for r in res["rows"] if r["candidate"] == cand][0]
    return round(row["attn_bound_time_ratio"], 2)


def above_limit_pct(res: dict[str, Any], seq_len: int = 16384) -> int:
    """How far (%) the best prefill time ratio at seq_len sits above the attention-bound limit."""
    _, r = best(res, "prefill", seq_len)
    return round((1 / r / attention_limit(res) - 1) * 100)


def kv_ratio(decode: dict[str, Any], cand: str) -> float:
    return [r for r in decode["rows"] if r["candidate"] == cand][0]["kv_ratio"]


def model_table(src: dict[str, Any]) -> str:
    """tokens/s vs the MoE baseline, 1K-16K: prefill and training (model.json), decode at batch
    1 / 8."""
    model, decode = src[MODEL], src[DECODE]
    lengths = model["settings"]["seq_lens"]
    rows = []
    for mode, label in (("prefill", "prefill"), ("train", "training step")):
        for cand, name in CANDIDATES.items():
            cells = []
            for n in lengths:
                c = ratio(model_ratio(model, mode, cand, n))
                cells.append(f"**{c}**" if (mode, cand, n) in BOLD else c)
            rows.append([f"{label}, {name}", *cells])
    batches = decode["settings"]["batches"]
    for cand, name in CANDIDATES.items():
        cells = []
        for n in lengths:
            got = [r for r in _rows(decode, context=n) if r["candidate"] == cand]
            by_batch = {r["setting"]["batch"]: r["ratio_vs_baseline"] for r in got}
            cells.append(" / ".join(ratio(by_batch[b]) for b in batches) if got else "")
        rows.append([f"decode, batch {' / '.join(map(str, batches))}, {name}", *cells])
    return table(["tokens/s vs the MoE baseline", *(LENGTHS[n] for n in lengths)], rows)


def realized_table(src: dict[str, Any]) -> str:
    """Prefill with learned and forced boundaries on real prompts, more experts (realized.json)."""
    res = src[REALIZED]
    lengths = res["settings"]["seq_lens"]
    rows = []
    for kind, kind_label in (("vqa prompt", "VQA prompts"), ("caption", "captions")):
        for how, how_label in (("learned", "learned boundaries"), ("forced R=2", "forced at T/R")):
            got = [r for r in _rows(res, kind=kind) if r["candidate"] == f"more_experts ({how})"]
            by_len = {r["setting"]["seq_len"]: r for r in got}
            cells = [ratio(by_len[n]["ratio_vs_baseline"]) for n in lengths]
            rows.append(
                [f"{kind_label}, {how_label}", *cells, span((r["realized_R"] for r in got), 2)]
            )
    return table(
        [
            "prefill tokens/s vs the MoE baseline, more experts",
            *(LENGTHS[n] for n in lengths),
            "realized R",
        ],
        rows,
    )


LAUNCH_LABELS = {
    ("baseline", "auto"): "MoE baseline, CPU attention (one SDPA per document)",
    ("more_experts", "auto"): "more experts, CPU attention",
    ("baseline", "sdpa"): "MoE baseline, packed-mask SDPA (the compiled and GPU layout)",
    ("more_experts", "sdpa"): "more experts, packed-mask SDPA",
}


def launches(src: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["candidate"], r["setting"]["attention"]): r for r in src[LAUNCHES]["rows"]}


def launches_table(src: dict[str, Any]) -> str:
    rows = [
        [
            LAUNCH_LABELS[key],
            str(r["before_71c293f"]),
            str(r["operators_per_step"]),
            f"{num(r['before_71c293f'] / r['operators_per_step'], 2)}x fewer",
        ]
        for key, r in launches(src).items()
    ]
    return table(["operators per training step", "71c293f", "now", ""], rows)


def launches_prose(src: dict[str, Any]) -> str:
    """The README's sentence: now against before, baseline and more experts, CPU attention."""
    got = launches(src)
    b, m = got["baseline", "auto"], got["more_experts", "auto"]
    return (
        f"{b['operators_per_step']} against {b['before_71c293f']} for the MoE baseline, "
        f"{m['operators_per_step']} against {m['before_71c293f']} for more experts"
    )


SERVE = "vlm/serve/results/serve_bench.json"
SERVE_MODELS = {"conceptmoe": "ConceptMoE", "baseline": "MoE baseline"}
SERVE_ENGINES = {"vllm": "vLLM", "vlm chat": "`vlm chat`"}


def serve_table(src: dict[str, Any]) -> str:
    """`python -m vlm.serve.bench`: tokens/s and time to first token, through vLLM and `vlm chat`,
    for the ConceptMoE and its MoE baseline, at batch 1 and 8."""
    res = src[SERVE]
    rows = [
        [
            SERVE_MODELS[m],
            SERVE_ENGINES[e],
            num(r["b1_tok_s"], 1),
            num(r["b8_tok_s"], 1),
            num(1000 * r["b1_ttft_s"], 0),
            num(1000 * r["b8_ttft_s"], 0),
        ]
        for m in SERVE_MODELS
        for e in SERVE_ENGINES
        for r in [res[m][e]]
    ]
    return table(["model", "engine", "tok/s b1", "tok/s b8", "TTFT b1 (ms)", "TTFT b8 (ms)"], rows)


LOADER, LOADER_BEFORE = "eval/bench/results/loader.json", "docs/results/data/loader_before.json"
LOADER_METRICS = (
    ("tokens per CPU-second", 0),
    ("images per CPU-second", 0),
    ("cores per GPU", 2),
)


def _loader_cells(res: dict[str, Any], metric: str, workers: str, decimals: int) -> str:
    (r,) = [r for r in res["rows"] if r["metric"] == metric and r["candidate"] == workers]
    fmt = (lambda x: f"{x:,.0f}") if decimals == 0 else (lambda x: num(x, decimals))
    return f"{fmt(r['median'])} ({fmt(r['spread']['min'])}-{fmt(r['spread']['max'])})"


def loader_table(src: dict[str, Any]) -> str:
    """`vlm bench loader` (configs/gpu.yaml, the generated LLaVA-style mix) before and after
    issue 44, per DataLoader worker count: median (min-max) over interleaved rounds."""
    now, before = src[LOADER], src[LOADER_BEFORE]
    workers = [w for w in (f"workers={n}" for n in now["settings"]["workers"])]
    target = now["settings"]["tokens_per_s"]
    header = ["DataLoader workers"]
    for metric, _ in LOADER_METRICS:
        what = (
            f"cores per GPU at {target / 1000:.0f}K tokens/s"
            if metric == "cores per GPU"
            else metric
        )
        header += [f"{what}, before", "now"]
    rows = []
    for w in workers:
        cells = [w.split("=")[1]]
        for metric, d in LOADER_METRICS:
            cells += [_loader_cells(before, metric, w, d), _loader_cells(now, metric, w, d)]
        rows.append(cells)
    return table(header, rows)


def serve_cache_table(src: dict[str, Any]) -> str:
    """`python -m vlm.serve.bench`: what vLLM allocated for each model in the same cache memory,
    and how many requests of max-model-len tokens it admits at once (its maximum concurrency)."""
    res = src[SERVE]
    rows = []
    for m, label in SERVE_MODELS.items():
        v = res[m]["vllm"]
        state = (
            f"{v['state_layers']} x {v['state_entries']} ({v['concept_capacity']} per pass)"
            if "state_layers" in v
            else "none"
        )
        base = res["baseline"]["vllm"]["max_concurrency"]
        rows.append(
            [
                label,
                str(v["block_size"]),
                state,
                f"{v['kv_cache_tokens']:,}",
                f"{num(v['max_concurrency'], 1)} ({num(v['max_concurrency'] / base, 2)}x)",
            ]
        )
    L = res["conceptmoe"]["vllm"]["max_model_len"]
    return table(
        [
            "model",
            "token block",
            "concept state: layers x concepts",
            "KV cache (tokens)",
            f"admitted {L}-token requests",
        ],
        rows,
    )
