"""What keeps the code readable without scrolling: small files, and lines a reader need not scroll
sideways for.

Prose (comments, docstrings) and code are wrapped at 100 characters; a few code lines may pass it
where breaking would hurt more than it helps (a long literal, a URL), but none passes 120."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HARD_WIDTH = 100, 120
MAX_LINES = 400
MAX_SHARE_OVER_WIDTH = 0.03


def python_files() -> list[Path]:
    # tracked and new files alike (what git does not ignore)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.py"],
                            cwd=ROOT, capture_output=True, text=True)
    names = listed.stdout.split() if listed.returncode == 0 and listed.stdout.strip() else \
        [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    return [ROOT / n for n in names if (ROOT / n).exists()]


def test_no_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split one idea out): {long}"


def test_lines_are_wrapped_at_100_characters():
    total, over, hard = 0, 0, []
    for p in python_files():
        for no, line in enumerate(p.read_text().splitlines(), 1):
            total += 1
            over += len(line) > WIDTH
            if len(line) > HARD_WIDTH:
                hard.append(f"{p.relative_to(ROOT)}:{no} ({len(line)})")
    assert not hard, f"lines over {HARD_WIDTH} characters: {hard}"
    assert over / total <= MAX_SHARE_OVER_WIDTH, \
        f"{over} of {total} lines ({over / total:.1%}) pass {WIDTH} characters"
