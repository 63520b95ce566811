"""lmms-eval task functions for the default dataset's exported test split (see
`eval/export_tasks.py`).

The task YAMLs reference these as `!function eval.tasks.conceptmoe_utils.NAME` (lmms-eval falls
back to an absolute import when no file sits next to the YAML). Documents are JSON Lines
records with base64 PNG `images`, plus `question`/`answer`/`question_type`/`heldout`/`choices`
(VQA) or `caption`.
"""

from __future__ import annotations

import base64
import io
import math
import re
from collections import Counter

from data_pipelines.chat import normalize_answer
from data_pipelines.schema import IMAGE_TOKEN

QUESTION_TYPES = ("colour", "shape", "count", "position", "yesno")


def doc_to_visual(doc: dict) -> list:
    from PIL import Image

    return [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in doc["images"]]


def _prompted(doc: dict, kwargs: dict | None) -> str:
    kwargs = kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


# ---- VQA (generation, exact match per question type)
# --------------------------------------------------


def vqa_doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    return _prompted(doc, lmms_eval_specific_kwargs)


def vqa_process_results(doc: dict, results: list[str]) -> dict:
    pred = results[0] if results else ""
    score = float(normalize_answer(pred) == normalize_answer(str(doc["answer"])))
    out = {"exact_match": score, f"exact_match_{doc.get('question_type', 'unknown')}": score}
    if doc.get("heldout"):
        out["exact_match_heldout"] = score
    return out


# ---- VQA as multiple choice (log-likelihood)
# ----------------------------------------------------------


def mc_doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    return _prompted(doc, lmms_eval_specific_kwargs)


def mc_doc_to_choice(doc: dict) -> list[str]:
    return list(doc["choices"])


def mc_doc_to_target(doc: dict) -> int:
    return list(doc["choices"]).index(str(doc["answer"]))


# ---- captions (generation; exact match, BLEU-4, CIDEr-D)
# ----------------------------------------------


def caption_doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    # Captions are trained as plain image-text pairs ("<image>A small red ..."), not as chat
    # turns: giving the placeholder ourselves keeps the adapter from wrapping the prompt in the
    # chat template.
    kwargs = lmms_eval_specific_kwargs or {}
    return IMAGE_TOKEN * len(doc["images"]) + kwargs.get("prompt", "")


def caption_process_results(doc: dict, results: list[str]) -> dict:
    pred = (results[0] if results else "").strip()
    item = {"pred": pred, "refs": [doc["caption"]]}
    return {
        "exact_match": float(normalize_answer(pred) == normalize_answer(doc["caption"])),
        "bleu4": item,
        "cider": item,
    }


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def bleu4_aggregate(items: list[dict]) -> float:
    """Corpus BLEU-4 (sacrebleu, single reference per item), 0-100."""
    import sacrebleu

    preds = [" ".join(_words(it["pred"])) for it in items]
    refs = [[" ".join(_words(it["refs"][0])) for it in items]]
    return float(sacrebleu.corpus_bleu(preds, refs, tokenize="none").score)


def _ngrams(words: list[str], n: int) -> Counter:
    return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def cider_d(preds: list[str], refs: list[list[str]], sigma: float = 6.0, max_n: int = 4) -> float:
    """CIDEr-D (Vedantam et al. 2015): TF-IDF n-gram cosine with clipping and a length penalty, x10.

    IDF comes from the references of this corpus (document frequency over items).
    """
    n_docs = len(refs)
    ref_counts = [[[_ngrams(_words(r), n) for n in range(1, max_n + 1)] for r in rs] for rs in refs]
    df: Counter = Counter()
    for per_doc in ref_counts:
        df.update({g for per_ref in per_doc for grams in per_ref for g in grams})
    log_n = math.log(max(1.0, float(n_docs)))

    def vec(grams: Counter) -> tuple[dict, float]:
        v = {g: tf * (log_n - math.log(max(1.0, df[g]))) for g, tf in grams.items()}
        return v, math.sqrt(sum(x * x for x in v.values()))

    total = 0.0
    for pred, per_doc, rs in zip(preds, ref_counts, refs):
        pw = _words(pred)
        hyp = [vec(_ngrams(pw, n)) for n in range(1, max_n + 1)]
        score = 0.0
        for ref_grams, r in zip(per_doc, rs):
            delta = len(pw) - len(_words(r))
            for (hv, hn), rg in zip(hyp, ref_grams):
                rv, rn = vec(rg)
                if hn == 0 or rn == 0:
                    continue
                dot = sum(min(hv[g], rv[g]) * rv[g] for g in hv if g in rv)
                score += dot / (hn * rn) * math.exp(-(delta**2) / (2 * sigma**2))
        total += 10.0 * score / (max_n * len(rs))
    return total / max(1, n_docs)


def cider_aggregate(items: list[dict]) -> float:
    return cider_d([it["pred"] for it in items], [it["refs"] for it in items])
