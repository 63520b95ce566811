"""Every shape suffix in the Python code uses a letter of the table in docs/design.md.

A tensor's name ends in its shape (`x_BTD`); the table gives each letter one meaning. The test reads
the table from the document, so that the two cannot drift, and parses every identifier of every .py
file (names only: strings and comments are not code). It keeps the alphabet closed: a new letter
goes into the table, with its meaning, before the code uses it. It cannot check that a letter is
used in its meaning; review does that.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a lowercase-led name whose last part holds a capital: `x_BTD`, `k_BJCd`, `coords_P2`, `img_13HW`
SUFFIXED = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*_(?P<suffix>[A-Za-z0-9]*[A-Z][A-Za-z0-9]*)$")
SHAPE = re.compile(r"^[A-Z0-9]+[a-z]?$")  # capitals and digits, then at most one per-head size


def documented_letters() -> dict[str, str]:
    """letter -> meaning, from the table under "### Names and shapes" in docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### Names and shapes", 1)[1].split("\n#", 1)[0]
    letters = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for letter in re.findall(r"`([A-Za-z])`", cells[0]):
                letters[letter] = cells[1]
    return letters


def python_files() -> list[Path]:
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"]
    out = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def suffixed_names(path: Path):
    """(line, name, suffix) of every suffixed identifier in the file."""
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME:
            m = SUFFIXED.match(tok.string)
            if m:
                yield tok.start[0], tok.string, m.group("suffix")


def test_the_table_gives_each_letter_one_meaning():
    letters = documented_letters()
    fixed = {"B", "T", "D", "V", "M", "E", "K", "F", "G", "H", "W", "I", "P"}
    assert fixed <= set(letters), sorted(letters)
    assert "R" not in letters  # the compression ratio is a value, never a dimension


def test_every_suffix_letter_is_in_the_table():
    letters = documented_letters()
    bad = []
    for path in python_files():
        for line, name, suffix in suffixed_names(path):
            unknown = sorted({c for c in suffix if c.isalpha() and c not in letters})
            if not SHAPE.match(suffix) or unknown:
                why = f"{', '.join(unknown)} not in docs/design.md" if unknown else "not a shape"
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name} ({why})")
    more = f"\n... {len(bad) - 30} more" if len(bad) > 30 else ""
    assert not bad, "\n".join(bad[:30]) + more
