"""The packages are layers: a module imports only its own layer or lower ones (deferred imports
included), and no two modules import each other, directly or round a longer cycle, a package's
`__init__` included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "vision", "data_pipelines", "vlm", "eval")


def layer(module: str) -> int:
    """Lowest first: the config system; data and vision; the model; the trainer and the CLI; eval."""
    if module.startswith("vlm.model"):
        return 2
    return {"configs": 0, "vision": 1, "data_pipelines": 1, "vlm": 3, "eval": 4}[
        module.split(".")[0]
    ]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(project module, line) for every import statement anywhere in the file, functions
    included. `from P import n` reads P's namespace, so it depends on P itself (a package: its
    `__init__`) as well as on P.n when that is a module: `from eval.experiments import registry`
    runs and reads `eval/experiments/__init__`."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(
                    pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])
                )
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in dict.fromkeys(resolve(name) for name in names):
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_no_module_imports_a_higher_layer(graph):
    upward = [
        f"{m}:{line} imports {t}"
        for m, deps in graph.items()
        for t, line in deps
        if layer(t) > layer(m)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_vision_and_data_pipelines_do_not_import_each_other_both_ways(graph):
    pairs = {(m.split(".")[0], t.split(".")[0]) for m, deps in graph.items() for t, _ in deps}
    assert not {("vision", "data_pipelines"), ("data_pipelines", "vision")} <= pairs


def import_cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every set of modules that import each other (directly or round a longer cycle), each cycle's
    modules sorted and written with the import lines that close it (`a:12 -> b`)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                members = set(comp)
                found.append(
                    sorted(
                        f"{m}:{line} -> {t}" for m in comp for t, line in graph[m] if t in members
                    )
                )

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + ", ".join(c) for c in cycles)


def test_a_cycle_through_a_package_init_is_seen(tmp_path):
    """The shape `eval.experiments` had: its `__init__` imported its `cli`, whose command did `from
    eval.experiments import registry` (deferred): the two import each other through the package."""
    pkg = tmp_path / "eval" / "experiments"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from eval.experiments.cli import add_command\nfrom "
        "eval.experiments.registry import RECIPES\n"
    )
    (pkg / "cli.py").write_text(
        "def add_command(sub):\n    from eval.experiments import registry\n"
    )
    (pkg / "registry.py").write_text("RECIPES = {}\n")
    known = {
        "eval.experiments": pkg / "__init__.py",
        "eval.experiments.cli": pkg / "cli.py",
        "eval.experiments.registry": pkg / "registry.py",
    }
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert import_cycles(graph) == [
        ["eval.experiments.cli:2 -> eval.experiments", "eval.experiments:1 -> eval.experiments.cli"]
    ]
    # the fix: the command lives in cli (the entry point names it there) and __init__ imports
    # nothing from it
    (pkg / "__init__.py").write_text("from eval.experiments.registry import RECIPES\n")
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert import_cycles(graph) == []


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    """The parser itself: an import inside a function and a relative import are both found."""
    pkg = tmp_path / "data_pipelines"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from vlm.train import trainer\nfrom . import y\n")
    known = {
        "data_pipelines.x": pkg / "x.py",
        "data_pipelines.y": pkg / "y.py",
        "vlm.train.trainer": Path("t.py"),
        "vlm.train": Path("i.py"),
    }
    assert sorted(imports("data_pipelines.x", pkg / "x.py", known)) == [
        ("data_pipelines.y", 3),
        ("vlm.train", 2),
        ("vlm.train.trainer", 2),
    ]
