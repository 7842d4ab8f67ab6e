#!/usr/bin/env python3
"""Group ``sparse_attn/`` and ``kernels/`` into subpackages by concern (issue 27, item 7), on the current git tree.

A one-off, re-runnable on any later tree that still has the flat layout: every step is a rule, not a line edit.

* Every ``.py`` file under ``sparse_attn/`` and ``kernels/`` must be named in :data:`MOVES` (its new folder, or
  ``""``: it stays); an unnamed file stops the run before anything changes (add it to the table). Entries whose
  file does not exist are skipped (a file another branch adds later may be named in advance).
* ``git mv`` of the files; an ``__init__.py`` with the docstring of :data:`FOLDERS` in each new folder.
* Imports inside the package, rewritten from the syntax tree: absolute ``sparse_attn.x`` and relative ``from .x`` /
  ``from . import x`` (recomputed against the file's new folder, relative stays relative), and string constants that
  are exactly an old module path (``load_kernel("sparse_attn._triton_rows", ...)``). Docstrings and comments keep
  the dotted old paths: those stay valid public paths (below).
* File paths in text (``kernels/_threshold.py``, ``sparse_attn/attention.py``) in every tracked text file except
  recorded results (``benchmarks/results/``) and paths after a commit (``1db67ff:kernels/x.py``).
* The old module paths keep importing the same module objects: ``sparse_attn/_old_paths.py`` (generated: the table
  and a ``sys.meta_path`` finder, plus ``__getattr__`` on ``sparse_attn`` and ``sparse_attn.kernels``), so
  ``import sparse_attn.mappings as m; monkeypatch.setattr(m, ...)`` patches the module the package uses.
* ``pyproject.toml``: ``packages`` lists every package folder; ``tests/test_layout.py``: the import-direction test
  (:data:`LAYERS`); ``tests/test_old_paths.py``: every old path gives the same objects; the layout sections of
  README.md, CONTRIBUTING.md and docs/design.md (generated from the folders as they are after the move).
* ``ruff check --select I --fix`` on the rewritten files (import order), then ``ruff check`` on them.

Usage (from the repository root, on a clean tree; the venv's python so ruff is found)::

    .venv/bin/python tools/relayout.py            # apply (stages everything with git add; commit yourself)
    .venv/bin/python tools/relayout.py --dry-run  # print the moves and stop

A tree that already has the new layout (``sparse_attn/_old_paths.py`` exists) is refused.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import textwrap
import tokenize
from io import StringIO
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------------
# The table: every source file of the package and the folder it goes to ("" = stays where it is).
# ---------------------------------------------------------------------------------------------------------------
MOVES = {
    # sparse_attn/ top: the public names, the shared argument checks, the version (the base every layer may import)
    "sparse_attn/__init__.py": "",
    "sparse_attn/_version.py": "",
    "sparse_attn/_validation.py": "",
    # the row-wise toolbox
    "sparse_attn/mappings.py": "sparse_attn/rows",
    "sparse_attn/losses.py": "sparse_attn/rows",
    "sparse_attn/structured.py": "sparse_attn/rows",
    "sparse_attn/constrained.py": "sparse_attn/rows",
    "sparse_attn/_structured_rows.py": "sparse_attn/rows",
    "sparse_attn/_triton_rows.py": "sparse_attn/rows",
    "sparse_attn/_dispatch.py": "sparse_attn/rows",
    # the attention machinery
    "sparse_attn/attention.py": "sparse_attn/attn",
    "sparse_attn/attn_inputs.py": "sparse_attn/attn",
    "sparse_attn/routes.py": "sparse_attn/attn",
    "sparse_attn/masks.py": "sparse_attn/attn",
    "sparse_attn/_attn_autograd.py": "sparse_attn/attn",
    "sparse_attn/reference.py": "sparse_attn/attn",
    "sparse_attn/_cpu_chunked.py": "sparse_attn/attn",
    "sparse_attn/decode.py": "sparse_attn/attn",
    "sparse_attn/_kv_cache.py": "sparse_attn/attn",  # decode's cache checks (prepare_attention's kv_cache option)
    # the model-facing layer (context parallelism wraps the modules: it imports modules.py and stats.py)
    "sparse_attn/modules.py": "sparse_attn/models",
    "sparse_attn/_head_alpha.py": "sparse_attn/models",
    "sparse_attn/sdpa.py": "sparse_attn/models",
    "sparse_attn/_sdpa_callers.py": "sparse_attn/models",
    "sparse_attn/stats.py": "sparse_attn/models",
    "sparse_attn/distributed.py": "sparse_attn/models",
    "sparse_attn/_cp_layout.py": "sparse_attn/models",
    "sparse_attn/_cp_shard.py": "sparse_attn/models",
    # Hugging Face: already a folder of its own
    "sparse_attn/integrations/__init__.py": "",
    "sparse_attn/integrations/hf.py": "",
    # kernels/ top: what every kernel shares
    "kernels/__init__.py": "",
    "kernels/_common.py": "",
    "kernels/_masking.py": "",
    "kernels/_spec.py": "",
    # attention kernels
    "kernels/entmax_attn_fwd.py": "kernels/attn",
    "kernels/_fwd_rows.py": "kernels/attn",
    "kernels/entmax_attn_bwd.py": "kernels/attn",
    "kernels/_bwd_tiles.py": "kernels/attn",
    "kernels/entmax_decode.py": "kernels/attn",
    "kernels/_decode_state.py": "kernels/attn",
    "kernels/_threshold.py": "kernels/attn",
    # row kernels
    "kernels/row_entmax.py": "kernels/rows",
    "kernels/structured.py": "kernels/rows",
}

# Folder -> what it holds (the docstring of its __init__.py and the line of the layout pictures).
FOLDERS = {
    "sparse_attn": "the public names, argument checks (the base of every layer), the old module paths",
    "sparse_attn/integrations": "Hugging Face transformers (`attn_implementation=\"entmax\"`)",
    "sparse_attn/models": "the model-facing layer: drop-in modules, per-head alpha, SDPA interception, head "
                          "statistics, context parallelism",
    "sparse_attn/attn": "the attention machinery: the public call, the argument gate, routes, masks, the fused "
                        "kernels' autograd wiring, the reference, the CPU path, decode",
    "sparse_attn/rows": "the row-wise toolbox: sparse mappings, Fenchel-Young losses, structured and constrained "
                        "mappings, the row kernels' autograd wiring",
    "kernels": "what every kernel shares: interpreter switches, loads, math helpers, masks and tile ranges",
    "kernels/attn": "the attention kernels: forward, backward, decode and their tile-level helpers",
    "kernels/rows": "the row kernels: alpha-entmax rows, TV prox, isotonic regression",
}

# The import direction, top to bottom: a package imports its own modules and those of the packages below it.
# Packages on one line are siblings and do not import each other. ``sparse_attn/__init__.py`` re-exports from
# every layer and is exempt. (Written into tests/test_layout.py.)
LAYERS = [
    ["sparse_attn.integrations"],
    ["sparse_attn.models"],
    ["sparse_attn.attn"],
    ["sparse_attn.rows"],
    ["sparse_attn"],
    ["sparse_attn.kernels.attn", "sparse_attn.kernels.rows"],
    ["sparse_attn.kernels"],
]

PACKAGE_DIRS = ("sparse_attn", "kernels")
# recorded outputs keep the paths they were made with; this script keeps the old paths it maps
SKIP_TEXT = ("benchmarks/results/", "docs/images/", "tools/relayout.py")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml", ""}
ALIAS_MODULE = "sparse_attn/_old_paths.py"


def fail(msg: str) -> None:
    sys.exit(f"relayout: {msg}")


def git(*args: str, root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def module_name(path: str) -> str:
    """Dotted module name of a repository path (``kernels/`` is installed as ``sparse_attn.kernels``)."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[0] == "kernels":
        parts.insert(0, "sparse_attn")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def new_path(path: str) -> str:
    folder = MOVES[path]
    return path if not folder else f"{folder}/{Path(path).name}"


