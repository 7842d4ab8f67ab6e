"""Module paths of the flat layout, kept: ``sparse_attn.mappings``, ``sparse_attn.decode``, ...

The package was grouped into subpackages by concern (``rows/``, ``attn/``, ``models/``, ``kernels/attn/``,
``kernels/rows/``; docs/design.md). Every module path that existed before stays importable and gives the *same*
module object as its new path (not a copy and not a re-export), so ``import sparse_attn.mappings as m`` and
``monkeypatch.setattr(m, "x", ...)`` see and patch what the package itself uses. :func:`install` (called by
``sparse_attn/__init__.py``) puts a finder on ``sys.meta_path`` that maps an old name to the loaded new module, and a
module ``__getattr__`` on ``sparse_attn`` and ``sparse_attn.kernels`` so ``sparse_attn.mappings`` works as an
attribute too.

Two kinds (:data:`PUBLIC_PATHS`): the short public names the README uses (``sparse_attn.attention``,
``sparse_attn.decode``, ``sparse_attn.modules``, ...) are the documented way in and stay without a warning; the
others (private modules, ``sparse_attn.kernels.<kernel file>``, the spec and routes) were never meant for users and
give a ``DeprecationWarning`` naming the path to import instead; they will be removed. Code in the repository
imports neither kind of internal path (tests/test_old_paths.py checks that, and every entry of :data:`OLD_PATHS`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

OLD_PATHS = {
    "sparse_attn._attn_autograd": "sparse_attn.attn._attn_autograd",
    "sparse_attn._cp_layout": "sparse_attn.models._cp_layout",
    "sparse_attn._cp_shard": "sparse_attn.models._cp_shard",
    "sparse_attn._cpu_chunked": "sparse_attn.attn._cpu_chunked",
    "sparse_attn._dispatch": "sparse_attn.rows._dispatch",
    "sparse_attn._head_alpha": "sparse_attn.models._head_alpha",
    "sparse_attn._kv_cache": "sparse_attn.attn._kv_cache",
    "sparse_attn._sdpa_callers": "sparse_attn.models._sdpa_callers",
    "sparse_attn._structured_rows": "sparse_attn.rows._structured_rows",
    "sparse_attn._triton_rows": "sparse_attn.rows._triton_rows",
    "sparse_attn.attention": "sparse_attn.attn.attention",
    "sparse_attn.attn_inputs": "sparse_attn.attn.attn_inputs",
    "sparse_attn.constrained": "sparse_attn.rows.constrained",
    "sparse_attn.decode": "sparse_attn.attn.decode",
    "sparse_attn.distributed": "sparse_attn.models.distributed",
    "sparse_attn.kernels._bwd_tiles": "sparse_attn.kernels.attn._bwd_tiles",
    "sparse_attn.kernels._decode_state": "sparse_attn.kernels.attn._decode_state",
    "sparse_attn.kernels._fwd_rows": "sparse_attn.kernels.attn._fwd_rows",
    "sparse_attn.kernels._threshold": "sparse_attn.kernels.attn._threshold",
    "sparse_attn.kernels.entmax_attn_bwd": "sparse_attn.kernels.attn.entmax_attn_bwd",
    "sparse_attn.kernels.entmax_attn_fwd": "sparse_attn.kernels.attn.entmax_attn_fwd",
    "sparse_attn.kernels.entmax_decode": "sparse_attn.kernels.attn.entmax_decode",
    "sparse_attn.kernels.row_entmax": "sparse_attn.kernels.rows.row_entmax",
    "sparse_attn.kernels.structured": "sparse_attn.kernels.rows.structured",
    "sparse_attn.losses": "sparse_attn.rows.losses",
    "sparse_attn.mappings": "sparse_attn.rows.mappings",
    "sparse_attn.masks": "sparse_attn.attn.masks",
    "sparse_attn.modules": "sparse_attn.models.modules",
    "sparse_attn.reference": "sparse_attn.attn.reference",
    "sparse_attn.routes": "sparse_attn.attn.routes",
    "sparse_attn.sdpa": "sparse_attn.models.sdpa",
    "sparse_attn.stats": "sparse_attn.models.stats",
    "sparse_attn.structured": "sparse_attn.rows.structured",
}
"""Old module path -> the module's path now."""

PUBLIC_PATHS = frozenset({
    "sparse_attn.attention", "sparse_attn.constrained", "sparse_attn.decode", "sparse_attn.distributed",
    "sparse_attn.losses", "sparse_attn.mappings", "sparse_attn.modules", "sparse_attn.reference", "sparse_attn.sdpa",
    "sparse_attn.stats", "sparse_attn.structured",
})
"""The old paths that are the public short names of their modules (no warning)."""


def _warn_if_deprecated(old: str) -> None:
    if old not in PUBLIC_PATHS:
        warnings.warn(f"{old} is deprecated and will be removed: import {OLD_PATHS[old]}", DeprecationWarning,
                      stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module of its new path (imported if needed), which keeps its own ``__spec__``."""

    def __init__(self, target: str):
        self._target = target

    def create_module(self, spec):
        _warn_if_deprecated(spec.name)
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
            if f"{package}.{name}" not in sys.modules:
                return importlib.import_module(f"{package}.{name}")  # the finder warns
            _warn_if_deprecated(f"{package}.{name}")
            return sys.modules[f"{package}.{name}"]
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
