"""`vlm chain CONFIG... [K=V ...] --out DIR`: training stages in order, each from the previous
stage's final/.

Stage k trains into DIR/<k>_<config stem> with train.init_from = the previous stage's final/; a
finished stage is skipped when the same command runs again; every stage config is validated before
any stage starts.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest
import torch
import yaml

from configs.config import ConfigError


def _write(path, data: dict):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _stage_files(root, data_dir, tiny: dict) -> dict[str, str]:
    """A tiny base config on the default dataset and three stages that state only what differs
    from it: text (LLM alone, text part) -> align (captions, LLM frozen) -> full (everything
    trains, all parts)."""
    base = copy.deepcopy(tiny)
    base["data"].update(sources=[], default_dir=str(data_dir))
    base["logging"].update(eval_every=0, histogram_every=0, eval_sources=[])
    base["checkpoint"].update(save_every=1, keep_last=2)
    base["train"].update(max_steps=5)  # the chain's override brings every stage down to 2
    root.mkdir(parents=True, exist_ok=True)
    _write(root / "base.yaml", base)
    return {
        # vqa_eval on: the end-of-run VQA check must skip a model without vision rather than fail
        # the stage
        "text": _write(
            root / "text.yaml",
            {
                "base": "base.yaml",
                "vision": None,
                "data": {"default_parts": ["text"]},
                "train": {"stage": "text", "vqa_eval": True},
            },
        ),
        "align": _write(
            root / "align.yaml",
            {
                "base": "base.yaml",
                "data": {"default_parts": ["caption"]},
                "params": {"freeze": ["lm"]},
            },
        ),
        "full": _write(root / "full.yaml", {"base": "base.yaml"}),
    }


def _chain_cli(args: list[str]) -> tuple[int, str, str]:
    from vlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["chain", *args])
    return rc, out.getvalue(), err.getvalue()


def _lm_params(path) -> dict[str, torch.Tensor]:
    from vlm.model.hf import load_vlm

    return {k: v.detach().clone() for k, v in load_vlm(path).lm.named_parameters()}


def _mtimes(d) -> dict[str, int]:
    return {
        str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def chain(tiny_data, tmp_path_factory, TINY):
    """The text -> align chain, run once through the CLI for the tests of this module."""
    det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    root = tmp_path_factory.mktemp("chain")
    files = _stage_files(root / "cfg", tiny_data, TINY)
    out = root / "out"
    args = [files["text"], files["align"], "train.max_steps=2", "--out", str(out)]
    rc, stdout, stderr = _chain_cli(args)
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    yield {"files": files, "out": out, "args": args, "stdout": stdout, "data": tiny_data}
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)


def test_stages_run_in_order_each_from_the_previous_final(chain):
    out = chain["out"]
    text_dir, align_dir = out / "0_text", out / "1_align"
    assert sorted(p.name for p in out.iterdir()) == ["0_text", "1_align"]
    for d in (text_dir, align_dir):
        summary = json.loads((d / "summary.json").read_text())
        # the override reached every stage
        assert summary["exit_code"] == 0 and summary["steps"] == 2
        assert (d / "final" / "config.json").is_file()

    assert json.loads((text_dir / "summary.json").read_text())["vqa"] is None
    assert not (text_dir / "vqa.json").exists()

    text_cfg = yaml.safe_load((text_dir / "config.yaml").read_text())
    align_cfg = yaml.safe_load((align_dir / "config.yaml").read_text())
    assert text_cfg["train"]["init_from"] is None and text_cfg["train"]["stage"] == "text"
    assert text_cfg["vision"] is None and text_cfg["data"]["default_parts"] == ["text"]
    assert align_cfg["train"]["init_from"] == str(text_dir / "final")
    assert align_cfg["data"]["default_parts"] == ["caption"] and align_cfg["params"]["freeze"] == [
        "lm"
    ]

    # the align stage froze the LLM, so its exported LLM is stage 1's exactly, and not a
    # fresh initialisation
    from vlm.model.multimodal import ConceptMoEVLM
    from vlm.train.config import load_train_config

    text_lm, align_lm = _lm_params(text_dir / "final"), _lm_params(align_dir / "final")
    assert text_lm.keys() == align_lm.keys()
    for k in text_lm:
        assert torch.equal(text_lm[k], align_lm[k]), k
    torch.manual_seed(load_train_config(chain["files"]["align"]).train.seed)
    fresh = dict(
        ConceptMoEVLM(load_train_config(chain["files"]["align"]).model, None).lm.named_parameters()
    )
    assert any(not torch.equal(fresh[k], text_lm[k]) for k in text_lm)

    # the text stage saw no images, the align stage did
    text_rec = [json.loads(x) for x in (text_dir / "metrics.jsonl").read_text().splitlines()]
    align_rec = [json.loads(x) for x in (align_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(not r.get("tokens/image") for r in text_rec)
    assert all(r["tokens/image"] > 0 for r in align_rec)


def test_rerun_skips_finished_stages_and_runs_the_rest(chain, tmp_path):
    out, args = chain["out"], chain["args"]
    before = {d.name: _mtimes(d) for d in out.iterdir()}
    rc, stdout, _ = _chain_cli(args)
    assert rc == 0
    assert stdout.count("done earlier") == 2, stdout
    assert {d.name: _mtimes(d) for d in out.iterdir()} == before  # nothing was touched

    # a third stage appended to the same command: the first two are skipped, the new one starts from
    # stage 2
    import shutil

    out3 = tmp_path / "out"
    shutil.copytree(out, out3)
    before = {d.name: _mtimes(d) for d in out3.iterdir()}
    rc, stdout, _ = _chain_cli(
        [
            chain["files"]["text"],
            chain["files"]["align"],
            chain["files"]["full"],
            "--out",
            str(out3),
            "train.max_steps=2",
        ]
    )
    assert rc == 0
    assert stdout.count("done earlier") == 2, stdout
    for name, mt in before.items():
        assert _mtimes(out3 / name) == mt, name
    full_cfg = yaml.safe_load((out3 / "2_full" / "config.yaml").read_text())
    assert full_cfg["train"]["init_from"] == str(out3 / "1_align" / "final")
    assert json.loads((out3 / "2_full" / "summary.json").read_text())["exit_code"] == 0


def test_an_unfinished_stage_resumes_instead_of_restarting(chain, tmp_path):
    """A stage interrupted after its last checkpoint (no summary, no final/) continues from the checkpoint."""
    import shutil

    from vlm.train.chain import run_chain

    out = tmp_path / "out"
    shutil.copytree(chain["out"], out)
    align = out / "1_align"
    (align / "summary.json").unlink()
    shutil.rmtree(align / "final")
    # the run directory of stage 2 still holds stage 1's path in its config: the copy must point at
    # its own
    cfg = yaml.safe_load((align / "config.yaml").read_text())
    cfg["train"]["init_from"] = str(out / "0_text" / "final")
    (align / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    metrics_before = (align / "metrics.jsonl").read_text()
    logs: list[str] = []
    rc = run_chain(
        [chain["files"]["text"], chain["files"]["align"]],
        out,
        ["train.max_steps=2"],
        log=logs.append,
    )
    assert rc == 0
    assert any("done earlier" in x and "0_text" in x for x in logs), logs
    assert (align / "final" / "config.json").is_file()
    assert json.loads((align / "summary.json").read_text())["steps"] == 2
    assert (align / "metrics.jsonl").read_text() == metrics_before  # no step was trained again


def test_bad_stage_config_stops_before_any_work(tiny_data, tmp_path, capsys, TINY):
    from vlm.cli import main

    files = _stage_files(tmp_path / "cfg", tiny_data, TINY)
    bad = _write(tmp_path / "cfg" / "bad.yaml", {"base": "base.yaml", "optim": {"lrr": 0.1}})
    out = tmp_path / "out"
    rc = main(["chain", files["text"], bad, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("config error: ") and "optim.lrr" in err and len(err.splitlines()) == 1, (
        err
    )
    assert not out.exists(), "a bad later stage must stop the chain before the first stage trains"

    # a later stage may not choose its own starting point: the chain sets it
    own = _write(
        tmp_path / "cfg" / "own.yaml", {"base": "base.yaml", "train": {"init_from": str(tmp_path)}}
    )
    from vlm.train.chain import run_chain

    with pytest.raises(ConfigError, match="init_from is set by the chain"):
        run_chain([files["text"], own], out, [], log=lambda *_: None)
    assert not out.exists()

    # a bad override is caught the same way
    rc = main(["chain", files["text"], files["align"], "train.max_steps=zero", "--out", str(out)])
    assert rc == 2 and "train.max_steps" in capsys.readouterr().err
    assert not out.exists()


def test_finished_needs_a_clean_summary_and_an_export(tmp_path):
    from vlm.train.chain import finished

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    assert not finished(run)  # no summary yet
    (run / "summary.json").write_text('{"steps": 3, "exit_c')  # cut short mid-write
    assert not finished(run)
    (run / "summary.json").write_text(json.dumps({"exit_code": 1}))
    # stopped early (e.g. too many non-finite steps)
    assert not finished(run)
    (run / "summary.json").write_text(json.dumps({"exit_code": 0}))
    assert finished(run)
    (run / "final" / "config.json").unlink()
    assert not finished(run)  # export missing


def test_ctrl_c_stops_the_stage_in_flight_and_the_same_command_continues(chain, tmp_path):
    """SIGINT during stage 0: the stage saves and returns 130, stage 1 never starts, nothing raises;
    the same command then finishes both stages. The signal is simulated as the flag the handler
    sets, seen at the n-th poll (deterministic: no real signal, no timing)."""
    import signal

    from vlm.train.chain import finished, run_chain, stage_dirs
    from vlm.train.signals import StopFlag

    class StopAtPoll(StopFlag):
        def __init__(self, polls: int):
            super().__init__()
            self.left = polls

        @property
        def requested(self) -> bool:
            if self.signum is None:
                self.left -= 1
                if self.left < 0:
                    self.signum = signal.SIGINT
            return self.signum is not None

    files = [chain["files"]["text"], chain["files"]["align"]]
    out = tmp_path / "out"
    first, second = stage_dirs(files, out)
    logs: list[str] = []
    rc = run_chain(files, out, ["train.max_steps=4"], log=logs.append, stop=StopAtPoll(3))
    assert rc == 130, logs
    assert not finished(first) and not second.exists()
    assert any("stopped with exit code 130" in x for x in logs), logs
    rc = run_chain(files, out, ["train.max_steps=4"], log=logs.append)
    assert rc == 0 and finished(first) and finished(second)
    steps = [
        json.loads(x)["step"]
        for x in (first / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(x)
    ]
    # stage 0 resumed: no step trained twice
    assert steps == sorted(set(steps)) and steps[-1] == 4