# ---------------------------------------------------------------------------------------------------------------
# Inventory
# ---------------------------------------------------------------------------------------------------------------
def tree_files(root: Path) -> list[str]:
    """Tracked and untracked (not ignored) files, symlinks excluded (the worktree's ``sparse_attn/kernels``)."""
    out = git("ls-files", "-co", "--exclude-standard", root=root).splitlines()
    return sorted(p for p in out if (root / p).exists() and not (root / p).is_symlink())


def inventory(root: Path, files: list[str]) -> list[str]:
    sources = [p for p in files if p.split("/")[0] in PACKAGE_DIRS]
    unmapped = [p for p in sources if p not in MOVES]
    if unmapped:
        fail("files not in the MOVES table (name their folder at the top of tools/relayout.py):\n  "
             + "\n  ".join(unmapped))
    for folder in {f for f in MOVES.values() if f}:
        if folder not in FOLDERS:
            fail(f"folder {folder} has no line in FOLDERS")
    return sources


# ---------------------------------------------------------------------------------------------------------------
# Import rewriting (package sources)
# ---------------------------------------------------------------------------------------------------------------
class Rewriter:
    def __init__(self, old_to_new: dict, known_old: set):
        self.map = old_to_new  # old dotted module -> new dotted module (moved ones only)
        self.known = known_old  # every old module and package name

    def mod(self, name: str) -> str:
        return self.map.get(name, name)

    @staticmethod
    def relative(from_pkg: str, target: str) -> tuple[int, str]:
        """``(level, module)`` of a relative import of ``target`` from a module of package ``from_pkg``."""
        p, t = from_pkg.split("."), target.split(".")
        common = 0
        while common < min(len(p), len(t)) and p[common] == t[common]:
            common += 1
        return len(p) - common + 1, ".".join(t[common:])

    def rewrite(self, text: str, old_mod: str, new_mod: str, is_pkg: bool, where: str) -> str:
        tree = ast.parse(text)
        old_pkg = old_mod if is_pkg else old_mod.rpartition(".")[0]
        new_pkg = new_mod if is_pkg else new_mod.rpartition(".")[0]
        lines = text.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line))

        def pos(lineno, col):  # ast columns are UTF-8 byte offsets
            line = lines[lineno - 1]
            return offsets[lineno - 1] + len(line.encode()[:col].decode())

        edits = []  # (start, end, replacement)
        in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                seg_start, seg_end = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
                seg = text[seg_start:seg_end]
                new_seg = seg
                for alias in node.names:
                    if alias.name in self.map:
                        if alias.asname is None:
                            fail(f"{where}:{node.lineno}: `import {alias.name}` without `as` (the code then spells "
                                 "the dotted path): rewrite it as `from ... import ...` first")
                        new_seg = re.sub(rf"(?<![\w.]){re.escape(alias.name)}(?![\w.])", self.map[alias.name],
                                         new_seg)
                if new_seg != seg:
                    edits.append((seg_start, seg_end, new_seg))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = old_pkg.split(".")[: len(old_pkg.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("sparse_attn"):
                    continue
                subs = [a for a in node.names if f"{base}.{a.name}" in self.known]
                if subs and len(subs) != len(node.names):
                    fail(f"{where}:{node.lineno}: mixes submodules and names in one import; split it first")
                if subs:  # from pkg import module, ...: group by the modules' new packages
                    groups: dict = {}
                    for a in node.names:
                        groups.setdefault(self.mod(f"{base}.{a.name}").rpartition(".")[0], []).append(a)
                else:
                    groups = {self.mod(base): list(node.names)}
                specs = []
                for target, names in groups.items():
                    if node.level:
                        level, rest = self.relative(new_pkg, target)
                        spec = "." * level + rest
                    else:
                        spec = target
                    specs.append((spec, names))
                old_spec = "." * node.level + (node.module or "")
                if len(specs) == 1 and specs[0][0] == old_spec:
                    continue
                seg_start, seg_end = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
                seg = text[seg_start:seg_end]
                if len(specs) == 1:
                    new_seg = re.sub(r"^from\s+[.\w]+\s+import", f"from {specs[0][0]} import", seg, count=1)
                    if new_seg == seg:
                        fail(f"{where}:{node.lineno}: cannot find the module of `{seg[:60]}`")
                else:
                    if "#" in seg:
                        fail(f"{where}:{node.lineno}: an import to split holds a comment: split it by hand first")
                    indent = " " * node.col_offset
                    new_seg = f"\n{indent}".join(
                        f"from {spec} import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "")
                                                          for a in names)
                        for spec, names in specs)
                edits.append((seg_start, seg_end, new_seg))
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in self.map
                  and id(node) not in in_fstrings):
                seg_start, seg_end = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
                seg = text[seg_start:seg_end]
                edits.append((seg_start, seg_end, seg.replace(node.value, self.map[node.value])))
        for start, end, new in sorted(edits, reverse=True):
            text = text[:start] + new + text[end:]
        return text


