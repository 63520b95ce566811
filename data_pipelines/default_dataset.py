"""The embedded default dataset: `vlm data build-default --out DIR`, and
`ensure_default_dataset(DIR)`.

Layout (each folder has its manifest.json; DIR/default.json records the generator settings):

    DIR/train/{vqa,caption,interleaved,text}-NNNNNN.tar
    DIR/val/{vqa,caption,text}-NNNNNN.tar      same distribution as train
    DIR/test/{vqa,caption}-NNNNNN.tar          every scene holds an unseen (colour, shape) combination
    DIR/tokenizer/                             a byte-level BPE trained on the train split's text
                                               (`data.tokenizer: default`)

A VQA sample is one scene with a few questions as a multi-turn chat (first turn
`<image>\\n<question>`, exactly the evaluation prompt) and `meta.qa` listing {question, answer,
type, heldout}. A caption sample is the same image with its caption. Interleaved documents show 2-3
scenes with captions and a comparison.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from configs.config import ValidatedOnInit, check, to_dict
from configs.folder_lock import LOCK_NAME, lock_folder
from data_pipelines.progress import Progress
from data_pipelines.scenes import caption, questions, relations, render_scene, sample_scene
from data_pipelines.schema import IMAGE_TOKEN, Sample
from data_pipelines.text_corpus import document
from data_pipelines.tokenizer import train_bpe
from data_pipelines.writer import ShardWriter

GENERATOR_VERSION = 5
INFO_FILE = "default.json"
# default mixture for training (weights are normalised by the loader)
DEFAULT_WEIGHTS = {"vqa": 0.5, "caption": 0.25, "interleaved": 0.1, "text": 0.15}
PARTS = tuple(DEFAULT_WEIGHTS)  # what data.default_parts may name
IMAGE_PARTS = ("vqa", "caption", "interleaved")  # the parts whose samples carry images
SPLIT_IDS = {"train": 0, "val": 1, "test": 2, "interleaved": 3, "text": 4}


@dataclass
class DefaultDatasetConfig(ValidatedOnInit):
    seed: int = 0
    train_scenes: int = 10000
    val_scenes: int = 300
    test_scenes: int = 200
    # train; val gets a tenth more (held out, for per-kind compression)
    interleaved_docs: int = 300
    text_docs: int = 2000  # train; val gets a tenth
    min_size: int = 64
    max_size: int = 112
    max_objects: int = 4
    questions_per_scene: int = 5  # one per question type the scene allows
    # caption samples add "Relative to the B, the A is to the left." per row/column pair
    relation_captions: bool = True
    shard_max_count: int = 2000
    tokenizer_vocab: int = 768  # upper bound; the corpus may need fewer merges

    def validate(self) -> None:
        check(
            8 <= self.min_size <= self.max_size,
            f"need 8 <= min_size <= max_size, got {self.min_size}, {self.max_size}",
        )
        check(
            1 <= self.max_objects <= 9,
            f"max_objects must be in 1..9 (a 3x3 grid), got {self.max_objects}",
        )
        check(
            1 <= self.questions_per_scene <= 5,
            f"questions_per_scene must be in 1..5, got {self.questions_per_scene}",
        )
        for name in ("train_scenes", "val_scenes", "test_scenes", "interleaved_docs", "text_docs"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0")
        check(self.shard_max_count >= 1, "shard_max_count must be >= 1")
        check(
            self.tokenizer_vocab >= 266,
            f"tokenizer_vocab must be >= 266 (specials + bytes), got {self.tokenizer_vocab}",
        )


def _rng(cfg: DefaultDatasetConfig, split: str, index: int) -> random.Random:
    return random.Random(f"{cfg.seed}:{SPLIT_IDS[split]}:{index}")


def _scene(cfg: DefaultDatasetConfig, split: str, index: int, heldout: bool):
    rng = _rng(cfg, split, index)
    scene = sample_scene(rng, cfg.min_size, cfg.max_size, cfg.max_objects, heldout)
    return rng, scene, render_scene(scene)


def _vqa_and_caption(cfg: DefaultDatasetConfig, split: str, index: int) -> tuple[Sample, Sample]:
    heldout = split == "test"
    rng, scene, png = _scene(cfg, split, index, heldout)
    qa = questions(rng, scene, cfg.questions_per_scene, heldout)
    turns = []
    for j, q in enumerate(qa):
        turns.append(
            {"role": "user", "content": (IMAGE_TOKEN + "\n" if j == 0 else "") + q["question"]}
        )
        turns.append({"role": "assistant", "content": q["answer"]})
    meta = {"qa": qa, "scene": scene.to_meta(), "split": split}
    key = f"{split}{index:06d}"
    vqa = Sample(key=key, kind="pair", turns=turns, images=[png], image_exts=["png"], meta=meta)
    text = caption(scene) + (" " + relations(rng, scene) if cfg.relation_captions else "")
    cap = Sample(
        key=key,
        kind="pair",
        text=IMAGE_TOKEN + text.rstrip(),
        images=[png],
        image_exts=["png"],
        meta={"scene": scene.to_meta(), "split": split},
    )
    return vqa, cap


def _interleaved(cfg: DefaultDatasetConfig, index: int) -> Sample:
    rng = _rng(cfg, "interleaved", index)
    n = rng.randint(2, 3)
    parts, images, counts = [], [], []
    for j in range(n):
        scene = sample_scene(rng, cfg.min_size, cfg.max_size, cfg.max_objects, heldout=False)
        images.append(render_scene(scene))
        counts.append(len(scene.objects))
        parts.append(f"Picture {j + 1}: {IMAGE_TOKEN}{caption(scene)}")
    most = max(range(n), key=lambda j: (counts[j], -j))
    if counts.count(counts[most]) > 1:
        summary = f"Several pictures have {counts[most]} objects."
    else:
        summary = f"Picture {most + 1} has the most objects."
    return Sample(
        key=f"doc{index:06d}",
        kind="interleaved",
        text=" ".join(parts) + " " + summary,
        images=images,
        image_exts=["png"] * n,
    )


def _text(cfg: DefaultDatasetConfig, split: str, index: int) -> Sample:
    rng = random.Random(f"{cfg.seed}:{SPLIT_IDS['text']}:{split}:{index}")
    return Sample(key=f"text{index:06d}", kind="text", text=document(rng))


# where a build writes before its parts are moved into place (inside OUT, under OUT's lock: one
# that a killed build left is removed by the next)
BUILD_TMP = ".build-tmp"
BUILD_PARTS = ("train", "val", "test", "tokenizer")


def _check_replaceable(out: Path) -> None:
    leftovers = (BUILD_TMP, LOCK_NAME)
    if out.exists() and (
        not out.is_dir()
        or (any(p.name not in leftovers for p in out.iterdir()) and not (out / INFO_FILE).exists())
    ):
        raise FileExistsError(
            f"{out} exists and is not a default-dataset folder (no {INFO_FILE}); "
            "refusing to replace it: choose an empty or new folder"
        )


def build_default(
    out: str | os.PathLike,
    cfg: DefaultDatasetConfig | None = None,
    progress: bool = True,
    wait: bool = False,
) -> Path:
    """Write the default dataset into `out` (replaced if present) and return it. One build at a
    time per folder (OUT's lock: configs.folder_lock): another process's build in progress is
    `FolderBusy`, or with `wait` waited for."""
    cfg = cfg or DefaultDatasetConfig()
    cfg.validate()
    out = Path(out)
    _check_replaceable(out)
    made = not out.exists()
    with lock_folder(out, "vlm data build-default", wait=wait):
        try:
            return _build(out, cfg, progress)
        except BaseException:
            if made:
                shutil.rmtree(out, ignore_errors=True)
            raise


def _build(out: Path, cfg: DefaultDatasetConfig, progress: bool) -> Path:
    t0 = time.time()
    tmp = out / BUILD_TMP
    shutil.rmtree(tmp, ignore_errors=True)  # a build killed part way (kill -9) left it
    tmp.mkdir()
    try:
        counts: dict[str, dict[str, int]] = {}
        plan = [("train", cfg.train_scenes), ("val", cfg.val_scenes), ("test", cfg.test_scenes)]
        total = (
            sum(n for _, n in plan)
            + cfg.interleaved_docs * 11 // 10
            + cfg.text_docs
            + cfg.text_docs // 10
        )
        # plain lines in redirected logs
        bar = Progress(total, "default dataset", progress, unit="sample")
        train_texts: list[str] = []
        for split, n in plan:
            w_vqa = ShardWriter(tmp / split, "vqa", max_count=cfg.shard_max_count)
            w_cap = ShardWriter(tmp / split, "caption", max_count=cfg.shard_max_count)
            for i in range(n):
                vqa, cap = _vqa_and_caption(cfg, split, i)
                if split == "train":
                    train_texts += [vqa.all_text(), cap.all_text()]
                w_vqa.write(vqa)
                w_cap.write(cap)
                bar.update()
            w_vqa.close(), w_cap.close()
            counts[split] = {"vqa": n, "caption": n}
        # val's documents continue the train documents' index: the train split is what it was before
        n_val = cfg.interleaved_docs // 10
        for split, first, n in (
            ("train", 0, cfg.interleaved_docs),
            ("val", cfg.interleaved_docs, n_val),
        ):
            with ShardWriter(tmp / split, "interleaved", max_count=cfg.shard_max_count) as w:
                for i in range(first, first + n):
                    doc = _interleaved(cfg, i)
                    if split == "train":
                        train_texts.append(doc.all_text())
                    w.write(doc)
                    bar.update()
            counts[split]["interleaved"] = n
        for split, n in (("train", cfg.text_docs), ("val", cfg.text_docs // 10)):
            with ShardWriter(tmp / split, "text", max_count=cfg.shard_max_count) as w:
                for i in range(n):
                    doc = _text(cfg, split, i)
                    if split == "train":
                        train_texts.append(doc.all_text())
                    w.write(doc)
                    bar.update()
            counts[split]["text"] = n
        bar.close()
        # The chat template's role tokens are special tokens of every tokenizer; placeholders are
        # not text.
        train_bpe((t.replace(IMAGE_TOKEN, " ") for t in train_texts), cfg.tokenizer_vocab).save(
            tmp / "tokenizer"
        )
        counts = {s: {k: v for k, v in c.items() if v} for s, c in counts.items()}
        info = {
            "version": GENERATOR_VERSION,
            "config": to_dict(cfg),
            "counts": counts,
            "weights": DEFAULT_WEIGHTS,
            "build_seconds": round(time.time() - t0, 3),
        }
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1))
        # the old build's record first (an interrupted replacement is no complete build), its
        # parts, then the new parts and their record last
        (out / INFO_FILE).unlink(missing_ok=True)
        for name in BUILD_PARTS:
            if (out / name).is_dir():
                shutil.rmtree(out / name)
            if (tmp / name).exists():
                os.replace(tmp / name, out / name)
        os.replace(tmp / INFO_FILE, out / INFO_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_info(directory: str | os.PathLike) -> dict | None:
    path = Path(directory) / INFO_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def ensure_default_dataset(
    directory: str | os.PathLike,
    cfg: DefaultDatasetConfig | None = None,
    progress: bool = True,
    wait: bool = True,
) -> Path:
    """Build the default dataset into `directory` unless a complete build is there already.

    With `cfg=None` any complete build of this generator version is accepted (so a custom
    `vlm data build-default --train-scenes ...` is kept); with a `cfg` its settings must match too.
    Another process building into `directory` is waited for (the ranks of a run, two runs on one
    machine), then its build is used; with `wait=False` it is `FolderBusy` (`vlm data
    build-default` says so and stops)."""
    directory = Path(directory)

    def ok() -> bool:
        info = default_info(directory)
        return (
            bool(info)
            and info.get("version") == GENERATOR_VERSION
            and (cfg is None or info.get("config") == to_dict(cfg))
        )

    if ok():
        return directory
    _check_replaceable(directory)
    made = not directory.exists()
    # another process building it (another rank, another run): waited for, then used
    with lock_folder(directory, "vlm data build-default", wait=wait):
        if ok():
            return directory
        try:
            return build_default(directory, cfg, progress=progress)
        except BaseException:
            if made:
                shutil.rmtree(directory, ignore_errors=True)
            raise


def default_sources(directory: str | os.PathLike, split: str = "train") -> list[dict]:
    """Source specs (path, weight, kind) of one split of the default dataset, for DataConfig.sources."""
    info = default_info(directory)
    if info is None:
        raise FileNotFoundError(
            f"no default dataset in {directory} (missing "
            f"{INFO_FILE}); run `vlm data build-default --out DIR`"
        )
    if split not in info["counts"]:
        raise ValueError(f"default dataset split {split!r} not one of {sorted(info['counts'])}")
    weights = info.get("weights", DEFAULT_WEIGHTS)
    return [
        {
            "path": str(Path(directory) / split / f"{name}-*.tar"),
            "weight": float(weights.get(name, 1.0)),
            "kind": "auto",
            "name": f"{split}/{name}",
        }
        for name in sorted(info["counts"][split])
    ]
