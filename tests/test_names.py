"""Every shape suffix in the Python code uses a letter of its file's legend.

A tensor's name ends in its shape (`x_BTD`). Each file that uses shape suffixes says which letters
it uses, in a legend right after its module docstring's first paragraph ("Legend: B rows, T tokens,
D width."); the common letters mean what docs/design.md's table says, and a file may define a
letter of its own there (expert_parallel.py's P ranks, ema_scan.py's U scan blocks). The test parses
every identifier of every .py file (names only: strings and comments are not code) and fails on a
suffix letter its file's legend does not name, on a legend entry the file does not use, and on a
legend that is not well formed. It cannot check that a letter is used in its meaning; review does
that.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a lowercase-led name whose last part holds a capital: `x_BTD`, `k_BJCd`, `coords_P2`, `img_13HW`
SUFFIXED = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*_(?P<suffix>[A-Za-z0-9]*[A-Z][A-Za-z0-9]*)$")
SHAPE = re.compile(r"^[A-Z0-9]+[a-z]?$")  # capitals and digits, then at most one per-head size
ENTRY = re.compile(r"^(?P<letter>[A-Za-z]) (?P<meaning>\S.*)$")


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


def _split_top_level(text: str) -> list[str]:
    """`text` cut at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts + [text[start:]]]


def legend(path: Path) -> dict[str, str] | None:
    """letter -> meaning from the file's "Legend:" paragraph (in its module docstring, after the
    first paragraph); None where it has none. A malformed entry raises ValueError."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraphs = doc.split("\n\n")
    found = [p for p in paragraphs[1:] if p.startswith("Legend:")]
    if not found:
        return None
    body = " ".join(found[0].removeprefix("Legend:").split()).removesuffix(".")
    letters = {}
    for entry in _split_top_level(body):
        m = ENTRY.match(entry)
        if not m or m.group("letter") in letters:
            raise ValueError(f"legend entry {entry!r}: one letter, a space, its meaning")
        letters[m.group("letter")] = m.group("meaning")
    return letters


def test_the_table_holds_the_common_letters():
    letters = documented_letters()
    common = {"B", "T", "D", "V", "M", "E", "K", "F", "G", "N", "I", "P", "H", "W", "d"}
    assert common <= set(letters), sorted(letters)
    assert "R" not in letters  # the compression ratio is a value, never a dimension


def test_every_suffix_letter_is_in_its_file_s_legend():
    bad = []
    for path in python_files():
        rel = path.relative_to(ROOT)
        used: dict[str, int] = {}
        for line, name, suffix in suffixed_names(path):
            if not SHAPE.match(suffix):
                bad.append(f"{rel}:{line}: {name} (not a shape)")
            for c in suffix:
                if c.isalpha():
                    used.setdefault(c, line)
        try:
            letters = legend(path)
        except ValueError as e:
            bad.append(f"{rel}: {e}")
            continue
        if letters is None:
            if used:
                bad.append(f"{rel}: uses {''.join(sorted(used))} and has no 'Legend:' paragraph")
            continue
        for c, line in sorted(used.items()):
            if c not in letters:
                bad.append(f"{rel}:{line}: {c} not in the file's legend")
        for c in sorted(set(letters) - set(used)):
            bad.append(f"{rel}: legend names {c}, which no suffix in the file uses")
    more = f"\n... {len(bad) - 30} more" if len(bad) > 30 else ""
    assert not bad, "\n".join(bad[:30]) + more


def test_a_legend_is_read_as_written(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        '"""One line.\n\nLegend: B rows, Y kinds (text, then image), d\nhead width.\n"""\n'
    )
    assert legend(f) == {"B": "rows", "Y": "kinds (text, then image)", "d": "head width"}
    f.write_text('"""One line.\n\nLegend: B rows, two words.\n"""\n')
    try:
        legend(f)
    except ValueError:
        pass
    else:
        raise AssertionError("a malformed entry passed")


def test_suffixes_match_the_tensors_dimensions_at_run_time():
    """A suffix names as many dimensions as its tensor has: every suffixed local of the model's code
    is checked when its function returns, over a forward and a backward of every language-model
    variant of test_state_dict_keys and of the top-k router with mean merging (a name that
    misstated its shape, `n_BM` for a flat [B * (M + 1)] count, was found so)."""
    import sys

    import torch
    from test_state_dict_keys import _lm, variants

    from configs.batch import PackedBatch
    from vlm.model.config import ChunkConfig
    from vlm.model.multimodal import ConceptMoEVLM

    code = str(ROOT / "vlm")
    bad = set()

    def check(frame, event, arg):
        if event != "return" or not frame.f_code.co_filename.startswith(code):
            return
        for name, value in frame.f_locals.items():
            m = SUFFIXED.match(name)
            if m and isinstance(value, torch.Tensor) and value.dim() != len(m.group("suffix")):
                where = f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_code.co_name}"
                bad.add(f"{where}: {name} has shape {tuple(value.shape)}")

    batch = PackedBatch.from_documents([[1, 5, 9, 3, 7, 2], [4, 4, 8]], row_len=12)
    configs = [m for m, vision_cfg in variants().values() if vision_cfg is None]
    configs.append(_lm(chunk=ChunkConfig(router="topk", merge="mean")))
    for model_cfg in configs:
        torch.manual_seed(0)
        model = ConceptMoEVLM(model_cfg, None)
        sys.setprofile(check)
        try:
            model(batch).logits.sum().backward()
        finally:
            sys.setprofile(None)
    assert not bad, "\n".join(sorted(bad))
