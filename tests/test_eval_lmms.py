"""lmms-eval adapter: requests built as lmms-eval 0.7.3 builds them, and a real `lmms-eval eval` CLI run."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

# also needs lmms-eval's small runtime deps (see eval/README.md)
pytest.importorskip("lmms_eval.api.model")

from lmms_eval.api.instance import Instance, unwrap_generation_output
from PIL import Image

from data_pipelines.chat import vqa_prompt
from eval.export_tasks import instantiate_templates, write_jsonl
from eval.lmms_adapter import ConceptMoELMMS, LoglikResult
from eval.testing import COLOURS, OracleEvalModel, WordTokenizer

REPO = Path(__file__).resolve().parents[1]
TASK = "colours"


def _png(colour: str) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (24, 16), COLOURS[colour]).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _docs() -> list[dict]:
    names = ["red", "green", "blue", "yellow"]
    return [
        {
            "id": str(i),
            "question": "What colour is this?",
            "answer": c,
            "question_type": "colour",
            "heldout": i == 0,
            "images": [_png(c)],
            "choices": sorted(names),
            "caption": c,
        }
        for i, c in enumerate(names)
    ]


def doc_to_visual(doc):
    return [Image.open(io.BytesIO(base64.b64decode(b))) for b in doc["images"]]


class Double(ConceptMoELMMS):
    def _load_model(self, pretrained):
        return OracleEvalModel(WordTokenizer())


def _adapter(tmp_path, **kw) -> ConceptMoELMMS:
    lm = Double(pretrained=str(tmp_path / "ckpt"), stats_dir=str(tmp_path / "out"), **kw)
    lm.task_dict = {TASK: {"test": _docs()}}
    return lm


def _gen_instance(doc_id: int, context: str, gen_kwargs: dict) -> Instance:
    # exactly ConfigurableTask.construct_requests' shape for output_type generate_until
    return Instance(
        request_type="generate_until",
        idx=0,
        metadata={"task": TASK, "doc_id": doc_id, "repeats": 1},
        arguments=(context, dict(gen_kwargs), doc_to_visual, doc_id, TASK, "test"),
    )


def _ll_instance(doc_id: int, context: str, continuation, idx: int = 0) -> Instance:
    return Instance(
        request_type="loglikelihood",
        idx=idx,
        metadata={"task": TASK, "doc_id": doc_id, "repeats": 1},
        arguments=(context, continuation, doc_to_visual, doc_id, TASK, "test"),
    )


def test_generate_until_images_until_and_budget(tmp_path):
    lm = _adapter(tmp_path, batch_size=3)
    gk = {"until": ["\n"], "max_new_tokens": 7, "temperature": 0, "do_sample": False}
    reqs = [_gen_instance(i, "What colour is this?", gk) for i in range(4)]
    out = [unwrap_generation_output(x)[0] for x in lm.generate_until(reqs)]
    assert [o.strip() for o in out] == ["red", "green", "blue", "yellow"]
    calls = lm.model.calls
    assert [c["n"] for c in calls] == [3, 1]  # batched by batch_size
    assert all(c["max_new_tokens"] == 7 and c["temperature"] == 0.0 for c in calls)
    # one image per doc reached the model
    assert all(c["images"] == [1] * c["n"] for c in calls)
    assert calls[0]["stop"] == ["\n", "<|end|>"]
    assert calls[0]["prompts"][0] == "<|user|><image>\nWhat colour is this?<|end|><|assistant|>"
    # the format VQA was trained on
    assert calls[0]["prompts"][0] == vqa_prompt("What colour is this?")
    saved = json.loads(next((tmp_path / "out").glob("*/*_compression.json")).read_text())
    comp = saved["tasks"][TASK]["generate_until"]
    assert comp["requests"] == 4 and comp["compression"]["compression/image"] == 4.0
    assert comp["compression"]["compression/text"] > 1.0


def test_batches_go_longest_prompt_first_and_answers_keep_request_order(tmp_path):
    lm = _adapter(tmp_path, batch_size=2)
    gk = {"max_new_tokens": 4}
    contexts = ["Colour?", "What colour is this one, please?", "What colour?", "What colour is it?"]
    out = [
        unwrap_generation_output(x)[0]
        for x in lm.generate_until([_gen_instance(i, c, gk) for i, c in enumerate(contexts)])
    ]
    assert [o.strip() for o in out] == ["red", "green", "blue", "yellow"]
    firsts = [c["prompts"] for c in lm.model.calls]
    assert [len(p) for batch in firsts for p in batch] == sorted(
        (len(p) for batch in firsts for p in batch), reverse=True
    )


def test_rank_and_world_size_come_from_the_launcher(tmp_path, monkeypatch):
    """accelerate / torchrun set RANK and WORLD_SIZE: lmms-eval then builds only this rank's requests."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    # a Trainer test earlier in this worker leaves its one-process group initialised; a
    # launcher-started process has none yet when lmms-eval builds the model
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    lm = _adapter(tmp_path)
    assert (lm.rank, lm.world_size) == (1, 2)