# ---------------------------------------------------------------------------------------------------------------
# Text rewriting (file paths, everywhere)
# ---------------------------------------------------------------------------------------------------------------
def path_rewriter(path_map: dict):
    """A function rewriting ``kernels/x.py``-style paths of moved files (``sparse_attn/kernels/x`` too)."""
    pattern = re.compile(r"(?<![\w./\-])(?<![0-9a-f]:)(sparse_attn/kernels|sparse_attn|kernels)/(\w+)(?![\w/])")

    def sub(m):
        folder = "kernels" if m.group(1) == "sparse_attn/kernels" else m.group(1)
        old = f"{folder}/{m.group(2)}.py"
        if old not in path_map or path_map[old] == old:
            return m.group(0)
        new_folder = str(Path(path_map[old]).parent)
        prefix = "sparse_attn/" if m.group(1) == "sparse_attn/kernels" else ""
        return f"{prefix}{new_folder}/{m.group(2)}"

    return lambda text: pattern.sub(sub, text)


def wrap_long_lines(text: str, where: str, limit: int = 120) -> str:
    """Wrap the lines a longer path pushed over ``limit``: comment lines and lines of triple-quoted strings only
    (``ruff --select I --fix`` wraps the imports later)."""
    lines = text.splitlines(keepends=True)
    if all(len(line.rstrip("\n")) <= limit for line in lines):
        return text
    in_string = set()
    for tok in tokenize.generate_tokens(StringIO(text).readline):
        if tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            in_string |= set(range(tok.start[0], tok.end[0] + 1))
    out = []
    for number, line in enumerate(lines, 1):
        body = line.rstrip("\n")
        if len(body) <= limit or "noqa: E501" in body or body.lstrip().startswith(("from ", "import ")):
            out.append(line)
            continue
        indent = body[: len(body) - len(body.lstrip())]
        if body.lstrip().startswith("#"):
            prefix = indent + "# "
            words = body.lstrip()[1:].strip()
            first = indent + "# "
        elif number in in_string:
            prefix = indent
            words = body.strip()
            first = indent
        else:
            fail(f"{where}:{number}: over {limit} characters after the rewrite, in code: shorten it by hand")
        out.append("\n".join(textwrap.wrap(words, width=limit, initial_indent=first, subsequent_indent=prefix,
                                            break_long_words=False, break_on_hyphens=False)) + "\n")
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# Generated files and sections
# ---------------------------------------------------------------------------------------------------------------
ALIAS_TEMPLATE = '''"""The module paths of the flat layout, kept: ``sparse_attn.mappings``, ``sparse_attn.masks``, ...

The package was grouped into subpackages by concern (``rows/``, ``attn/``, ``models/``, ``kernels/attn/``,
``kernels/rows/``; docs/design.md). Every module path that existed before stays importable and gives the *same*
module object as its new path (not a copy and not a re-export), so ``import sparse_attn.mappings as m`` and
``monkeypatch.setattr(m, "x", ...)`` see and patch what the package itself uses. :func:`install` (called by
``sparse_attn/__init__.py``) puts a finder on ``sys.meta_path`` that maps an old name to the loaded new module, and a
module ``__getattr__`` on ``sparse_attn`` and ``sparse_attn.kernels`` so ``sparse_attn.mappings`` works as an
attribute too. Code inside the package imports the new paths (tests/test_layout.py checks the direction);
tests/test_old_paths.py checks every entry of :data:`OLD_PATHS`. Generated by tools/relayout.py.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD_PATHS = {
{entries}
}
"""Old module path -> the module's path now."""


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module of its new path (imported if needed), which keeps its own ``__spec__``."""

    def __init__(self, target: str):
        self._target = target

    def create_module(self, spec):
        module = importlib.import_module(self._target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._own_spec  # the import system set the old name's spec after create_module


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = OLD_PATHS.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def _package_getattr(package: str):
    def __getattr__(name: str):
        if f"{package}.{name}" in OLD_PATHS:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), ``__getattr__`` on the packages that held the old modules."""
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        # first: an old name is this alias, never a file some other finder could still find (an older install)
        sys.meta_path.insert(0, _OldPathFinder())
    for package in sorted({old.rpartition(".")[0] for old in OLD_PATHS}):
        module = sys.modules.get(package) or importlib.import_module(package)
        module.__getattr__ = _package_getattr(package)
'''

