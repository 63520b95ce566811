"""The packages are layers: a module imports only its own layer or lower ones (deferred imports included),
and no two modules import each other, directly or round a longer cycle."""
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
    return {"configs": 0, "vision": 1, "data_pipelines": 1, "vlm": 3, "eval": 4}[module.split(".")[0]]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(project module, line) for every import statement anywhere in the file, functions included."""
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
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = resolve(name)
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_no_module_imports_a_higher_layer(graph):
    upward = [f"{m}:{line} imports {t}" for m, deps in graph.items() for t, line in deps if layer(t) > layer(m)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_vision_and_data_pipelines_do_not_import_each_other_both_ways(graph):
    pairs = {(m.split(".")[0], t.split(".")[0]) for m, deps in graph.items() for t, _ in deps}
    assert not {("vision", "data_pipelines"), ("data_pipelines", "vision")} <= pairs


def test_no_import_cycles(graph):
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph[v]:
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
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    """The parser itself: an import inside a function and a relative import are both found."""
    pkg = tmp_path / "data_pipelines"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from vlm.train import trainer\nfrom . import y\n")
    known = {"data_pipelines.x": pkg / "x.py", "data_pipelines.y": pkg / "y.py", "vlm.train.trainer": Path("t.py"),
             "vlm.train": Path("i.py")}
    assert sorted(imports("data_pipelines.x", pkg / "x.py", known)) == [("data_pipelines.y", 3), ("vlm.train.trainer", 2)]
