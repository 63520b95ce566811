"""Every command the README and docs/ show is one the tools accept as written: each `vlm ...` line
in a fenced block parses with the `vlm` parser (options, subcommands and key=value overrides), each
`make TARGET` names a Makefile target and each `python -m MODULE` names an importable module. Usage
synopses (`[--opt N]`, `...`) are not commands and are skipped. The commands that do work (training,
evaluation, conversion) run in the tests that exercise them; this test catches the drift between
what the pages say and what the parser takes."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "eval" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*```")


def commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each shell command in the page's fenced blocks; `a && b` is two commands."""
    out, block, pending, start = [], False, "", 0
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            block, pending = not block, ""
            continue
        if not block:
            continue
        text = line.strip().removeprefix("$ ")
        if not pending:
            start = n
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        text, pending = pending + text, ""
        try:
            words = shlex.split(text, comments=True)
        except ValueError:  # not shell (a Python or YAML block)
            continue
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", ";", "||"):
                if cmd:
                    out.append((start, cmd))
                cmd = []
            else:
                cmd.append(w)
    return out


def shown(kind: str) -> list:
    found = []
    for page in PAGES:
        for n, argv in commands(page):
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the command
                argv = argv[1:]
            if kind == "vlm" and argv[:1] == ["vlm"]:
                if any(w.startswith("[") or w in ("...", "…") or w.endswith("...") for w in argv):
                    continue  # a usage synopsis, not a command
                found.append(pytest.param(argv[1:], id=f"{page.relative_to(ROOT)}:{n}"))
            elif kind == "make" and argv[:1] == ["make"]:
                found += [
                    pytest.param(t, id=f"{page.relative_to(ROOT)}:{n}:{t}")
                    for t in argv[1:]
                    if not t.startswith("-") and "=" not in t
                ]
            elif kind == "python" and argv[:2] in (["python", "-m"], ["python3", "-m"]):
                found.append(pytest.param(argv[2], id=f"{page.relative_to(ROOT)}:{n}"))
    return found


def test_the_pages_show_commands():
    assert len(shown("vlm")) >= 30 and shown("make")  # the extraction itself works


@pytest.mark.parametrize("argv", shown("vlm"))
def test_vlm_command_parses_as_written(argv, capsys):
    from configs.config import parse_args_anywhere
    from vlm.cli import build_parser

    try:
        args = parse_args_anywhere(build_parser(), argv)
    except SystemExit:
        pytest.fail(
            f"`vlm {' '.join(argv)}` is refused by the parser: "
            f"{capsys.readouterr().err.strip().splitlines()[-1:]}"
        )
    assert callable(getattr(args, "func", None))


@pytest.mark.parametrize("target", shown("make"))
def test_make_target_exists(target):
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^{re.escape(target)}\s*:", makefile, re.M), (
        f"the Makefile has no target {target!r}"
    )


@pytest.mark.parametrize("module", shown("python"))
def test_python_module_exists(module):
    assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
