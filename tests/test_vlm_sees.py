"""The VLM answers from the image: a tiny model trained here (through the real trainer) on a
question whose answer only the picture holds gives different answers for pictures that differ only
in that attribute, and other answers again when the picture is blanked."""

from __future__ import annotations

import io

import pytest
from PIL import Image

COLOURS = {
    "red": (220, 40, 40),
    "green": (30, 160, 60),
    "blue": (40, 80, 225),
    "yellow": (240, 205, 20),
}
QUESTION = "What colour is the square?"


def _picture(fill, seed: int) -> bytes:
    """A square of one colour somewhere on a light background; only the colour is asked about."""
    import random

    rng = random.Random(seed)
    img = Image.new("RGB", (56, 56), (235, 235, 235))
    x, y = rng.randint(2, 26), rng.randint(2, 26)
    if fill is not None:
        img.paste(fill, (x, y, x + 26, y + 26))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def colour_vlm(tmp_path_factory, tiny_data, tiny_config, make_trainer):
    """(exported final/ directory) of a tiny VLM trained on 'What colour is the square?' questions."""
    import torch

    from data_pipelines.schema import Sample
    from data_pipelines.writer import ShardWriter

    root = tmp_path_factory.mktemp("colour_vlm")
    for split, n in (("train", 400), ("val", 16)):
        with ShardWriter(root / split, "vqa", max_count=1000) as w:
            for i in range(n):
                name = list(COLOURS)[i % len(COLOURS)]
                turns = [
                    {"role": "user", "content": "<image>\n" + QUESTION},
                    {"role": "assistant", "content": name},
                ]
                w.write(
                    Sample(
                        key=f"{split}{i:05d}",
                        kind="pair",
                        turns=turns,
                        images=[_picture(COLOURS[name], i)],
                        image_exts=["png"],
                    )
                )
    src = lambda split: [{"path": str(root / split / "vqa-*.tar"), "name": split}]  # noqa: E731
    cfg = tiny_config(
        tiny_data,
        train={"stage": "vl", "max_steps": 250, "seed": 0, "vqa_eval": False, "threads": 1},
        data={"sources": src("train")},
        logging={"eval_every": 0, "eval_sources": src("val")},
        checkpoint={"save_every": 0},
    )
    cfg["data"]["loss_on"] = "assistant"
    cfg["vision"]["freeze_encoder"] = False
    threads = torch.get_num_threads()
    try:
        assert make_trainer(cfg, root / "run").train() == 0
    finally:
        torch.set_num_threads(threads)
    return root / "run" / "final"


def test_answers_follow_the_asked_about_attribute_and_blanking_changes_them(colour_vlm):
    from data_pipelines.chat import vqa_prompt
    from vlm.generate import load_eval_model

    chat = load_eval_model(colour_vlm, device="cpu")
    seeds = range(1000, 1008)  # square positions never seen in training
    prompts = [vqa_prompt(QUESTION)] * len(seeds)

    def answers(fill):
        pics = [[Image.open(io.BytesIO(_picture(fill, s)))] for s in seeds]
        return [a.strip() for a in chat.generate(prompts, pics, max_new_tokens=8, stop=["<|end|>"])]

    red, blue = answers(COLOURS["red"]), answers(COLOURS["blue"])
    blank = answers(None)
    # same question, same layout: the colour decides
    assert sum(a != b for a, b in zip(red, blue)) >= 6, (red, blue)
    assert sum(a == "red" for a in red) >= 6 and sum(a == "blue" for a in blue) >= 6, (red, blue)
    # no square to read: not the red answers
    assert sum(a != r for a, r in zip(blank, red)) >= 6, (blank, red)
    assert sum(a != b for a, b in zip(blank, blue)) >= 6, (blank, blue)


TASK_YAML = """
task: colour_square
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function colour_utils.doc_to_visual
doc_to_text: !function colour_utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_new_tokens: 8
  temperature: 0
  do_sample: false
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true, ignore_punctuation: true}}
metadata:
  version: 0.1
"""

TASK_UTILS = """
import base64, io
from PIL import Image

def doc_to_visual(doc):
    return [Image.open(io.BytesIO(base64.b64decode(doc["image"]))).convert("RGB")]

def doc_to_text(doc):
    # the raw context most lmms-eval VQA tasks hand over: a placeholder, a newline, the question
    return "<image>\\n" + doc["question"]
"""


@pytest.mark.slow
def test_a_standard_lmms_eval_vqa_task_is_answered_in_the_trained_format(
    colour_vlm, tmp_path, subprocess_env
):
    """`lmms-eval eval` on a task in lmms-eval's own YAML format whose context is raw
    `<image>\\n<question>`: the adapter puts it into the chat template, so the answers are colours
    and beat the majority answer."""
    import base64
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("lmms_eval.api.model")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    names = list(COLOURS)
    docs = [
        {
            "question": QUESTION,
            "answer": names[i % 4],
            "image": base64.b64encode(_picture(COLOURS[names[i % 4]], 2000 + i)).decode(),
        }
        for i in range(16)
    ]
    (tasks / "colour.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "colour_square.yaml").write_text(TASK_YAML.format(data=tasks / "colour.jsonl"))
    (tasks / "colour_utils.py").write_text(TASK_UTILS)
    repo = Path(__file__).resolve().parents[1]
    env = dict(
        subprocess_env(),
        PYTHONPATH=os.pathsep.join([str(tasks), str(repo)]),
        # without the fixture trainer's rendezvous settings
        HF_HOME=str(tmp_path / "hf"),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )
    cmd = [
        sys.executable,
        "-c",
        "import sys; from lmms_eval.cli.dispatch import main; sys.exit(main())",
        "eval",
        "--model",
        "conceptmoe",
        "--model_args",
        f"pretrained={colour_vlm}",
        "--batch_size",
        "8",
        "--tasks",
        "colour_square",
        "--include_path",
        str(tasks),
        "--output_path",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    found = list((tmp_path / "out").rglob("*_results.json"))  # lmms-eval exits 0 even on errors
    assert proc.returncode == 0 and found, log
    score = json.loads(found[0].read_text())["results"]["colour_square"]["exact_match,none"]
    # majority answer: 0.25 (4 balanced colours)
    assert score >= 0.5, log
