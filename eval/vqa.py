"""Built-in VQA eval: exact-match accuracy per question type on the default
dataset's held-out split.

Two baselines put the accuracy in context: the majority answer per question type (taken from the
train split when it is there, else from the evaluated split itself) and the same model asked blind
(the question without its image). Per-modality compression ratios of the evaluated samples are
reported too.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from tqdm import tqdm

from data_pipelines.chat import iter_vqa_samples, normalize_answer, strip_answer, vqa_prompt
from data_pipelines.default_dataset import default_info
from eval.preflight import (
    check_model_dir,
    check_out_file,
    default_data,
    fail,
    load_model,
    shard_folder,
)
from vlm.generate import load_eval_model
from vlm.model.doc_stats import format_distribution, summarize_documents


def majority_answers(samples) -> dict[str, str]:
    by_type: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for s in samples:
        by_type[s.question_type][normalize_answer(s.answer)] += 1
    return {t: c.most_common(1)[0][0] for t, c in by_type.items()}


def _accuracy(hits: dict[str, list[bool]]) -> dict[str, float]:
    out = {t: 100.0 * sum(v) / len(v) for t, v in sorted(hits.items())}
    allv = [x for v in hits.values() for x in v]
    out["all"] = 100.0 * sum(allv) / max(len(allv), 1)
    return out


def run_vqa_eval(
    model,
    shards,
    train_shards=None,
    limit: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 8,
    blind: bool = True,
    progress: bool = True,
    compression_shards: list[str] | None = None,
) -> dict:
    """`model` is an eval.protocol.EvalModel; `shards` the split to score (paths or globs).

    `compression_shards`: whole samples of the held-out split on which to measure the realized
    compression per document, kind and modality in eval mode (a ConceptMoEChat's
    `held_out_compression`). The prompts' own prefill compression (one document per prompt) is
    `prompt_compression`: what decides a user's speed."""
    import io

    from PIL import Image

    samples = list(iter_vqa_samples(shards, limit=limit))
    if not samples:
        raise ValueError(f"no VQA samples found in {shards}")
    majority = majority_answers(iter_vqa_samples(train_shards) if train_shards else samples)
    model.reset_stats()
    hits, blind_hits, major_hits = (collections.defaultdict(list) for _ in range(3))
    examples = []
    bar = tqdm(range(0, len(samples), batch_size), desc="vqa", disable=None if progress else True)
    for i in bar:
        chunk = samples[i : i + batch_size]
        imgs = [[Image.open(io.BytesIO(b)) for b in (s.images or [s.image])] for s in chunk]
        answers = model.generate(
            [s.prompt for s in chunk], imgs, max_new_tokens=max_new_tokens, stop=["<|end|>"]
        )
        for s, a in zip(chunk, answers):
            ok = normalize_answer(strip_answer(a)) == normalize_answer(s.answer)
            hits[s.question_type].append(ok)
            major_hits[s.question_type].append(
                majority.get(s.question_type) == normalize_answer(s.answer)
            )
            if len(examples) < 8:
                examples.append(
                    {"question": s.question, "answer": s.answer, "predicted": strip_answer(a)}
                )
    compression = model.compression_stats()
    prompt_docs = model.prompt_documents() if hasattr(model, "prompt_documents") else []
    if blind:
        for i in tqdm(
            range(0, len(samples), batch_size),
            desc="vqa (blind)",
            disable=None if progress else True,
        ):
            chunk = samples[i : i + batch_size]
            answers = model.generate(
                [vqa_prompt(s.question, 0) for s in chunk],
                None,
                max_new_tokens=max_new_tokens,
                stop=["<|end|>"],
            )
            for s, a in zip(chunk, answers):
                blind_hits[s.question_type].append(
                    normalize_answer(strip_answer(a)) == normalize_answer(s.answer)
                )
    held_out = None
    if compression_shards:
        held_out = model.held_out_compression(compression_shards)
    return {
        "n": len(samples),
        "accuracy": _accuracy(hits),
        "majority_baseline": _accuracy(major_hits),
        "blind_baseline": _accuracy(blind_hits) if blind else None,
        "compression": compression,
        "prompt_compression": summarize_documents(prompt_docs).get("chat") if prompt_docs else None,
        "held_out_compression": held_out,
        "majority_answers": majority,
        "examples": examples,
    }


