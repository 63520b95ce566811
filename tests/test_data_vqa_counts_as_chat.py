"""Fast guard for a planted bug that only the slow tier caught (issue 36, item 5; the other four are
in tests/test_fast_guards.py): a one-image question/answer row from an importer counted as a caption
instead of a chat sample. In every importer format (LLaVA JSON, OpenAI-style messages, question /
answer JSONL, CSV and parquet, a hub dataset folder, `save_to_disk`), such a row counts as chat in
the manifest's totals, the per-kind statistics and the training batches' kinds; an image with a
caption still counts as a caption."""

from __future__ import annotations

import base64
import csv
import json

import pytest

from configs.batch import KINDS

_Q, _A = "What colour is the square?", "red"


def _one_image_vqa_sources(root, png, fmt: str):
    """The table file or dataset folder holding a single one-image VQA row in the importer format `fmt`."""
    root.mkdir(parents=True, exist_ok=True)
    image = png(28, 28)
    (root / "img").mkdir(exist_ok=True)
    (root / "img" / "a.png").write_bytes(image)
    llava = {
        "id": "q0",
        "image": "img/a.png",
        "conversations": [
            {"from": "human", "value": "<image>\n" + _Q},
            {"from": "gpt", "value": _A},
        ],
    }
    qa = {"id": "q0", "image": "img/a.png", "question": _Q, "answer": _A, "question_type": "colour"}
    # LLaVA / ShareGPT instruction file: one JSON array
    if fmt == "llava-json":
        (root / "llava.json").write_text(json.dumps([llava]))
        return root / "llava.json"
    # OpenAI-style messages, the image a part of the content
    if fmt == "openai-jsonl":
        uri = "data:image/png;base64," + base64.b64encode(image).decode()
        row = {
            "id": "q0",
            "image": uri,
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _Q}]},
                {"role": "assistant", "content": _A},
            ],
        }
        (root / "t.jsonl").write_text(json.dumps(row) + "\n")
        return root / "t.jsonl"
    if fmt == "qa-jsonl":
        (root / "t.jsonl").write_text(json.dumps(qa) + "\n")
        return root / "t.jsonl"
    if fmt == "qa-csv":
        with open(root / "t.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(qa))
            w.writeheader()
            w.writerow(qa)
        return root / "t.csv"
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "id": ["q0"],
            "image": [{"bytes": image, "path": "a.png"}],
            "question": [_Q],
            "answer": [[_A]],
        }
    )
    if fmt == "qa-parquet":  # datasets' Image feature: a {bytes, path} struct
        pq.write_table(table, root / "t.parquet")
        return root / "t.parquet"
    if fmt == "hub-folder":  # the hub's parquet layout: a dataset folder
        (root / "ds" / "data").mkdir(parents=True)
        pq.write_table(table, root / "ds" / "data" / "train-00000-of-00001.parquet")
        return root / "ds"
    if fmt == "save-to-disk-folder":  # datasets' Dataset.save_to_disk
        datasets = pytest.importorskip("datasets")
        ds = datasets.Dataset.from_dict(
            {"image": [{"bytes": image, "path": "a.png"}], "question": [_Q], "answer": [_A]},
            features=datasets.Features(
                {
                    "image": datasets.Image(),
                    "question": datasets.Value("string"),
                    "answer": datasets.Value("string"),
                }
            ),
        )
        ds.save_to_disk(str(root / "saved"))
        return root / "saved"
    raise AssertionError(fmt)


def _counted_kinds(out):
    """How the imported shards count: the manifest's chat total (`vlm data stats`), the decoded
    samples' per-kind statistics label, and the kind the training loader's batches carry at every
    position of the document."""
    from data_pipelines.config import DataConfig, SourceConfig
    from data_pipelines.encode import stats_kind
    from data_pipelines.loader import build_loader
    from data_pipelines.reader import iter_shard, resolve_shards
    from data_pipelines.schema import decode_sample
    from data_pipelines.tokenizer import ByteTokenizer
    from data_pipelines.writer import read_manifest
    from vision.image_processor import ImageProcessorConfig

    samples = [decode_sample(raw) for p in resolve_shards(out) for _, raw in iter_shard(p)]
    cfg = DataConfig(
        sources=[SourceConfig(path=str(out))],
        epochs=1,
        row_tokens=256,
        rows_per_batch=1,
        shuffle_buffer=0,
        pack_buffer=4,
        tokenizer="byte",
        processor=ImageProcessorConfig(patch_size=14, min_patches=4, max_patches=16, merge=2),
    )
    batch = next(iter(build_loader(cfg, ByteTokenizer())))
    valid = batch.doc_ids >= 0
    return (
        read_manifest(out)["totals"]["chat"],
        [stats_kind(s) for s in samples],
        sorted({KINDS[k] for k in batch.kind[valid].tolist()}),
        samples,
    )


@pytest.mark.parametrize(
    "fmt",
    [
        "llava-json",
        "openai-jsonl",
        "qa-jsonl",
        "qa-csv",
        "qa-parquet",
        "hub-folder",
        "save-to-disk-folder",
    ],
)
def test_a_one_image_question_answer_row_from_every_importer_format_counts_as_chat(
    fmt, tmp_path, png
):
    from data_pipelines.importers import import_table

    src = _one_image_vqa_sources(tmp_path / "src", png, fmt)
    res = import_table(src, tmp_path / "out")
    assert res["written"] == 1 and res["skipped"] == {}, res
    chat_total, labels, batch_kinds, (sample,) = _counted_kinds(tmp_path / "out")
    assert labels == ["chat"], (
        f"{fmt}: a one-image VQA row counts as {labels[0]} in the per-kind statistics"
    )
    assert (
        len(sample.images) == 1
        and sample.turns is not None
        and sample.turns[-1] == {"role": "assistant", "content": _A}
    ), f"{fmt}: imported as {sample}"
    assert batch_kinds == ["chat"], (
        f"{fmt}: the training batch labels the VQA document {batch_kinds}"
    )
    assert chat_total == 1, f"{fmt}: the import's statistics count {chat_total} chat samples"


def test_a_one_image_caption_still_counts_as_caption(tmp_path, png):
    """The other side of the line: an image with a caption (a table row, or a folder's image and
    sidecar) is a caption, so the chat count above is not everything counted as chat."""
    from data_pipelines.importers import import_folder, import_table

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png(28, 28))
    (tmp_path / "imgs" / "a.txt").write_text("a red square")
    (tmp_path / "t.jsonl").write_text(
        json.dumps({"image": "imgs/a.png", "caption": "a red square"}) + "\n"
    )
    for name, res in (
        ("folder", import_folder(tmp_path / "imgs", tmp_path / "folder")),
        ("table", import_table(tmp_path / "t.jsonl", tmp_path / "table")),
    ):
        assert res["written"] == 1, res
        chat_total, labels, batch_kinds, _ = _counted_kinds(tmp_path / name)
        assert (chat_total, labels, batch_kinds) == (0, ["caption"], ["caption"]), name