INIT_HOOK = '''
# The module paths of the flat layout (sparse_attn.mappings, sparse_attn.kernels.entmax_attn_fwd, ...) keep importing
# the same module objects (sparse_attn/_old_paths.py).
from sparse_attn._old_paths import install as _install_old_paths  # noqa: E402

_install_old_paths()
'''

LAYOUT_TEST = '''

# The import direction (CONTRIBUTING.md, "Layers"), top to bottom: a package imports its own modules and those of
# the packages below it; packages on one line are siblings and do not import each other. Generated by
# tools/relayout.py; a new folder needs a line here.
LAYERS = [
{layers}
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
'''

OLD_PATHS_TEST = '''"""The module paths of the flat layout (before the subpackages) are the modules of the new paths.

``sparse_attn/_old_paths.py`` holds the table; these tests import every old path (in this process, and in a fresh
one where nothing is imported yet), patch through one, and resolve every dotted name of a moved module that the
README, the docs, the examples, the benchmarks and the tests spell.
"""

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import sparse_attn
from sparse_attn._old_paths import OLD_PATHS

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_is_the_new_module(old):
    new = OLD_PATHS[old]
    module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is module
    assert module.__name__ == new and module.__spec__.name == new
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is module


def test_old_paths_in_a_fresh_process():
    code = "; ".join([
        "import importlib, sys",
        "import sparse_attn.kernels.entmax_attn_fwd as a",
        "from sparse_attn.kernels import entmax_decode",
        "from sparse_attn import mappings",
        "import sparse_attn.attention as att",
        "import sparse_attn",
        f"table = {dict(OLD_PATHS)!r}",
        "assert all(importlib.import_module(o) is importlib.import_module(n) for o, n in table.items())",
        "assert a is sys.modules['sparse_attn.kernels.attn.entmax_attn_fwd'] and att.entmax_attention is "
        "sparse_attn.entmax_attention",
        "assert entmax_decode.__name__ == 'sparse_attn.kernels.attn.entmax_decode' and mappings.entmax is "
        "sparse_attn.entmax",
    ])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_patch_through_an_old_path_reaches_the_package(monkeypatch):
    import sparse_attn.mappings as old
    import sparse_attn.rows.mappings as new

    monkeypatch.setattr(old, "TRITON_MIN_ROW", 3)
    assert new.TRITON_MIN_ROW == 3
    monkeypatch.setattr("sparse_attn.attention.chunked_attention", None)
    assert importlib.import_module(OLD_PATHS["sparse_attn.attention"]).chunked_attention is None


def test_unknown_names_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("sparse_attn.no_such_module")
    with pytest.raises(AttributeError):
        sparse_attn.no_such_module  # noqa: B018
    with pytest.raises(AttributeError):
        sparse_attn.kernels.no_such_module  # noqa: B018


def _spelled_names():
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("examples", "benchmarks", "tests"):
        texts += sorted((ROOT / folder).glob("*.py"))
    found = set()
    for path in texts:
        found |= set(re.findall(r"\\bsparse_attn(?:\\.\\w+)+", path.read_text(encoding="utf-8")))
    return sorted(name for name in found
                  if any(name == old or name.startswith(old + ".") for old in OLD_PATHS))


@pytest.mark.parametrize("name", _spelled_names())
def test_spelled_old_names_resolve(name):
    old = max((o for o in OLD_PATHS if name == o or name.startswith(o + ".")), key=len)
    obj = importlib.import_module(old)
    for attr in name[len(old) + 1:].split(".") if name != old else []:
        obj = getattr(obj, attr)
'''


