"""Export a split of the default dataset (or any VQA/caption shards) for lmms-eval's
local JSON tasks.

    vlm eval lmms-tasks --data DATA_DIR [--split test] --out TASK_DIR [--limit N]

writes TASK_DIR/{vqa_test.jsonl, caption_test.jsonl} and the task YAMLs of `eval/tasks/` with their
`__DATA_DIR__` replaced by the absolute TASK_DIR (lmms-eval resolves relative `data_files` against
the working directory, so the YAMLs must name absolute paths). Then:

    lmms-eval eval --model conceptmoe --model_args pretrained=RUN/final \
        --tasks conceptmoe_vqa,conceptmoe_vqa_mc,conceptmoe_caption --include_path TASK_DIR --output_path OUT

Records are JSON Lines with images as base64 PNG/JPEG bytes (exactly the shard's bytes).
"""

from __future__ import annotations

import argparse
import base64
import json
from collections import defaultdict
from pathlib import Path

from data_pipelines.chat import iter_vqa_samples
from data_pipelines.samples import iter_samples
from data_pipelines.schema import IMAGE_TOKEN

TEMPLATE_DIR = Path(__file__).with_name("tasks")
TEMPLATES = {
    "vqa": ["conceptmoe_vqa.yaml", "conceptmoe_vqa_mc.yaml"],
    "caption": ["conceptmoe_caption.yaml"],
}
DATA_TOKEN = "__DATA_DIR__"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def vqa_records(shards, limit: int | None = None) -> list[dict]:
    """One record per question; `choices` = the split's distinct answers of the item's question type."""

    recs = []
    for i, s in enumerate(iter_vqa_samples(shards, limit=limit)):
        recs.append(
            {
                "id": f"{s.key}/{i}",
                "question": s.question,
                "answer": s.answer,
                "question_type": s.question_type,
                "heldout": bool(s.heldout),
                "images": [_b64(b) for b in (s.images or [s.image])],
            }
        )
    answers: dict[str, set[str]] = defaultdict(set)
    for r in recs:
        answers[r["question_type"]].add(r["answer"])
    for r in recs:
        r["choices"] = sorted(answers[r["question_type"]])
    return recs


def caption_records(shards, limit: int | None = None) -> list[dict]:
    """One record per image-caption pair (`pair` samples with one image); the caption has no placeholder."""

    recs: list[dict] = []
    for s in iter_samples(shards):
        if s.kind != "pair" or len(s.images) != 1 or s.turns is not None:
            continue
        caption = s.text.replace(IMAGE_TOKEN, "").strip()
        if caption:
            recs.append({"id": s.key, "caption": caption, "images": [_b64(s.images[0])]})
        if limit is not None and len(recs) >= limit:
            return recs
    return recs


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def instantiate_templates(out_dir: Path, kinds: list[str]) -> list[Path]:
    written = []
    for kind in kinds:
        for name in TEMPLATES[kind]:
            text = (TEMPLATE_DIR / name).read_text(encoding="utf-8")
            dst = out_dir / name
            dst.write_text(text.replace(DATA_TOKEN, str(out_dir.resolve())), encoding="utf-8")
            written.append(dst)
    return written


def export_tasks(
    out: str | Path,
    *,
    data: str | Path | None = None,
    split: str = "test",
    vqa_shards=None,
    caption_shards=None,
    limit: int | None = None,
) -> dict:
    """Write the JSONL files and instantiated YAMLs; returns {"vqa": n, "caption": n, "yamls": [...]}."""
    out = Path(out)
    if data is not None:
        root = Path(data) / split
        if not root.is_dir():
            raise FileNotFoundError(
                f"{root} does not exist: expected a dataset from "
                f"`vlm data build-default` with a {split!r} split"
            )
        vqa_shards = vqa_shards or str(root / "vqa-*.tar")
        caption_shards = caption_shards or str(root / "caption-*.tar")
    if vqa_shards is None and caption_shards is None:
        raise ValueError("give --data DIR or --vqa-shards / --caption-shards")
    report: dict = {"yamls": []}
    kinds = []
    if vqa_shards is not None:
        recs = vqa_records(vqa_shards, limit)
        write_jsonl(recs, out / "vqa_test.jsonl")
        report["vqa"] = len(recs)
        kinds.append("vqa")
    if caption_shards is not None:
        recs = caption_records(caption_shards, limit)
        write_jsonl(recs, out / "caption_test.jsonl")
        report["caption"] = len(recs)
        kinds.append("caption")
    report["yamls"] = [str(p) for p in instantiate_templates(out, kinds)]
    return report


def run(args: argparse.Namespace) -> int:
    """`vlm eval lmms-tasks` (its arguments are declared in eval/cli.py)."""
    from eval.preflight import check_out_dir, fail

    prog = "vlm eval lmms-tasks"
    if args.data is None and args.vqa_shards is None and args.caption_shards is None:
        fail(prog, "give --data DIR or --vqa-shards / --caption-shards")
    if args.data is not None and not (Path(args.data) / args.split).is_dir():
        fail(
            prog,
            f"--data {args.data}: no {args.split!r} split there "
            "(expected a dataset from `vlm data build-default`)",
        )
    check_out_dir(args.out, prog)  # before any shard is read
    report = export_tasks(
        args.out,
        data=args.data,
        split=args.split,
        vqa_shards=args.vqa_shards,
        caption_shards=args.caption_shards,
        limit=args.limit,
    )
    print(json.dumps(report, indent=2))
    return 0
