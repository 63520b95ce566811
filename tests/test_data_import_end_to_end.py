"""A user's own data, end to end, as docs/data.md tells it (issue 26, item 4): a LLaVA-format JSON
array and an img2dataset shard set with generated images are imported / read as they are, a tiny
model is fine-tuned from a `final/` for a few steps on them with a config that states only what
differs, and evaluated."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random

import pytest
import yaml

from data_pipelines.import_bench import write_img2dataset


def _main(args: list[str]) -> tuple[int, str, str]:
    from vlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


def _llava(root, png) -> int:
    """A LLaVA instruction file (one JSON array) over an image folder: single-image chats, a
    two-image row, text-only ShareGPT rows."""
    rng = random.Random(0)
    colours = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}
    (root / "images" / "coco").mkdir(parents=True)
    rows = []
    for i in range(16):
        name = rng.choice(sorted(colours))
        (root / "images" / "coco" / f"{i:03d}.jpg").write_bytes(
            png(28 + i, 32, colours[name], fmt="JPEG")
        )
        rows.append(
            {
                "id": f"{i:06d}",
                "image": f"coco/{i:03d}.jpg",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat colour is the picture?"},
                    {"from": "gpt", "value": f"The picture is {name}."},
                ],
            }
        )
    rows.append(
        {
            "id": "two",
            "image": ["coco/000.jpg", "coco/001.jpg"],
            "conversations": [
                {"from": "human", "value": "<image> and <image>: which is wider?"},
                {"from": "gpt", "value": "The second."},
            ],
        }
    )
    rows += [
        {
            "id": f"text{i}",
            "conversations": [
                {"from": "human", "value": f"What is {i} plus {i}?"},
                {"from": "gpt", "value": f"It is {2 * i}."},
            ],
        }
        for i in range(6)
    ]
    (root / "llava_mix.json").write_text(json.dumps(rows, indent=1))
    return len(rows)


@pytest.mark.slow
def test_import_finetune_from_final_and_evaluate(
    tmp_path, png, tiny_data, TINY, torch_globals, subprocess_env
):
    # 1. the data as a user holds it
    n_rows = _llava(tmp_path, png)
    cc = tmp_path / "cc3m"
    captions = write_img2dataset(
        cc, [png(24 + j, 24, (j * 20, 90, 160), fmt="JPEG") for j in range(12)], shards=2
    )
    rc, out, err = _main(
        [
            "data",
            "import-table",
            str(tmp_path / "llava_mix.json"),
            "--image-root",
            str(tmp_path / "images"),
            "--out",
            str(tmp_path / "data" / "llava"),
            "--json",
            "--quiet",
        ]
    )
    summary = json.loads(out)
    assert rc == 0 and summary["written"] == n_rows and summary["skipped"] == {}, out + err
    rc, out, err = _main(["data", "stats", str(tmp_path / "data" / "llava"), str(cc), "--json"])
    stats = json.loads(out)
    assert rc == 0 and stats["totals"]["count"] == n_rows + len(captions) and stats["bad"] == {}

    # 2. the model being trained: a tiny run's final/ (the byte tokenizer goes with it)
    base = copy.deepcopy(TINY)
    base["data"].update(sources=[], default_dir=str(tiny_data))
    base["logging"].update(eval_every=0, histogram_every=0, eval_sources=[])
    base["checkpoint"].update(save_every=100)
    base["train"].update(max_steps=2)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    rc, out, err = _main(
        [
            "train",
            "--config",
            str(tmp_path / "cfg" / "base.yaml"),
            "--out",
            str(tmp_path / "runs/base"),
        ]
    )
    assert rc == 0, out[-2000:] + err[-2000:]
    final = tmp_path / "runs" / "base" / "final"
    assert (final / "config.json").is_file()

    # 3. a config that states only what differs, as docs/data.md shows it
    mine = {
        "base": "base.yaml",
        "data": {
            "sources": [
                {"path": str(tmp_path / "data" / "llava"), "weight": 3, "name": "llava"},
                {"path": str(cc), "weight": 1, "name": "cc3m"},
            ],
            "tokenizer": str(final),
        },
        "train": {"init_from": str(final), "max_steps": 3},
    }
    (tmp_path / "cfg" / "mine.yaml").write_text(yaml.safe_dump(mine, sort_keys=False))
    rc, out, err = _main(
        [
            "train",
            "--config",
            str(tmp_path / "cfg" / "mine.yaml"),
            "--out",
            str(tmp_path / "runs/mine"),
        ]
    )
    assert rc == 0, out[-2000:] + err[-2000:]
    summary = json.loads((tmp_path / "runs" / "mine" / "summary.json").read_text())
    assert summary["steps"] == 3
    lines = [
        json.loads(x)
        for x in (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in lines if "loss" in r]
    assert train and not any(
        k.startswith("skipped/") and v
        for r in lines
        for k, v in r.items()
        if isinstance(v, (int, float))
    ), lines[-1]

    # 4. evaluate the fine-tuned model on the imported data, and export the captions as an
    #    lmms-eval task
    rc, out, err = _main(
        [
            "eval",
            "ppl",
            "--ckpt",
            str(tmp_path / "runs/mine/final"),
            "--data",
            str(tmp_path / "data" / "llava"),
            str(cc),
            "--max-batches",
            "2",
            "--row-tokens",
            "128",
            "--out",
            str(tmp_path / "ppl.json"),
        ]
    )
    assert rc == 0, out[-2000:] + err[-2000:]
    res = json.loads((tmp_path / "ppl.json").read_text())
    assert (
        res["batches"] == 2 and math.isfinite(res["loss/lm"]) and res["loss/image_text"] is not None
    )
    rc, out, err = _main(
        ["eval", "lmms-tasks", "--caption-shards", str(cc), "--out", str(tmp_path / "tasks")]
    )
    assert rc == 0, err[-2000:]
    records = (tmp_path / "tasks" / "caption_test.jsonl").read_text().splitlines()
    assert len(records) == len(captions)

    # 5. ... and score the fine-tuned model on that task with lmms-eval itself, as the README's
    #    recipe runs it
    pytest.importorskip("lmms_eval.api.model")
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(
        subprocess_env(),
        PYTHONPATH=str(repo),
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
        f"pretrained={tmp_path / 'runs/mine/final'}",
        "--tasks",
        "conceptmoe_caption",
        "--include_path",
        str(tmp_path / "tasks"),
        "--batch_size",
        "4",
        "--output_path",
        str(tmp_path / "lmms"),
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    # lmms-eval exits 0 even on errors
    found = list((tmp_path / "lmms").rglob("*_results.json"))
    assert proc.returncode == 0 and found, log
    scored = json.loads(found[0].read_text())["results"]["conceptmoe_caption"]
    assert "exact_match,none" in scored and "cider,none" in scored, scored
