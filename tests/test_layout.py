"""House rules of the source tree: the package's modules import each other one way (no cycle, lazy imports inside
functions included), and no source file passes 600 lines."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":  # installed as sparse_attn.kernels
        parts.insert(0, "sparse_attn")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources():
    return sorted([*(ROOT / "sparse_attn").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def _imports(path: pathlib.Path, name: str, known: set) -> set:
    """The package modules ``path`` imports, at any depth of its syntax tree (``from . import x`` resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_import_cycles():
    paths = {_module_name(p): p for p in _sources()}
    known = set(paths)
    graph = {name: _imports(path, name, known) for name, path in paths.items()}
    # a package's __init__ importing its own submodules is how re-exports work, not a cycle
    graph = {name: {t for t in targets if not name or not t.startswith(name + ".") or paths[name].name != "__init__.py"}
             for name, targets in graph.items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_under_600_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)}: split it by concern"