class _Rambler(OracleEvalModel):
    def generate(self, prompts, images=None, **kw):
        super().generate(prompts, images, **kw)
        return ["red. Then more\nand more <|end|> junk"] * len(prompts)


def test_until_is_enforced_and_sampling_args_pass(tmp_path):
    lm = _adapter(tmp_path)
    lm.model = _Rambler(WordTokenizer())
    gk = {
        "until": ". Then",
        "max_new_tokens": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "do_sample": True,
    }
    assert lm.generate_until([_gen_instance(0, "Colour?", gk)]) == ["red"]
    call = lm.model.calls[-1]
    assert call["temperature"] == 0.7 and call["top_p"] == 0.9 and call["max_new_tokens"] == 3
    # no `until` given: the chat template's end token still stops the answer
    assert lm.generate_until([_gen_instance(0, "Colour?", {"max_new_tokens": 3})]) == [
        "red. Then more\nand more "
    ]


def test_context_layouts(tmp_path):
    lm = _adapter(tmp_path, chat="auto")
    gk = {"until": ["\n"], "max_new_tokens": 4}
    # placed by the task, wrapped in the template
    lm.generate_until([_gen_instance(0, "<image>\nQ?", gk)])
    assert lm.model.calls[-1]["prompts"] == ["<|user|><image>\nQ?<|end|><|assistant|>"]
    templated = "<|user|><image>\nQ?<|end|><|assistant|>"
    # already in the template: verbatim
    lm.generate_until([_gen_instance(0, templated, gk)])
    assert lm.model.calls[-1]["prompts"] == [templated]
    with pytest.raises(ValueError, match="2 <image> placeholders for 1 images"):
        lm.generate_until([_gen_instance(0, "<image><image>Which?", gk)])
    lm_off = _adapter(tmp_path, chat="false")
    lm_off.generate_until([_gen_instance(1, "Q?", gk)])
    assert lm_off.model.calls[-1]["prompts"] == ["<image>\nQ?"]


def test_loglikelihood_multiple_choice_and_target(tmp_path):
    lm = _adapter(tmp_path, batch_size=2)
    choices = ["blue", "green", "red", "yellow"]
    gold = {0: 2, 1: 1}  # doc 0 is red, doc 1 is green
    reqs = [
        _ll_instance(d, "What colour is this?", c, idx=i)
        for d in gold
        for i, c in enumerate(choices)
    ]
    reqs.append(
        Instance(
            request_type="loglikelihood",
            idx=0,
            metadata={"task": TASK, "doc_id": 2, "repeats": 1},
            # acc_mutual_info's unconditional pair
            arguments=("", "blue"),
        )
    )
    res = lm.loglikelihood(reqs)
    assert all(isinstance(r, LoglikResult) and isinstance(r, tuple) for r in res)
    # what lmms-eval stores as the response
    values = [unwrap_generation_output(r)[0] for r in res]
    assert all(isinstance(v, tuple) and len(v) == 2 for v in values)
    for k, g in enumerate(gold.values()):
        # MultipleChoice's `zip(*results)`
        lls, greedy = zip(*values[4 * k : 4 * k + 4])
        assert (
            int(np.argmin(lls)) == g
            and greedy[g]
            and not any(greedy[i] for i in range(4) if i != g)
        )
    assert values[-1][0] > 0  # negative log-likelihood of a wrong choice
    # output_type loglikelihood: continuation is doc_to_target (callable) -> log-likelihood itself
    tgt = lm.loglikelihood(
        [
            _ll_instance(3, "What colour is this?", lambda doc: doc["answer"]),
            _ll_instance(3, "What colour is this?", lambda doc: "red"),
        ]
    )
    assert tgt[0][0] == 0.0 and tgt[0][1] is True and tgt[1][0] < 0 and tgt[1][1] is False
    first = lm.model.calls[0]  # the longest requests go first
    assert first["images"] == [1, 1] and first["continuations"] == ["yellow", "yellow"]
    saved = json.loads(next((tmp_path / "out").glob("*/*_compression.json")).read_text())
    assert saved["tasks"][TASK]["loglikelihood"]["requests"] == 2


