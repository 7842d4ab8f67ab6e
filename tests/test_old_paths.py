"""The module paths of the flat layout (before the subpackages) are the modules of the new paths.

``sparse_attn/_old_paths.py`` holds the table; these tests import every old path (in this process, and in a fresh
one where nothing is imported yet), patch through one, check that only the non-public ones warn, that nothing in the
repository spells a deprecated one, and resolve every dotted name of a public one that the README, the docs, the
examples, the benchmarks and the tests spell.
"""

import importlib
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import sparse_attn
from sparse_attn._old_paths import OLD_PATHS, PUBLIC_PATHS

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_is_the_new_module(old):
    new = OLD_PATHS[old]
    sys.modules.pop(old, None)   # imported afresh through the finder, as a user's first import
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    if old in PUBLIC_PATHS:
        assert deprecations == []
    else:
        assert len(deprecations) == 1 and f"import {new}" in str(deprecations[0].message)
    assert module is importlib.import_module(new) and sys.modules[old] is module
    assert module.__name__ == new and module.__spec__.name == new
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is module


def test_old_paths_in_a_fresh_process():
    code = "; ".join([
        "import importlib, sys, warnings",
        "warnings.simplefilter('error', DeprecationWarning)",
        "from sparse_attn import mappings",
        "import sparse_attn.attention as att",
        "import sparse_attn.decode as dec",
        "import sparse_attn",
        "warnings.simplefilter('ignore', DeprecationWarning)",
        "import sparse_attn.kernels.entmax_attn_fwd as a",
        "from sparse_attn.kernels import entmax_decode",
        f"table = {dict(OLD_PATHS)!r}",
        "assert all(importlib.import_module(o) is importlib.import_module(n) for o, n in table.items())",
        "assert a is sys.modules['sparse_attn.kernels.attn.entmax_attn_fwd'] and att.entmax_attention is "
        "sparse_attn.entmax_attention",
        "assert entmax_decode.__name__ == 'sparse_attn.kernels.attn.entmax_decode' and mappings.entmax is "
        "sparse_attn.entmax and dec.__name__ == 'sparse_attn.attn.decode'",
    ])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_attribute_access_to_a_deprecated_path_warns(monkeypatch):
    monkeypatch.delitem(sys.modules, "sparse_attn.routes", raising=False)
    monkeypatch.delattr(sparse_attn, "routes", raising=False)
    with pytest.warns(DeprecationWarning, match=r"import sparse_attn\.attn\.routes"):
        assert sparse_attn.routes is importlib.import_module("sparse_attn.attn.routes")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
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


def _texts():
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("examples", "benchmarks", "tests", "sparse_attn", "kernels"):
        texts += sorted(p for p in (ROOT / folder).rglob("*.py")
                        if p.name not in ("_old_paths.py", "test_old_paths.py"))
    texts += sorted((ROOT / "benchmarks").rglob("*.sh")) + sorted((ROOT / "benchmarks").glob("*.md"))
    return texts


def _spelled(path):
    """Dotted names, and ``from sparse_attn... import a, b`` as ``sparse_attn....a`` / ``.b``."""
    text = path.read_text(encoding="utf-8")
    names = set(re.findall(r"\bsparse_attn(?:\.\w+)+", text))
    for package, imported in re.findall(r"\bfrom (sparse_attn(?:\.\w+)*) import \(?([\w, ]+)", text):
        names |= {f"{package}.{name.split()[0]}" for name in imported.split(",") if name.strip()}
    return names


def _spelled_names():
    found = set().union(*(_spelled(p) for p in _texts()))
    return sorted(name for name in found
                  if any(name == old or name.startswith(old + ".") for old in PUBLIC_PATHS))


def test_nothing_in_the_repository_spells_a_deprecated_path():
    deprecated = sorted(set(OLD_PATHS) - PUBLIC_PATHS)
    found = {}
    for path in _texts():
        for name in _spelled(path):
            hit = [old for old in deprecated if name == old or name.startswith(old + ".")]
            if hit:
                found.setdefault(str(path.relative_to(ROOT)), set()).update(hit)
    assert found == {}


@pytest.mark.parametrize("name", _spelled_names())
def test_spelled_public_names_resolve(name):
    old = max((o for o in OLD_PATHS if name == o or name.startswith(o + ".")), key=len)
    obj = importlib.import_module(old)
    for attr in name[len(old) + 1:].split(".") if name != old else []:
        obj = getattr(obj, attr)
