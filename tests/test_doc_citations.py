"""Every Markdown file a comment or a docstring cites exists, and so does the passage it names
(issue 52: six modules cited a design document the project does not ship). A cited path is looked
up from the repository's root, then beside the citing file (data_pipelines/ cites its schema by
the file's bare name); a quoted title right after it (`docs/training.md, "Timeouts"`, or
`docs/training.md's "Clusters"`) must be in that file, as a heading or in its text.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path ending in .md, not the tail of a longer path or a URL; then, optionally, the passage
CITED = re.compile(r"""(?<![\w/.*:-])([\w./-]*\w\.md)\b(?:(?:'s)?,?\s+"([^"]+)")?""")
# files the code writes, named where it says so (`vlm experiment --all --out DIR`, the export's
# model card), not documents it cites
WRITTEN = {"DIR/claims.md", "claims.md", "final/README.md"}


def python_files() -> list[Path]:
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"]
    out = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each docstring (any string standing as a statement) and each block of
    consecutive comment lines, joined into one text."""
    src = path.read_text(encoding="utf-8")
    if ".md" not in src:  # most files cite nothing: not parsed
        return []
    out = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if block and line != last + 1:
            out.append((start, " ".join(block)))
            block = []
        if not block:
            start = line
        block.append(tok.string.lstrip("#").strip())
        last = line
    if block:
        out.append((start, " ".join(block)))
    return out


def resolve(cited: str, path: Path) -> Path | None:
    for base in (ROOT, path.parent):
        if (base / cited).is_file():
            return base / cited
    return None


def test_every_cited_markdown_file_and_passage_exists():
    bad = []
    for path in python_files():
        rel = path.relative_to(ROOT)
        for line, text in prose(path):
            for m in CITED.finditer(text):
                cited, passage = m.group(1), m.group(2)
                if cited in WRITTEN:
                    continue
                found = resolve(cited, path)
                if found is None:
                    bad.append(
                        f"{rel}:{line}: cites {cited}, which is neither under the root nor beside it"
                    )
                    continue
                said = " ".join(found.read_text(encoding="utf-8").split())
                if passage and " ".join(passage.split()) not in said:
                    bad.append(
                        f'{rel}:{line}: cites {cited}, "{passage}", which that file does not say'
                    )
    assert not bad, "citations of Markdown that is not there:\n" + "\n".join(bad)
