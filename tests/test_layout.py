"""House rules of the source tree: the package's modules import each other one way (no cycle, lazy imports inside
functions included), and so do the benchmark scripts (and their folders), no source file passes 600 lines, test
tolerances come from the one table (``tests/helpers.py``: ``TOL`` and ``EXACT``), and the kernels' shared device
code is kept apart from the host code that builds their arguments."""

import ast
import pathlib
import re

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


def _cycles(paths: dict) -> list:
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
    return cycles


def test_no_import_cycles():
    cycles = _cycles({_module_name(p): p for p in _sources()})
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# benchmarks/ by concern: each folder and the folders its scripts may import from (by file name: a script puts its
# own folder and those it needs on ``sys.path`` itself)
BENCHMARK_FOLDERS = {
    "harness": {"harness"},  # the timing harness and the scripts that time on any device
    "offline": {"offline"},  # static analyses, offline sm_90 builds, interpreter counters and studies
    "gpu": {"gpu", "harness", "offline"},  # the GPU run: its script, the headline, tuning, profiling, the shipped cache
}


def _benchmark_scripts() -> dict:
    scripts = {}
    for folder in BENCHMARK_FOLDERS:
        for path in sorted((ROOT / "benchmarks" / folder).glob("*.py")):
            assert path.stem not in scripts, f"{path.stem}.py in two benchmark folders: imports by file name clash"
            scripts[path.stem] = path
    return scripts


def test_benchmark_folders_are_listed():
    folders = {p.name for p in (ROOT / "benchmarks").iterdir()
               if p.is_dir() and p.name not in ("results", "__pycache__")}
    assert folders == set(BENCHMARK_FOLDERS), "a benchmark folder needs a line in BENCHMARK_FOLDERS"
    assert not list((ROOT / "benchmarks").glob("*.py")), "benchmark scripts live in a folder of BENCHMARK_FOLDERS"


def test_no_import_cycles_among_the_benchmark_scripts():
    """The scripts import each other by file name, across the folders of ``benchmarks/``."""
    cycles = _cycles(_benchmark_scripts())
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_benchmark_folders_import_one_way():
    scripts = _benchmark_scripts()
    wrong = [f"{path.relative_to(ROOT)} imports {target}.py ({scripts[target].parent.name}/)"
             for name, path in scripts.items() for target in sorted(_imports(path, name, set(scripts)))
             if scripts[target].parent.name not in BENCHMARK_FOLDERS[path.parent.name]]
    assert wrong == []


# examples/ by application, one folder each; examples/*.py is what they share (run folders, --device), put on
# ``sys.path`` by each script beside its own folder
EXAMPLE_FOLDERS = ("seq2seq", "sparsify", "context_parallel")


def test_examples_import_their_own_folder_and_what_they_share():
    shared = {p.stem: p for p in sorted((ROOT / "examples").glob("*.py"))}
    scripts = {}
    for path in sorted((ROOT / "examples").glob("*/*.py")):
        assert path.stem not in scripts and path.stem not in shared, f"{path.stem}.py twice in examples/"
        scripts[path.stem] = path
    assert {p.parent.name for p in scripts.values()} == set(EXAMPLE_FOLDERS)
    wrong = [f"{path.relative_to(ROOT)} imports {target}.py ({scripts[target].parent.name}/)"
             for name, path in scripts.items() for target in sorted(_imports(path, name, set(scripts)))
             if scripts[target].parent != path.parent]
    assert wrong == []
    cycles = _cycles({**scripts, **shared})
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_under_600_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)}: split it by concern"


# Test files whose tolerances are migrated to the table separately (others are editing them).
TOLERANCE_SCAN_SKIPPED: dict = {}  # file name -> why it may keep literal tolerances (none today)
# ``atol=`` / ``rtol=`` given a number written at the site (``1e-5``, ``10 * tol``, ``0``).
_LITERAL_TOL = re.compile(r"\b([ar]tol)\s*=\s*([-+]?\.?\d[\w.+-]*)")


