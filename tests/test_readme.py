"""README.md's first page: at most 220 lines (issue 52: it had grown to 227), opening with its two
commands (the main job, the tests), and every link it gives into the project reaches a file and,
where it names one, a heading there (the README points at docs/ rather than repeating them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CAP = 220
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {
        slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")
    }


def test_readme_first_page_is_under_its_cap_and_opens_with_its_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= CAP, f"README.md has {len(lines)} lines, over its cap of {CAP}"
    start = lines.index("```bash")  # the first code block: what a reader runs first
    first = lines[start + 1 : lines.index("```", start + 1)]
    commands = [line.split("#")[0].strip() for line in first]
    assert commands == ["make train", "make test"], f"README.md opens with {commands}"


def test_readme_links_reach_a_file_and_heading():
    broken = []
    for target in LINK.findall(README.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / path
        if not page.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and anchor not in anchors(page):
            broken.append(f"{target}: no heading #{anchor} in {path}")
    assert not broken, "README.md links that lead nowhere: " + "; ".join(broken)


def test_readme_points_at_the_scale_features():
    """Each newer part of the system is named on the first page with a link to its docs."""
    text = README.read_text()
    for words, link in [
        ("vlm plan", "docs/training.md#what-fits-where-vlm-plan"),
        ("loader index", "docs/data.md#the-loader-index"),
        ("tiles of tokens", "docs/training.md#memory-the-loss-in-tiles"),
        ("its share", "docs/training.md#building-a-ranks-share"),
        ("variable-size exchange", "docs/training.md#expert-parallelism"),
        ("timeout", "docs/training.md#timeouts"),
        ("SLURM", "docs/training.md#clusters"),
    ]:
        assert words in text and f"({link})" in text, (
            f"README.md does not point {words!r} at {link}"
        )
