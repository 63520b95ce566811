"""Published numbers are generated, not typed (issue 36 item 3): every table of measured figures in
README.md and docs/ is rendered by `vlm results` (`make results`) from the JSON the bench, the
recipes and the runs leave, and these tests fail when a table, or a figure the prose repeats,
disagrees with its JSON. Fast: no training."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

from eval.publish import bench, regions, registry, runs
from eval.publish.cli import run as results_cli

ROOT = Path(__file__).resolve().parents[1]


def scratch_copy(tmp_path: Path) -> Path:
    """The documents and every JSON they are rendered from, in a scratch tree."""
    paths = set(registry.documents()) | {p for t in registry.TABLES for p in t.sources}
    for rel in paths:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} should occur once in {path}"
    path.write_text(text.replace(old, new))


def test_every_table_agrees_with_its_json():
    problems = registry.check(ROOT)
    hint = "\n\nrun `make results` (never edit a table by hand)"
    assert not problems, "\n\n".join(problems) + hint


def test_every_json_a_table_names_exists_and_parses():
    named = {p for t in registry.TABLES for p in t.sources}
    for rel in sorted(named):
        assert (ROOT / rel).is_file(), f"{rel} is named by a table but missing"
        data = registry.load(ROOT, rel)  # parses; a recorded file must carry its provenance
        assert data, rel
    recorded = {str(p.relative_to(ROOT)) for p in (ROOT / registry.REC).glob("*.json")}
    assert recorded <= named, f"recorded files no table reads: {sorted(recorded - named)}"
    # a run's JSON is as the trainer writes it; the bench's as `vlm bench` writes it
    assert {"steps", "wall_s", "vqa"} <= set(json.loads((ROOT / runs.RUN_SUMMARY).read_text()))
    for rel in (bench.MODEL, bench.DECODE, bench.REALIZED, bench.LAUNCHES):
        assert {"part", "machine", "settings", "rows"} <= set(json.loads((ROOT / rel).read_text()))


def test_every_table_has_its_markers_once():
    for doc in registry.documents():
        found = regions.regions((ROOT / doc).read_text())
        assert set(found) == {t.name for t in registry.TABLES if t.doc == doc}, doc


@pytest.mark.parametrize(
    "doc, old, new, table",
    [
        (
            "docs/benchmarks.md",
            "| prefill, more experts | 1.29x |",
            "| prefill, more experts | 1.30x |",
            "bench-model",
        ),
        (
            "README.md",
            "| caption | 2.33 / 2.50 / 2.40",
            "| caption | 2.33 / 2.55 / 2.40",
            "readme-compression",
        ),
        (
            "docs/results/claims.md",
            "dynamic 0.922 (0.921-0.923) < fixed 0.939",
            "dynamic 0.922 (0.921-0.923) < fixed 0.949",
            "claims",
        ),
        (
            "docs/results/compression.md",
            "| all | **56.5** / 29.4 / 30.8",
            "| all | **57.5** / 29.4 / 30.8",
            "compression-seeds-vqa",
        ),
    ],
)
def test_a_hand_edited_number_fails_the_check(tmp_path, doc, old, new, table):
    root = scratch_copy(tmp_path)
    assert registry.check(root) == []
    edit(root / doc, old, new)
    problems = registry.check(root)
    assert len(problems) == 1 and f"results:{table} differs" in problems[0], problems
    assert old in problems[0]  # the diff shows the JSON's figure
    registry.write(root)  # `make results` puts the JSON's figure back
    assert registry.check(root) == [] and old in (root / doc).read_text()


def test_a_changed_json_fails_until_rendered(tmp_path):
    root = scratch_copy(tmp_path)
    path = root / runs.RUN_VQA
    vqa = json.loads(path.read_text())
    vqa["accuracy"]["all"] = 12.34
    path.write_text(json.dumps(vqa))
    problems = registry.check(root)
    assert len(problems) == 1 and "results:readme-results" in problems[0]
    registry.write(root)
    assert registry.check(root) == [] and "held-out VQA 12.3 %" in (root / "README.md").read_text()


def test_the_command_exits_1_on_a_hand_edit(tmp_path, capsys):
    root = scratch_copy(tmp_path)
    args = argparse.Namespace(check=True, rerun=[], root=str(root))
    assert results_cli(args) == 0
    edit(
        root / "docs/benchmarks.md",
        "| captions, learned boundaries | 1.13x |",
        "| captions, learned boundaries | 1.31x |",
    )
    assert results_cli(args) == 1
    assert "results:bench-realized differs" in capsys.readouterr().err


def test_markers_must_pair_and_name_a_known_table(tmp_path):
    root = scratch_copy(tmp_path)
    edit(root / "docs/benchmarks.md", "<!-- /results:bench-realized -->", "")
    with pytest.raises(regions.RegionError, match="bench-realized"):
        registry.check(root)
    with pytest.raises(regions.RegionError, match="no-such"):
        regions.replace("<!-- results:no-such -->x<!-- /results:no-such -->", {})


def test_a_recorded_file_needs_its_provenance(tmp_path):
    root = scratch_copy(tmp_path)
    path = root / registry.REC / "claims.json"
    data = json.loads(path.read_text())
    del data["provenance"]["commit"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="provenance"):
        registry.check(root)


def pct(x: float) -> str:
    return f"{x:.1f}"


def test_figures_the_prose_repeats_agree_with_the_json():
    """Figures outside the tables, checked where cheap: the README's default run against the
    vqa.json it cites, the realized-boundary prefill span against realized.json, the seeds' VQA
    margins in docs/results/compression.md."""
    readme = (ROOT / "README.md").read_text()
    vqa = json.loads((ROOT / runs.RUN_VQA).read_text())
    row = next(line for line in readme.splitlines() if line.startswith("| the default run ("))
    assert f"held-out VQA {pct(vqa['accuracy']['all'])} %" in row
    assert f"{pct(vqa['blind_baseline']['all'])} % blind" in row

    realized = json.loads((ROOT / bench.REALIZED).read_text())
    learned = [
        r
        for r in realized["rows"]
        if r["candidate"] == "more_experts (learned)" and r["setting"]["kind"] == "vqa prompt"
    ]
    got = [r["ratio_vs_baseline"] for r in learned]
    lo, hi = min(got), max(got)
    assert f"{lo:.2f}-{hi:.2f}x the MoE baseline's tokens/s on VQA prompts" in readme

    seeds = runs.seeds({runs.SEEDS: registry.load(ROOT, runs.SEEDS)})
    margins = [
        v["accuracy"]["all"] - max(v["majority_baseline"]["all"], v["blind_baseline"]["all"])
        for v in (s["vqa"] for s in seeds)
    ]
    text = re.sub(r"\s+", " ", (ROOT / "docs/results/compression.md").read_text())
    assert "better baseline is " + " / ".join(pct(m) for m in margins) + " points" in text