def test_bad_model_args(tmp_path):
    with pytest.raises(ValueError, match="unknown model args \\['temprature'\\]"):
        Double(pretrained=str(tmp_path), temprature=1)
    with pytest.raises(ValueError, match="chat='maybe'"):
        Double(pretrained=str(tmp_path), chat="maybe")
    with pytest.raises(ValueError, match="pretrained"):
        Double()


def test_manifest_resolves_through_registry():
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    from eval.lmms_manifest import MANIFEST

    reg = ModelRegistryV2()
    reg.register_manifest(MANIFEST)
    assert reg.get_model_class("conceptmoe") is ConceptMoELMMS


PLUGIN = textwrap.dedent("""
    from lmms_eval.models.registry_v2 import ModelManifest

    MANIFEST = ModelManifest(model_id="conceptmoe_double", simple_class_path="cmoe_double_plugin.DoubleLMMS")

    from eval.lmms_adapter import ConceptMoELMMS
    from eval.testing import OracleEvalModel, WordTokenizer

    class DoubleLMMS(ConceptMoELMMS):
        def _load_model(self, pretrained):
            return OracleEvalModel(WordTokenizer())
""")


def _double_plugin(tmp_path):
    """A folder that, on PYTHONPATH, registers the model double under the `lmms_eval.models` entry points."""
    plugin = tmp_path / "plugin"
    info = plugin / "cmoe_double_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (plugin / "cmoe_double_plugin.py").write_text(PLUGIN)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cmoe-double-plugin\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[lmms_eval.models]\nconceptmoe_double = cmoe_double_plugin:MANIFEST\n"
    )
    return plugin


def _offline_env(plugin, tmp_path) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(plugin), str(REPO)]),
        HF_HOME=str(tmp_path / "hf"),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
    )


