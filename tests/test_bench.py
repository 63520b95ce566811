"""`vlm bench all --quick` end to end (the README's command, about 2 minutes on 2 cores): every part
runs and writes its JSON and figure. It checks that the suite runs and what it writes, never the
speed it measures."""

import json

import pytest
import torch

from eval.bench.cli import PARTS
from eval.bench.common import count_operators
from vlm.cli import main


@pytest.mark.slow  # about a minute in one worker
def test_every_part_writes_rows_machine_ratios_and_a_figure(tmp_path, capsys):
    # the plumbing of every part at toy shapes (--quick's 16K prefill alone took minutes)
    assert main(["bench", "all", "--smoke", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for part in PARTS:
        res = json.loads((tmp_path / f"{part}.json").read_text())
        assert res["part"] == part and res["mode"] == "smoke"
        assert {"platform", "processor", "torch", "threads", "device"} <= set(res["machine"])
        assert res["settings"] and res["rows"]
        for r in res["rows"]:
            assert {
                "candidate",
                "setting",
                "metric",
                "unit",
                "median",
                "spread",
                "n",
                "ratio_vs_baseline",
            } <= set(r)
            assert (
                r["median"] > 0
                and r["n"] >= 2
                and r["spread"]["min"] <= r["median"] <= r["spread"]["max"]
            )
        # Every setting has exactly one baseline row, at ratio 1.
        for setting in {
            (json.dumps(r["setting"], sort_keys=True), r["metric"]) for r in res["rows"]
        }:
            ratios = [
                r["ratio_vs_baseline"]
                for r in res["rows"]
                if (json.dumps(r["setting"], sort_keys=True), r["metric"]) == setting
            ]
            assert len(ratios) >= 2 and ratios[0] == 1.0
        assert (tmp_path / f"{part}.png").stat().st_size > 0
        assert f"== {part} ==" in printed
    # the model part counts one eager training step's operators per candidate (issue 35: launches
    # per step)
    res = json.loads((tmp_path / "model.json").read_text())
    first = res["settings"]["seq_lens"][0]
    train = [r for r in res["rows"] if r["setting"] == {"mode": "train", "seq_len": first}]
    assert len(train) == 4 and all(r["operators_per_step"] > 0 for r in train)
    # the long-context row (16K in --quick) is timed in prefill only
    (long,) = res["settings"]["prefill_only"]
    assert {r["setting"]["mode"] for r in res["rows"] if r["setting"]["seq_len"] == long} == {
        "prefill"
    }


def test_count_operators_counts_what_runs_a_kernel_not_views_or_reads():
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    # mm and relu and sum; the transpose and the view alias storage, detach wraps it, item reads a
    # scalar back
    assert count_operators(lambda: (x @ w.t()).relu().view(-1).detach().sum().item()) == 3
    # the backward's operators count too (it runs under the same dispatch mode on a CPU)
    assert count_operators(lambda: (x @ w).sum().backward()) > 2


def test_realized_part_times_the_checkpoints_own_boundaries_next_to_forced_ones(
    exported_vlm, tiny_default, tmp_path
):
    from eval.bench import realized

    docs = realized.realized_documents(str(exported_vlm), str(tiny_default), 6)
    assert set(docs) == {"vqa prompt", "caption"} and all(len(v) == 6 for v in docs.values())
    assert all(m[0] for v in docs.values() for m in v)  # every document starts a concept
    assert (
        main(
            [
                "bench",
                "realized",
                "--smoke",
                "--ckpt",
                str(exported_vlm),
                "--data",
                str(tiny_default),
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "realized.json").read_text())
    names = {r["candidate"] for r in res["rows"]}
    assert {"baseline (MoE)", "more_experts (learned)", "more_experts (forced R=2)"} <= names
    for r in res["rows"]:
        if r["candidate"].endswith("(forced R=2)"):
            assert abs(r["realized_R"] - 2) < 0.3
    # the learned rows carry the router's own ratio on the packed documents
    learned = {
        r["setting"]["kind"]: r["realized_R"]
        for r in res["rows"]
        if r["candidate"] == "more_experts (learned)"
    }
    batch, mask = realized.pack(docs["caption"], 128, 512)
    assert learned["caption"] == round(float((batch.doc_ids >= 0).sum() / mask.sum()), 3)


def test_realized_part_without_a_checkpoint_says_so(tmp_path):
    assert main(["bench", "realized", "--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "realized.json").read_text())
    assert res["rows"] == [] and "--ckpt" in res["unavailable"]["learned boundaries"]