def literal_tolerances(text: str) -> list[str]:
    """``line: text`` of each line of ``text`` that sets ``atol=`` / ``rtol=`` to a literal number and has no
    ``# why:`` comment. A zero is the form of a bound, not its size (``rtol=0``: an absolute bound), and passes,
    except both zero: an exact comparison, spelled ``**EXACT`` (or ``torch.equal``)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if "# why:" in line:
            continue
        hits = _LITERAL_TOL.findall(line)
        zeros = {name for name, value in hits if re.fullmatch(r"0(\.0*)?", value)}
        if len(hits) > len(zeros) or zeros == {"atol", "rtol"}:
            found.append(f"{number}: {line.strip()}")
    return found


def _test_files():
    return sorted(p for p in (ROOT / "tests").rglob("*.py")
                  if p.name != "helpers.py" and p.name not in TOLERANCE_SCAN_SKIPPED)


def test_tolerance_scan_catches_literals():
    bad = ["assert_close(a, b, atol=1e-5, rtol=0)",  # why: the scan's own examples
           "assert_close(a, b, rtol=1.3e-6, atol=TOL['x'])",  # why: the scan's own examples
           "allclose(a, b, atol=.5)", "assert_close(a, b, atol=10 * tol, rtol=0)",  # why: the scan's own examples
           "assert_close(a, b, atol=0, rtol=0)"]  # why: the scan's own examples
    good = ["assert_close(a, b, atol=TOL['x'][dtype], rtol=0)", "assert_close(a, b, **EXACT)",
            "assert_close(a, b, atol=0, rtol=TOL['y'])", "assert_close(a, b, atol=1e-3)  # why: a loose sanity bound"]
    assert [hit.split(": ", 1)[1] for hit in literal_tolerances("\n".join(bad + good))] == bad


@pytest.mark.parametrize("path", _test_files(), ids=lambda p: p.name)
def test_tolerances_come_from_the_table(path):
    found = literal_tolerances(path.read_text())
    assert found == [], (f"{path.name}: literal atol/rtol (use TOL / EXACT from tests/helpers.py, or say "
                         "'# why:' on the line):\n" + "\n".join(found))


MAX_HELPER_PARAMS = 15


def _jit_functions(path):
    """``(name, parameter count, launched)`` of every ``@triton.jit`` function of a kernel source file; ``launched``:
    a kernel (a name ending in ``_kernel``), whose parameters are the launch arguments."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node.name, len(node.args.args), node.name.endswith("_kernel")


def test_helper_scan_sees_every_kernel_file():
    found = {name for path in (ROOT / "kernels").rglob("*.py") for name, _, _ in _jit_functions(path)}
    assert {"score_mod", "program_mods", "_entmax_attn_fwd_kernel", "_entmax_decode_split_kernel"} <= found


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernel_helpers_take_at_most_15_parameters(path):
    """Inner ``@triton.jit`` helpers take the program's values as grouped tuples (``mods``, rows, key tiles ...), not
    as loose arguments threaded through every helper (docs/design.md, "The spec in the kernels")."""
    over = [(name, n) for name, n, launched in _jit_functions(path) if not launched and n > MAX_HELPER_PARAMS]
    assert not over, f"{path.relative_to(ROOT)}: {over} take more than {MAX_HELPER_PARAMS} parameters"


def test_shared_device_modules_hold_device_code_only():
    """``kernels/_common.py`` and ``kernels/_masking.py`` hold ``@triton.jit`` functions and the constants they read,
    and import no torch; everything a launcher computes on the host is ``kernels/_args.py`` (docs/design.md)."""
    for name in ("_common.py", "_masking.py"):
        tree = ast.parse((ROOT / "kernels" / name).read_text())
        host = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                and not any("jit" in ast.unparse(d) for d in node.decorator_list)]
        torch = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 and "torch" in ast.unparse(node)]
        assert host == [] and torch == [], f"kernels/{name}: host code {host}, {torch}: move it to kernels/_args.py"


# The import direction (CONTRIBUTING.md, "Layers"), top to bottom: a package imports its own modules and those of
# the packages below it; packages on one line are siblings and do not import each other. A new
# folder needs a line here.
LAYERS = [
    ["sparse_attn.integrations"],
    ["sparse_attn.models"],
    ["sparse_attn.attn"],
    ["sparse_attn.rows"],
    ["sparse_attn"],
    ["sparse_attn.kernels.attn", "sparse_attn.kernels.rows"],
    ["sparse_attn.kernels"],
]


def _package_of(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def test_imports_go_down_the_layers():
    paths = {_module_name(p): p for p in _sources()}
    rank = {pkg: i for i, line in enumerate(LAYERS) for pkg in line}
    unplaced = sorted({_package_of(n, p) for n, p in paths.items()} - set(rank))
    assert unplaced == [], f"packages with no line in LAYERS: {unplaced}"
    wrong = []
    for name, path in sorted(paths.items()):
        if name == "sparse_attn":  # the package's public names: re-exported from every layer
            continue
        own = _package_of(name, path)
        for target in sorted(_imports(path, name, set(paths))):
            theirs = _package_of(target, paths[target])
            if theirs != own and rank[theirs] <= rank[own]:
                wrong.append(f"{name} -> {target}")
    assert wrong == [], "imports against the layers (" + " | ".join(map(str, LAYERS)) + "): " + "; ".join(wrong)


def test_no_merge_conflict_markers():
    """No tracked text file keeps a merge's conflict markers (one once sat unseen inside a docstring)."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".yaml", ".yml", "") and path.is_file():
            text = path.read_text(errors="replace")
            bad += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in marker.finditer(text)]
    assert not bad, f"merge conflict markers at {bad}"


def test_tests_mirror_the_subpackages():
    """Tests of one subpackage live in the folder of its name (``tests/attn/`` for ``sparse_attn.attn`` and
    ``sparse_attn.kernels.attn``, ...); tests of the whole project, and the shared helpers, at the top."""
    subpackages = {p.parent.name for p in (ROOT / "sparse_attn").glob("*/__init__.py")}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders and folders <= subpackages, f"tests/ folders {sorted(folders - subpackages)} are no subpackage"
    assert not list((ROOT / "tests").glob("*/*/test_*.py")), "one folder level under tests/"
