"""Caption probes: does the model read where a named object is, and can it compare where
two objects are?

Position questions ("Where is the red triangle relative to the yellow diamond?") need two steps:
find each named object's place, then compare the two. These probes score each step apart,
teacher-forced on the default dataset's caption samples (the first greedy words of the continuation
must match):

- cell: the caption up to an object's description ("A large red circle") -> its cell phrase ("at the
  top left").
- relation: the caption and its relation sentences up to "Relative to the blue square, the red
  circle is" -> the relation ("to the left"). The caption before it already names both objects'
  cells, so this step needs no image.

Each probe runs with the image and blind (the same text, no image): the captions list objects
in reading order, so part of the cell phrase is guessable from the text, and the blind score
says how much.

    vlm eval probe --ckpt RUN/final [--split val] [--limit 300]
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import re
from dataclasses import dataclass

from data_pipelines.samples import iter_samples
from data_pipelines.scenes import CELL_PHRASE
from data_pipelines.schema import IMAGE_TOKEN

RELATION = re.compile(
    r"Relative to the \w+ \w+, the \w+ \w+ is (to the left|to the right|above|below)\."
)


@dataclass
class ProbeItem:
    kind: str  # "cell" or "relation"
    prefix: str  # caption text the model continues (no image placeholder)
    answer: str
    image: bytes


def probe_items(samples, limit: int) -> list[ProbeItem]:
    """Up to `limit` items of each kind from caption samples of the default dataset (their meta has the scene)."""
    items: dict[str, list[ProbeItem]] = {"cell": [], "relation": []}
    for s in samples:
        scene = (s.meta or {}).get("scene")
        if not scene or len(s.images) != 1:
            continue
        text = s.text.replace(IMAGE_TOKEN, "")
        for o in sorted(scene["objects"], key=lambda o: (o["row"], o["col"])):
            desc = f"{o['size']} {o['colour']} {o['shape']}"
            at = text.lower().find(desc)
            if at >= 0 and len(items["cell"]) < limit:
                cell = CELL_PHRASE[(o["row"], o["col"])]
                items["cell"].append(ProbeItem("cell", text[: at + len(desc)], cell, s.images[0]))
        for m in RELATION.finditer(text):
            if len(items["relation"]) < limit:
                items["relation"].append(
                    ProbeItem("relation", text[: m.start(1)].rstrip(), m.group(1), s.images[0])
                )
        if all(len(v) >= limit for v in items.values()):
            break
    return items["cell"] + items["relation"]


def run_probes(model, items: list[ProbeItem], batch_size: int = 32) -> dict:
    """Accuracy (%) per probe, with the image and blind, plus each probe's most common answer's share."""
    from PIL import Image

    out: dict[str, dict] = {}
    for kind in ("cell", "relation"):
        group = [it for it in items if it.kind == kind]
        if not group:
            continue
        scores = {}
        for blind in (False, True):
            hits = []
            for i in range(0, len(group), batch_size):
                chunk = group[i : i + batch_size]
                prompts = [("" if blind else IMAGE_TOKEN) + it.prefix for it in chunk]
                images = None if blind else [[Image.open(io.BytesIO(it.image))] for it in chunk]
                conts = model.generate(prompts, images, max_new_tokens=4)
                hits += [c.strip().startswith(it.answer) for c, it in zip(conts, chunk)]
            scores["blind" if blind else "image"] = 100.0 * sum(hits) / len(hits)
        top = collections.Counter(it.answer for it in group).most_common(1)[0]
        out[kind] = {"n": len(group), **scores, "majority": 100.0 * top[1] / len(group)}
    return out


def format_probes(res: dict) -> str:
    lines = [f"{'probe':<10}{'n':>5}{'image':>8}{'blind':>8}{'majority':>10}"]
    for kind, r in res.items():
        lines.append(
            f"{kind:<10}{r['n']:>5}{r['image']:>8.1f}{r['blind']:>8.1f}{r['majority']:>10.1f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`vlm eval probe` (its arguments are declared in eval/cli.py)."""
    from eval.preflight import check_model_dir, check_out_file, default_data, load_model

    prog = "vlm eval probe"
    check_model_dir(args.ckpt, prog)  # before the dataset is built and the items read
    out = check_out_file(args.out, prog)
    ready = default_data(args.data, prog, args.build)
    model = load_model(args.ckpt, prog)
    data = ready()
    items = probe_items(iter_samples([str(data / args.split / "caption-*.tar")]), args.limit)
    if not items:
        raise SystemExit(f"no caption samples with scenes in {data / args.split}")
    res = run_probes(model, items)
    print(format_probes(res))
    if out is not None:
        out.write_text(json.dumps(res, indent=2))
    return 0