def format_report(res: dict) -> str:
    types = [t for t in res["accuracy"] if t != "all"] + ["all"]
    lines = [
        f"VQA exact match on {res['n']} questions (%)",
        f"{'type':<12}{'model':>8}{'majority':>10}{'blind':>8}",
    ]
    for t in types:
        blind = res["blind_baseline"][t] if res.get("blind_baseline") else float("nan")
        lines.append(
            f"{t:<12}{res['accuracy'][t]:>8.1f}{res['majority_baseline'][t]:>10.1f}{blind:>8.1f}"
        )
    if res.get("prompt_compression"):
        lines.append("prefill compression of the VQA prompts, per prompt (tokens per concept):")
        lines += format_distribution({"vqa prompt": res["prompt_compression"]})
    if res.get("held_out_compression"):
        lines.append("compression of whole held-out samples, per document (eval mode):")
        lines += format_distribution(res["held_out_compression"])
    return "\n".join(lines)


def held_out_shards(data: Path, split: str = "test") -> list[str]:
    """Every kind of the default dataset, held out: the split's VQA and captions, and the val
    split's text and interleaved documents (the test split has none)."""
    data = Path(data)
    out = [str(data / split / "vqa-*.tar"), str(data / split / "caption-*.tar")]
    info = default_info(data) or {}
    for part in ("text", "interleaved"):
        if part in info.get("counts", {}).get("val", {}):
            out.append(str(data / "val" / f"{part}-*.tar"))
    return out


def end_of_run_vqa(final: Path, cfg, run_dir: Path, log) -> dict:
    """`vlm train`'s end-of-run check (registered under the `vlm.run_end` entry points): exact-match
    accuracy on the default dataset's held-out split against the majority answer and the blind
    model, written to RUN_DIR/vqa.json. Returns {"vqa": result or None} for the run's summary."""

    if not cfg.train.vqa_eval:
        return {"vqa": None}
    if cfg.data.sources:
        log(
            "VQA eval skipped: it runs on the embedded default "
            "dataset and this run uses its own sources"
        )
        return {"vqa": None}
    if cfg.vision is None:
        return {"vqa": None}  # a text-only model
    data = Path(cfg.data.default_dir)
    res = run_vqa_eval(
        load_eval_model(final),
        str(data / "test" / "vqa-*.tar"),
        train_shards=str(data / "train" / "vqa-*.tar"),
        limit=cfg.train.vqa_max_samples,
        progress=cfg.logging.progress,
        compression_shards=held_out_shards(data),
    )
    res["split"] = "test"
    (Path(run_dir) / "vqa.json").write_text(json.dumps(res, indent=2))
    log(format_report(res))
    return {"vqa": res}


def run(args: argparse.Namespace) -> int:
    """`vlm eval vqa` (its arguments are declared in eval/cli.py). The model folder and --out are
    checked, and the model loaded, before the dataset is built or a question asked: a mistake costs
    a second, not the eval."""
    prog = "vlm eval vqa"
    check_model_dir(args.ckpt, prog)
    out = check_out_file(args.out, prog)
    given = Path(args.data) if args.data is not None else None
    ready = None
    if given is not None and not default_info(given) and shard_folder(given):
        # imported shards: their meta.qa questions, the majority answers from them
        shards, train, held_out = str(given / "*.tar"), None, [str(given / "*.tar")]
        if next(iter(iter_vqa_samples(shards, limit=1)), None) is None:
            fail(
                prog,
                f"--data {given}: its shards hold no VQA questions (samples with meta.qa, as "
                "`vlm data import-table` writes from question/answer columns)",
            )
        print(f"{prog}: scoring the VQA questions of the shards in {given}", file=sys.stderr)
    else:
        # An existing default dataset (whatever its size settings) is used as it is
        ready = default_data(args.data, prog, args.build)
    model = load_model(args.ckpt, prog)
    if ready is not None:
        data = ready()  # built now, when missing: the model loaded
        shards = str(data / args.split / "vqa-*.tar")
        train, held_out = str(data / "train" / "vqa-*.tar"), held_out_shards(data, args.split)
    res = run_vqa_eval(
        model,
        shards,
        train_shards=train,
        limit=args.limit,
        batch_size=args.batch_size,
        blind=not args.no_blind,
        compression_shards=held_out,
    )
    print(format_report(res))
    if out is not None:
        out.write_text(json.dumps(res, indent=2))
    return 0