@pytest.mark.slow
def test_lmms_eval_cli_run_on_local_tasks(tmp_path):
    """`lmms-eval eval` with the shipped task YAMLs on a tiny local JSON split; the model double is
    found through a real `lmms_eval.models` entry point (a dist-info folder on PYTHONPATH)."""
    plugin = _double_plugin(tmp_path)
    tasks = tmp_path / "tasks"
    write_jsonl(_docs(), tasks / "vqa_test.jsonl")
    write_jsonl(_docs(), tasks / "caption_test.jsonl")
    instantiate_templates(tasks, ["vqa", "caption"])
    ckpt = tmp_path / "run" / "final"
    ckpt.mkdir(parents=True)
    env = _offline_env(plugin, tmp_path)
    cmd = [
        sys.executable,
        "-c",
        "import sys; from lmms_eval.cli.dispatch import main; sys.exit(main())",
        "eval",
        "--model",
        "conceptmoe_double",
        "--model_args",
        f"pretrained={ckpt}",
        "--tasks",
        "conceptmoe_vqa,conceptmoe_vqa_mc,conceptmoe_caption",
        "--include_path",
        str(tasks),
        "--output_path",
        str(tmp_path / "out"),
        "--batch_size",
        "2",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    # lmms-eval exits 0 on errors: check files
    found = list((tmp_path / "out").glob("run__final/*_results.json"))
    assert found, log
    res = json.loads(found[0].read_text())["results"]
    assert res["conceptmoe_vqa"]["exact_match,none"] == 1.0
    assert res["conceptmoe_vqa"]["exact_match_colour,none"] == 1.0
    assert res["conceptmoe_vqa"]["exact_match_heldout,none"] == 1.0
    # argmin over -log p picks the answer
    assert res["conceptmoe_vqa_mc"]["acc,none"] == 1.0
    assert res["conceptmoe_caption"]["exact_match,none"] == 1.0
    assert res["conceptmoe_caption"]["cider,none"] > 0.0
    comp = json.loads(next((tmp_path / "out").glob("run__final/*_compression.json")).read_text())
    assert set(comp["tasks"]) == {"conceptmoe_vqa", "conceptmoe_vqa_mc", "conceptmoe_caption"}
    assert comp["tasks"]["conceptmoe_vqa_mc"]["loglikelihood"]["requests"] == 16
    assert (
        comp["tasks"]["conceptmoe_vqa"]["generate_until"]["compression"]["compression/image"] == 4.0
    )


@pytest.mark.slow
def test_two_processes_answer_each_request_once(tmp_path):
    """`torchrun --nproc_per_node 2 -m lmms_eval eval ...` (what `accelerate launch` does):
    lmms-eval gives each rank its share of the requests; the scores are those of one process and the
    ranks' compression logs add up to every request exactly once."""
    plugin = _double_plugin(tmp_path)
    tasks = tmp_path / "tasks"
    write_jsonl(_docs(), tasks / "vqa_test.jsonl")
    instantiate_templates(tasks, ["vqa"])
    ckpt = tmp_path / "run" / "final"
    ckpt.mkdir(parents=True)
    env = dict(_offline_env(plugin, tmp_path), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "-m",
        "lmms_eval",
        "eval",
        "--model",
        "conceptmoe_double",
        "--model_args",
        f"pretrained={ckpt}",
        "--tasks",
        "conceptmoe_vqa,conceptmoe_vqa_mc",
        "--include_path",
        str(tasks),
        "--output_path",
        str(tmp_path / "out"),
        "--batch_size",
        "2",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    found = list((tmp_path / "out").glob("run__final/*_results.json"))
    assert found, log
    res = json.loads(found[0].read_text())["results"]
    assert (
        res["conceptmoe_vqa"]["exact_match,none"] == 1.0
        and res["conceptmoe_vqa_mc"]["acc,none"] == 1.0
    )
    shares = [
        json.loads(p.read_text())["tasks"]
        for p in (tmp_path / "out").glob("run__final/*_compression.rank*.json")
    ]
    assert len(shares) == 2
    # 4 docs x 4 choices
    assert sum(t["conceptmoe_vqa_mc"]["loglikelihood"]["requests"] for t in shares) == 16
    assert sum(t["conceptmoe_vqa"]["generate_until"]["requests"] for t in shares) == 4


def test_raw_image_context_is_wrapped_exactly_as_the_trainer_encodes_vqa(tmp_path):
    """A standard task's raw `<image>\\n<question>` context becomes the same tokens the trainer saw before an answer."""
    from data_pipelines.encode import encode_sample
    from data_pipelines.packing import make_prompt_batch
    from data_pipelines.schema import Sample
    from data_pipelines.tokenizer import load_tokenizer
    from vision.image_processor import ImageProcessor, ImageProcessorConfig

    tok, proc = (
        load_tokenizer("byte"),
        ImageProcessor(ImageProcessorConfig(patch_size=8, max_patches=64)),
    )
    png = base64.b64decode(_png("red"))
    question, answer = "What colour is the circle?", "red"
    turns = [
        {"role": "user", "content": "<image>\n" + question},
        {"role": "assistant", "content": answer},
    ]
    train = encode_sample(
        Sample(key="k", kind="pair", turns=turns, images=[png]),
        tok,
        proc,
        row_tokens=4096,
        loss_on="assistant",
    )[0]
    prompt, chatted = _adapter(tmp_path)._format("<image>\n" + question, 1)
    assert chatted
    ids = make_prompt_batch([(prompt, [png])], tok, proc).input_ids[0].tolist()
    first_target = int(np.flatnonzero(train.target)[0])
    assert ids == train.ids[:first_target].tolist()  # everything up to the first answer token
    assert tok.decode(train.ids[first_target : first_target + len(answer)].tolist()) == answer
