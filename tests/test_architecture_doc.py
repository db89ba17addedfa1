"""docs/architecture.md stays true: every file it names exists, and the floors it states hold."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
FILE = r"[A-Za-z0-9_./-]+\.(?:pyi|py|rs|md|toml|js|html|css)(?![A-Za-z])"
SEARCHED = ("pyserve", "rust", "bench", "kernels", "tests", "docs")


def _named_paths(text: str) -> tuple[set[str], set[str]]:
    """(paths with a folder, bare file names). `folder/ (a.py, b.py)` names folder/a.py and folder/b.py."""
    with_folder, bare = set(), set()
    for folder, names in re.findall(r"([A-Za-z0-9_./-]+/) \(([^()]*)\)", text):
        for name in re.findall(FILE, names):
            with_folder.add(folder + name)
        text = text.replace(f"{folder} ({names})", " ")
    for path in re.findall(FILE, text):
        (with_folder if "/" in path else bare).add(path)
    return with_folder, bare


def test_every_file_the_architecture_page_names_exists():
    with_folder, bare = _named_paths(DOC.read_text(encoding="utf-8"))
    assert len(with_folder) > 100
    files = [p.relative_to(ROOT).as_posix() for folder in SEARCHED for p in (ROOT / folder).rglob("*") if p.is_file()]
    # A path may be written from the repository's root, from pyserve/, or after a sibling's folder
    # ("rust/core/src/scheduler.rs, scheduler/step.rs"): it names a file whose path ends so.
    missing = [p for p in sorted(with_folder) if not any(f == p or f.endswith("/" + p) for f in files)]
    names = {f.rsplit("/", 1)[-1] for f in files}
    missing += [name for name in sorted(bare) if name not in names]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def _imports(package: str) -> set[str]:
    """The pyserve modules the files of pyserve/`package` import (at any depth of the file)."""
    import ast

    found = set()
    for path in (ROOT / "pyserve" / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return {m for m in found if m == "pyserve" or m.startswith("pyserve.")}


def test_the_clients_and_the_decision_layer_import_no_engine_module():
    """The page's rules: embeddings, the semantic cache and model choice import no engine module;
    `pyserve eval` and the replica front are HTTP clients, never the engine in process."""
    for package in ("embeddings", "semantic_cache", "model_choice", "eval", "replicas"):
        engine = sorted(m for m in _imports(package) if m == "pyserve" or m.startswith("pyserve.engine"))
        assert not engine, f"pyserve/{package} imports {engine}"


def _package_graph() -> dict[str, set[str]]:
    """pyserve's packages (and top-level modules), each with the others it imports."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "pyserve").iterdir():
        name = path.stem if path.suffix == ".py" else path.name
        if path.name.startswith(("_", ".")) or not (path.is_dir() or path.suffix == ".py"):
            continue
        package = path.name if path.is_dir() else path.stem
        modules = _imports(package) if path.is_dir() else _file_imports(path)
        graph[name] = {m.split(".")[1] for m in modules if m.count(".") >= 1 and m.split(".")[1] != name}
    return {name: {d for d in deps if d in graph} for name, deps in graph.items()}


def _file_imports(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("pyserve.")}


def test_packages_import_one_way():
    """No cycle among pyserve's packages: each stands on the ones below it."""
    graph = _package_graph()
    assert {"engine", "model", "worker", "step", "server"} <= set(graph)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
