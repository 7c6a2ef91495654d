"""The code's shape, checked: no import cycle between kvtier's modules or packages, no function over 60
lines outside the benchmarks, and an engine step that fits on one screen (issue 8's bar)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        trees[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return trees


def _top_level_imports(tree: ast.Module, known: set[str]) -> set[str]:
    """kvtier modules imported when the module is imported (not inside functions or TYPE_CHECKING)."""
    found: set[str] = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            stack.extend(node.body)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_modules_or_packages() -> None:
    trees = _modules()
    known = set(trees)
    graph = {name: _top_level_imports(tree, known) - {name} for name, tree in trees.items()}
    assert _cycle(graph) is None, f"module import cycle: {' -> '.join(_cycle(graph) or [])}"
    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        top = name.split(".")[1] if "." in name else name
        packages.setdefault(top, set()).update(d.split(".")[1] for d in deps if "." in d)
    packages = {p: deps - {p} for p, deps in packages.items()}
    assert _cycle(packages) is None, f"package import cycle: {' -> '.join(_cycle(packages) or [])}"


def test_functions_fit_on_a_screen() -> None:
    long = []
    for name, tree in _modules().items():
        if name.startswith("kvtier.bench"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 60:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long


def test_engine_step_reads_in_under_30_lines() -> None:
    tree = _modules()["kvtier.engine"]
    (step,) = [
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == "LLMEngine"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "step"
    ]
    assert (step.end_lineno or 0) - step.lineno + 1 < 30


def test_no_merge_conflict_markers_left_behind() -> None:
    root = PACKAGE.parent
    files = [root / "README.md", root / "BENCHMARKS.md", *root.glob("docs/*.md"), *PACKAGE.rglob("*.py")]
    files += [p for p in (root / "tests").glob("*.py") if p.name != "test_structure.py"]
    marked = [
        f"{path.relative_to(root)}:{n}"
        for path in files
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "======="
    ]
    assert not marked, marked
