"""What every `vlm eval` command checks before its work: one line on stderr and exit 2 for a user's
mistake, found in a second rather than after minutes of evaluation.

- `positive_int`: an argparse type for counts (`--batch-size`, `--limit`, ...): 0 or less is refused
  at parse time.
- `check_model_dir`: `--ckpt` must be an exported model (RUN_DIR/final with its config.json).
- `check_out_file` / `check_out_dir`: `--out` must be writable (its folders are made, a probe
  file is written and removed), checked before the model loads: a result that cannot be saved
  is not computed.
- `load_model`: `vlm.generate.load_eval_model` after `check_model_dir` (a damaged export is refused
  by the loader itself, in one line, through `vlm.cli`'s ConfigError handling).
- `default_data`: the default dataset a command reads (`--data`): one that is there is used; a
  missing one is built only where it was left at its default (with a line saying so first) or
  `--build` asks for it, so that a typo does not build 58 MB at the typo; a folder of other shards
  (an import) is named as such.

Only the standard library at import: `eval/cli.py` imports this while `vlm --help`
builds its parser.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, NoReturn

from configs.arg_types import whole_number


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr, exit 2 (a user's mistake, as argparse and `config error:` exit)."""
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(2)


# argparse type: a count of questions, rows, batches: >= 1
positive_int = whole_number(what="a count")


def check_model_dir(ckpt: str | os.PathLike, prog: str) -> Path:
    path = Path(ckpt)
    if not path.is_dir():
        fail(prog, f"--ckpt {path}: no such directory (expected an exported model, RUN_DIR/final)")
    if not (path / "config.json").is_file():
        fail(
            prog,
            f"--ckpt {path}: no exported model there (expected RUN_DIR/final with config.json)",
        )
    return path


def _why(e: OSError) -> str:
    return e.strerror or str(e)


def _make_dir(folder: Path) -> None:
    """`mkdir -p folder`, where a file in the way is named (mkdir itself only says "File exists")."""
    for p in (folder, *folder.parents):
        if p.exists():
            if not p.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{p} is a file, not a directory")
            break
    folder.mkdir(parents=True, exist_ok=True)


def _probe(folder: Path) -> None:
    """Create and remove a file in `folder`: the one test of writability that holds for root,
    read-only mounts and full disks alike."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".vlm-eval-write-test-"):
        pass


def check_out_file(out: str | os.PathLike | None, prog: str) -> Path | None:
    """`--out FILE` can be written: its folder exists or is made, and a file can be created there
    (an existing FILE is opened for appending, which leaves it as it is)."""
    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        fail(prog, f"--out {path} is a directory; give a file name, e.g. {path / 'result.json'}")
    try:
        _make_dir(path.parent)
        if path.exists():
            open(path, "ab").close()
        else:
            _probe(path.parent)
    except OSError as e:
        fail(prog, f"cannot write --out {path}: {_why(e)}")
    return path


def check_out_dir(out: str | os.PathLike, prog: str) -> Path:
    """`--out DIR` can hold the results: it exists as a folder or is made, and a file can be created in it."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        fail(prog, f"--out {path} is a file; give a directory")
    try:
        _make_dir(path)
        _probe(path)
    except OSError as e:
        fail(prog, f"cannot write --out {path}: {_why(e)}")
    return path


DEFAULT_DATA = "data/default"


def shard_folder(path: Path) -> bool:
    """A folder of webdataset shards (an import's output, not a default dataset)."""
    return path.is_dir() and any(path.glob("*.tar"))


def default_data(
    data: str | None, prog: str, build: bool = False, flag: str = "--data"
) -> Callable[[], Path]:
    """The default dataset folder `data` names (None: DEFAULT_DATA), checked now: one line and exit
    2 for a folder that is something else, or a missing one that was named without `--build`.
    Returns what gives the folder, building it there first when it is missing (called once the
    model has loaded: a mistake found by loading it costs no build)."""
    from data_pipelines.default_dataset import default_info, ensure_default_dataset

    path = Path(data or DEFAULT_DATA)
    if default_info(path):
        return lambda: path
    if path.exists() and not path.is_dir():
        fail(prog, f"{flag} {path} is a file; give the folder of `vlm data build-default`")
    if path.is_dir() and any(p for p in path.iterdir() if not p.name.startswith(".")):
        what = "shards (an import?)" if shard_folder(path) else "files"
        fail(
            prog,
            f"{flag} {path} holds {what} but no default dataset (no default.json); give the "
            "folder of `vlm data build-default`",
        )
    if data is not None and not build:
        fail(
            prog,
            f"{flag} {path} does not exist; add --build to build the default dataset there "
            "(about 58 MB), or give the folder of `vlm data build-default`",
        )

    def built() -> Path:
        print(
            f"{prog}: building the default dataset in {path} (about 58 MB, once)", file=sys.stderr
        )
        return ensure_default_dataset(path)

    return built


def load_model(ckpt: str | os.PathLike, prog: str):
    """The exported model at `ckpt` as an eval.protocol.EvalModel (imports torch and the model)."""
    check_model_dir(ckpt, prog)
    import vlm.generate

    return vlm.generate.load_eval_model(ckpt)
