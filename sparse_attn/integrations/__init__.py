"""Integrations with other libraries; :mod:`sparse_attn.integrations.hf` for Hugging Face transformers.

``import sparse_attn`` registers ``attn_implementation="entmax"`` with transformers without
importing it: :func:`register_hf_when_imported` registers at once when ``transformers.modeling_utils``
(the module of ``AttentionInterface`` and ``PreTrainedModel``) is already imported, and otherwise
puts a finder on ``sys.meta_path`` that registers right after that module's first import
(``import transformers`` alone does not import it: transformers loads it lazily, on the first use of
``AutoModel``, ``PreTrainedModel``, ``AttentionInterface``, ...).
"""

from __future__ import annotations

import sys
import threading
import warnings

__all__ = ["HF_MODULE", "TRIGGER_MODULE", "registration_error", "register_hf_when_imported"]

HF_MODULE = "sparse_attn.integrations.hf"
TRIGGER_MODULE = "transformers.modeling_utils"
"""The transformers module whose import triggers the registration."""

_IMPORT_HINT = f"import {HF_MODULE}"
_state: dict = {"error": None}


def registration_error() -> BaseException | None:
    """The exception that made the automatic registration fail, or None (not failed, or not attempted)."""
    return _state["error"]


def _register() -> None:
    """Import :mod:`sparse_attn.integrations.hf` (which registers ``"entmax"``); on failure warn and keep the error.

    A failure must not break the import of transformers (sparse_attn may be imported for something else):
    it becomes a ``UserWarning`` naming the error, and a request for ``attn_implementation="entmax"``
    then raises a ``ValueError`` that names it (see :func:`_explain_missing_entmax`).
    """
    if HF_MODULE in sys.modules:  # imported (or being imported): it registers itself
        return
    try:
        __import__(HF_MODULE)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, below and on use
        _state["error"] = exc
        warnings.warn(
            f"sparse_attn could not register attn_implementation='entmax' with transformers "
            f"({type(exc).__name__}: {exc}); `{_IMPORT_HINT}` raises the full error",
            UserWarning, stacklevel=2,
        )
        _explain_missing_entmax(exc)


def _explain_missing_entmax(exc: BaseException) -> None:
    """Make transformers' "not supported" error for ``attn_implementation="entmax"`` name the failed registration."""
    module = sys.modules.get(TRIGGER_MODULE)
    model_cls = getattr(module, "PreTrainedModel", None)
    original = getattr(model_cls, "get_correct_attn_implementation", None)
    if original is None or getattr(original, "_sparse_attn_explains", False):
        return

    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        try:
            return original(self, requested_attention, *args, **kwargs)
        except ValueError as err:
            if requested_attention != "entmax" or _state["error"] is None:
                raise
            raise ValueError(
                f"{err} attn_implementation='entmax' is registered by sparse_attn, whose registration with "
                f"transformers failed ({type(_state['error']).__name__}: {_state['error']}); "
                f"`{_IMPORT_HINT}` raises the full error"
            ) from _state["error"]

    get_correct_attn_implementation._sparse_attn_explains = True
    get_correct_attn_implementation.__wrapped__ = original
    model_cls.get_correct_attn_implementation = get_correct_attn_implementation


class _RunAfterExec:
    """Loader wrapper: the wrapped loader executes the module, then ``callback`` runs.

    The module's ``__loader__`` and ``__spec__.loader`` are the wrapped loader again once it is executed.
    """

    def __init__(self, loader, callback):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._callback()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _RegisterAfterImport:
    """``sys.meta_path`` finder that wraps the loader of :data:`TRIGGER_MODULE` to register ``"entmax"`` after it.

    It finds the module through the finders after it on ``sys.meta_path``, and takes itself off the path
    once the module is imported.
    """

    def __init__(self):
        self._local = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER_MODULE or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RunAfterExec(spec.loader, self._done)
        return spec

    def _done(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _register()

    def __repr__(self) -> str:
        return f"<sparse_attn: register attn_implementation='entmax' after importing {TRIGGER_MODULE}>"


def register_hf_when_imported() -> None:
    """Register ``attn_implementation="entmax"`` with transformers now or when it is loaded; never imports it.

    Now when :data:`TRIGGER_MODULE` is imported, otherwise right after its import (a ``sys.meta_path``
    finder, installed once). Called by ``import sparse_attn``.
    """
    if TRIGGER_MODULE in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
