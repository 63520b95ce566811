"""Exporting the default dataset's test split for lmms-eval, and the task functions' scoring."""

from __future__ import annotations

import base64
import json

import pytest
import yaml

from data_pipelines.chat import iter_vqa_samples
from data_pipelines.default_dataset import DefaultDatasetConfig, build_default
from eval.export_tasks import DATA_TOKEN, export_tasks
from eval.tasks import conceptmoe_utils as U
from vlm.cli import main as eval_main


@pytest.fixture(scope="module")
def default_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("default")
    cfg = DefaultDatasetConfig(
        train_scenes=2, val_scenes=1, test_scenes=10, interleaved_docs=1, text_docs=2
    )
    return build_default(out / "data", cfg, progress=False)


def _load_yaml(path):
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor(
        "!function", lambda loader, node: ("function", loader.construct_scalar(node))
    )
    return yaml.load(path.read_text(), Loader=Loader)


def test_export_default_test_split(default_data, tmp_path):
    report = export_tasks(tmp_path / "tasks", data=default_data)
    vqa = [json.loads(x) for x in (tmp_path / "tasks" / "vqa_test.jsonl").read_text().splitlines()]
    caps = [
        json.loads(x) for x in (tmp_path / "tasks" / "caption_test.jsonl").read_text().splitlines()
    ]
    truth = list(iter_vqa_samples(str(default_data / "test" / "vqa-*.tar")))
    assert report["vqa"] == len(vqa) == len(truth) > 10 and report["caption"] == len(caps) == 10
    for rec, s in zip(vqa, truth):
        assert (rec["question"], rec["answer"], rec["question_type"]) == (
            s.question,
            s.answer,
            s.question_type,
        )
        assert base64.b64decode(rec["images"][0]) == s.image and rec["answer"] in rec["choices"]
        assert set(rec["choices"]) == {
            t.answer for t in truth if t.question_type == s.question_type
        }
    assert {r["question_type"] for r in vqa} <= set(U.QUESTION_TYPES)
    assert all("<image>" not in c["caption"] and c["caption"].endswith(".") for c in caps)
    assert U.doc_to_visual(caps[0])[0].size[0] >= 8
    for name in ("conceptmoe_vqa.yaml", "conceptmoe_vqa_mc.yaml", "conceptmoe_caption.yaml"):
        text = (tmp_path / "tasks" / name).read_text()
        cfg = _load_yaml(tmp_path / "tasks" / name)
        data_file = cfg["dataset_kwargs"]["data_files"]["test"]
        assert DATA_TOKEN not in text and data_file.startswith(str((tmp_path / "tasks").resolve()))
        assert (tmp_path / "tasks" / data_file.rsplit("/", 1)[1]).is_file()
        assert (
            cfg["dataset_path"] == "json"
            and cfg["doc_to_visual"][1] == "eval.tasks.conceptmoe_utils.doc_to_visual"
        )


def test_export_errors_and_cli(default_data, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="build-default"):
        export_tasks(tmp_path / "x", data=tmp_path / "nothing")
    eval_main(
        [
            "eval",
            "lmms-tasks",
            "--data",
            str(default_data),
            "--limit",
            "4",
            "--out",
            str(tmp_path / "t"),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["vqa"] == 4 and report["caption"] == 4 and len(report["yamls"]) == 3


def test_vqa_scoring_functions():
    doc = {"answer": "Red", "question_type": "colour", "heldout": True, "choices": ["blue", "red"]}
    assert U.vqa_process_results(doc, ["the red."]) == {
        "exact_match": 1.0,
        "exact_match_colour": 1.0,
        "exact_match_heldout": 1.0,
    }
    assert U.vqa_process_results({**doc, "heldout": False}, ["blue"]) == {
        "exact_match": 0.0,
        "exact_match_colour": 0.0,
    }
    assert U.mc_doc_to_target({"answer": "red", "choices": ["blue", "red"]}) == 1


def test_caption_metrics_hand_computed():
    # two one-word captions: only unigrams exist; each has tf 1, idf log(2/1); cosine 1 -> 10 * 1/4
    # per doc
    assert U.cider_d(["red", "blue"], [["red"], ["blue"]]) == pytest.approx(2.5)
    assert U.cider_d(["blue", "red"], [["red"], ["blue"]]) == 0.0
    refs = [
        ["a small red circle at the top"],
        ["a large blue square in the center"],
        ["two green dots"],
    ]
    perfect = U.cider_d([r[0] for r in refs], refs)
    partial = U.cider_d(
        ["a small red square", "a large blue square in the center", "nothing"], refs
    )
    assert perfect > partial > 0.0
    assert (
        U.caption_process_results({"caption": "A red circle."}, ["a red circle"])["exact_match"]
        == 1.0
    )


def test_bleu4_aggregate():
    pytest.importorskip("sacrebleu")  # comes with lmms-eval's runtime deps
    refs = ["a small red circle at the top", "a large blue square in the center"]
    assert U.bleu4_aggregate(
        [{"pred": r.upper() + ".", "refs": [r]} for r in refs]
    ) == pytest.approx(100.0)
    assert U.bleu4_aggregate([{"pred": "nothing alike here", "refs": [r]} for r in refs]) == 0.0