def layout_picture(root: Path, width: int = 118, indent: int = 20) -> str:
    """The folders after the move, top to bottom in import order: what each holds, then its modules."""

    def modules(folder: str) -> list[str]:
        names = [Path(p).stem for p in MOVES
                 if (root / new_path(p)).exists() and str(Path(new_path(p)).parent) == folder]
        extra = sorted(p.stem for p in (root / folder).glob("*.py") if p.stem not in names)
        return [n + ".py" for n in names + extra if n != "__init__"]

    order = {pkg: i for i, line in enumerate(LAYERS) for pkg in line}
    rows = []
    for top in PACKAGE_DIRS:
        subs = sorted((f for f in FOLDERS if f.startswith(top + "/")),
                      key=lambda f: order[module_name(f + "/__init__.py")])
        rows.append((top + "/", "│", top))
        for i, f in enumerate(subs):
            last = i == len(subs) - 1
            rows.append((("└── " if last else "├── ") + f.split("/", 1)[1] + "/", "" if last else "│", f))
    out = []
    for label, cont, folder in rows:
        what = FOLDERS[folder].replace("`", "")
        if folder == "kernels":
            what = "(installed as sparse_attn.kernels) " + what
        chunks = textwrap.wrap(what, width - indent) + textwrap.wrap(", ".join(modules(folder)), width - indent)
        for i, chunk in enumerate(chunks):
            out.append(f"{(label if i == 0 else cont):<{indent}}{chunk}".rstrip())
    return "```\n" + "\n".join(out) + "\n```\n"


LAYER_RULE_MD = (
    "Imports go one way, top to bottom: `sparse_attn/integrations/` → `sparse_attn/models/` → `sparse_attn/attn/` → "
    "`sparse_attn/rows/` → the top of `sparse_attn/` (`_validation.py`) → `kernels/attn/`, `kernels/rows/` "
    "(siblings: neither imports the other) → the top of `kernels/` (`_common.py`, `_masking.py`). A package imports "
    "its own modules and those below it; `sparse_attn/__init__.py` re-exports from every layer. "
    "`tests/test_layout.py::test_imports_go_down_the_layers` enforces it (lazy imports inside functions included); "
    "a new folder needs a line in its `LAYERS`.")
LAYER_RULE_MD = textwrap.fill(LAYER_RULE_MD, width=118, break_on_hyphens=False, break_long_words=False)


def contributing_section(root: Path) -> str:
    return f"""
{LAYER_RULE_MD}

{layout_picture(root)}
* `kernels/` holds Triton code and its launchers only: it imports `torch`, `triton` and itself
  (relative imports), never `torch.nn`, the reference or anything from `sparse_attn/`.
* `sparse_attn/attn/reference.py` imports only torch, the mappings, the input structure, the mask conventions and
  the checks: it is the oracle and never touches a kernel.
* `sparse_attn/models/stats.py` never imports an integration: integrations register themselves with
  `stats.register_layer_type` (a visible import of `stats` from the integration).
* The module paths of the flat layout (`sparse_attn.mappings`, `sparse_attn.kernels.entmax_attn_fwd`, ...) stay
  importable as the same module objects (`sparse_attn/_old_paths.py`, tested by `tests/test_old_paths.py`); code
  inside the package imports the new paths.
* Tests import the package and `tests/helpers.py`, never another test module.

"""


def design_section(root: Path) -> str:
    return f"""## Folders and the import direction

{LAYER_RULE_MD}
`kernels/` (installed as `sparse_attn.kernels`) holds Triton code only and never imports `torch.nn` or the
reference. No import cycle, no source file over 600 lines (`tests/test_layout.py`). The module paths of the flat
layout stay importable as the same objects (`sparse_attn/_old_paths.py`).

{layout_picture(root)}
"""


def readme_section(root: Path) -> str:
    return f"""
{layout_picture(root)}
The subpackages are layers, imported top to bottom only (CONTRIBUTING.md, "Layers"); the public names are
`sparse_attn.*`, and every module path of the earlier flat layout (`sparse_attn.mappings`, `sparse_attn.reference`,
`sparse_attn.kernels.entmax_attn_fwd`, ...) still imports the same module. The route table
`sparse_attn/attn/routes.py` says which variants SDPA, the decode kernels, the fused kernels, the reference and
context parallelism run (a call with a variant its route does not list raises `ValueError` naming both);
`kernels/_masking.py` which keys a query sees and the tile ranges; `kernels/attn/_threshold.py` the threshold
algorithm of the forward and the decode kernels. `tests/` (`helpers.py`: input builders, the one tolerance table
and rule), `benchmarks/`, `examples/`, `docs/` (`design.md` internal contracts, `kernels.md` forward derivation and
measurements, `backward.md` backward and α-gradient, `decode.md` the split-K decode kernels, `scaling.md` context
and head parallelism, `sparsify.md` the pretrained-model example).

"""


def replace_section(text: str, heading: str, body: str, must_start: str, where: str) -> str:
    """Replace the body of the ``## heading`` section (up to the next ``## ``) by ``body``."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## )", text, flags=re.S | re.M)
    if not m:
        fail(f"{where}: no section '## {heading}'")
    if must_start not in m.group(1):
        fail(f"{where}: section '## {heading}' changed since the script was written (no '{must_start}'): "
             "update its template in tools/relayout.py")
    return text[:m.start(1)] + body + text[m.end(1):]


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the moves and stop")
    ap.add_argument("--allow-dirty", action="store_true", help="run on a tree with uncommitted changes")
    args = ap.parse_args()
    root = Path(git("rev-parse", "--show-toplevel", root=Path.cwd()).strip())
    if (root / ALIAS_MODULE).exists():
        fail(f"{ALIAS_MODULE} exists: this tree already has the new layout")
    if not args.allow_dirty and git("status", "--porcelain", "--untracked-files=no", root=root).strip():
        fail("uncommitted changes (commit them, or pass --allow-dirty)")

    files = tree_files(root)
    sources = inventory(root, files)
    absent = sorted(p for p in MOVES if p not in sources)
    moved = {p: new_path(p) for p in sources if MOVES[p]}
    path_map = {p: new_path(p) for p in sources}
    old_to_new = {module_name(p): module_name(q) for p, q in moved.items()}
    print(f"relayout: {len(sources)} sources, {len(moved)} to move, table entries absent here: {absent or 'none'}")
    for p, q in moved.items():
        print(f"  {p} -> {q}")
    if args.dry_run:
        return

    known_old = {module_name(p) for p in sources}
    known_old |= {m.rpartition(".")[0] for m in known_old}
    rewriter = Rewriter(old_to_new, known_old)
    paths = path_rewriter(path_map)

    # 1. new contents, computed against the old locations
    contents = {}
    for p in sources:
        text = (root / p).read_text(encoding="utf-8")
        if p.endswith(".py"):
            text = rewriter.rewrite(text, module_name(p), module_name(path_map[p]), p.endswith("__init__.py"), p)
        contents[p] = wrap_long_lines(paths(text), p) if p.endswith(".py") else paths(text)
    for p in files:
        if p in contents or p.startswith(SKIP_TEXT) or Path(p).suffix not in TEXT_SUFFIXES:
            continue
        try:
            text = (root / p).read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        new = paths(text)
        if new != text:
            contents[p] = wrap_long_lines(new, p) if p.endswith(".py") else new

    # 2. the moves, then the contents at the new places
    for folder in sorted({f for f in MOVES.values() if f}):
        (root / folder).mkdir(parents=True, exist_ok=True)
    tracked = set(git("ls-files", root=root).splitlines())
    for p, q in moved.items():
        if p in tracked:
            git("mv", p, q, root=root)
        else:
            os.replace(root / p, root / q)
    touched = set()
    for p, text in contents.items():
        target = path_map.get(p, p)
        if (root / target).read_text(encoding="utf-8") != text:
            (root / target).write_text(text, encoding="utf-8")
            touched.add(target)
    touched |= set(moved.values())

    # 3. the new packages' __init__.py
    for folder in sorted({f for f in MOVES.values() if f}):
        init = root / folder / "__init__.py"
        if not init.exists():
            what = FOLDERS[folder][0].upper() + FOLDERS[folder][1:].replace("`", "``")
            doc = textwrap.fill(f'"""{what}.', width=120, break_on_hyphens=False)
            init.write_text(f'{doc}\n\nLayer rules: CONTRIBUTING.md, "Layers"; the picture: docs/design.md.\n"""\n',
                            encoding="utf-8")
            touched.add(f"{folder}/__init__.py")

    # 4. the old paths
    entries = "\n".join(f'    "{o}": "{n}",' for o, n in sorted(old_to_new.items()))
    (root / ALIAS_MODULE).write_text(ALIAS_TEMPLATE.replace("{entries}", entries), encoding="utf-8")
    init = root / "sparse_attn/__init__.py"
    init.write_text(init.read_text(encoding="utf-8").rstrip("\n") + "\n" + INIT_HOOK, encoding="utf-8")
    touched |= {ALIAS_MODULE, "sparse_attn/__init__.py"}

    # 5. pyproject: every package folder
    packages = sorted({module_name(str(p.relative_to(root))) for d in PACKAGE_DIRS
                       for p in (root / d).rglob("__init__.py") if "__pycache__" not in p.parts},
                      key=lambda s: (s.count("."), s))
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    listed = "packages = [\n" + "".join(f'    "{p}",\n' for p in packages) + "]"
    new = re.sub(r"^packages = \[[^\]]*\]", listed, text, count=1, flags=re.M)
    if new == text and "sparse_attn.rows" not in text:
        fail("pyproject.toml: no `packages = [...]` line")
    pyproject.write_text(new, encoding="utf-8")
    touched.add("pyproject.toml")

    # 6. tests
    layout = root / "tests/test_layout.py"
    text = layout.read_text(encoding="utf-8")
    if "def test_imports_go_down_the_layers" in text:
        fail("tests/test_layout.py already has the layer test")
    layers = "\n".join(f"    {line!r}," for line in LAYERS).replace("'", '"')
    layout.write_text(text.rstrip("\n") + "\n" + LAYOUT_TEST.replace("{layers}", layers), encoding="utf-8")
    (root / "tests/test_old_paths.py").write_text(OLD_PATHS_TEST, encoding="utf-8")
    touched |= {"tests/test_layout.py", "tests/test_old_paths.py"}

    # 7. precompile's source hash: every kernel file, by its path under kernels/
    pre = root / "benchmarks/precompile.py"
    if pre.exists():
        text = pre.read_text(encoding="utf-8")
        new = text.replace('for path in sorted((ROOT / "kernels").glob("*.py")):\n        h.update(path.name.encode()',
                           'for path in sorted((ROOT / "kernels").rglob("*.py")):\n'
                           '        h.update(path.relative_to(ROOT / "kernels").as_posix().encode()')
        if new == text:
            fail("benchmarks/precompile.py: kernels_digest no longer reads `(ROOT / \"kernels\").glob(\"*.py\")`: "
                 "make it hash kernels/**/*.py by hand and drop this step")
        new = new.replace("kernels/*.py", "kernels/**/*.py")
        pre.write_text(new, encoding="utf-8")
        touched.add("benchmarks/precompile.py")
    for doc in ("benchmarks/README.md",):
        if (root / doc).exists():
            text = (root / doc).read_text(encoding="utf-8")
            if "kernels/*.py" in text:
                (root / doc).write_text(text.replace("kernels/*.py", "kernels/**/*.py"), encoding="utf-8")
                touched.add(doc)

    # 8. the layout sections of the docs
    readme = root / "README.md"
    readme.write_text(replace_section(readme.read_text(encoding="utf-8"), "Layout", readme_section(root),
                                      "`sparse_attn/` (PyTorch-facing API", "README.md"), encoding="utf-8")
    contrib = root / "CONTRIBUTING.md"
    contrib.write_text(replace_section(contrib.read_text(encoding="utf-8"), "Layers: what each folder may import",
                                       contributing_section(root), "Imports flow one way", "CONTRIBUTING.md"),
                       encoding="utf-8")
    design = root / "docs/design.md"
    text = design.read_text(encoding="utf-8")
    m = re.search(r" Imports flow one way:.*?\n\n", text, flags=re.S)
    if not m:
        fail("docs/design.md: the intro's 'Imports flow one way: ...' paragraph changed: update the script")
    text = text[:m.start()] + " The folders and the import direction: below.\n\n" + design_section(root) + \
        text[m.end():]
    design.write_text(text, encoding="utf-8")
    touched |= {"README.md", "CONTRIBUTING.md", "docs/design.md"}

    # 9. import order and lint of the Python files touched
    py = sorted(p for p in touched if p.endswith(".py") and (root / p).exists())
    ruff = [sys.executable, "-m", "ruff", "check"]
    subprocess.run([*ruff, "--select", "I", "--fix", "--quiet", *py], cwd=root, check=False)
    lint = subprocess.run([*ruff, *py], cwd=root, capture_output=True, text=True)
    git("add", "-A", "--", *sorted(touched), root=root)
    if lint.returncode:
        print(lint.stdout + lint.stderr)
        fail("ruff finds problems in the rewritten files (above); the tree is relaid out and staged: fix them")
    print(f"relayout: done; {len(touched)} files touched and staged (git status); run the tests, then commit")


if __name__ == "__main__":
    main()
