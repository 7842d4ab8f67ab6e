"""The Triton interpreter patches ``triton.language`` once per launch, not once per inner ``@triton.jit`` call.

Under ``TRITON_INTERPRET=1`` a kernel launch swaps the builtins of ``triton.language`` (and ``triton.language.core``)
for their interpreted versions and restores them when the launch ends. Triton (3.6 to 3.9) also redoes that swap at
every call of an inner ``@triton.jit`` helper, without ever restoring it: the modules are the same objects, the
builtins are already swapped (a swapped builtin is no longer a builtin, so it is skipped), and the rest is set again to
equal functions. Redoing it walks every member of those modules each time: about 0.8 ms per helper call, which was
more than half of the interpreted time of the decode and fused kernels, whose work sits in helpers.

``install()`` skips that redo when every language module the helper sees has already been swapped by the launch in
progress; anything else (a launch, a helper that sees a module the launch did not swap) goes through Triton's own
code. What runs inside the kernels is unchanged. ``SPARSE_ATTN_INTERPRETER_PATCH_ONCE=0`` keeps Triton's behaviour
(tests/conftest.py); ``tests/test_bounds_check.py`` checks that a kernel with helpers gives the same bits both ways.
"""

from __future__ import annotations

import inspect

_INSTALLED = False
_ORIGINALS: dict = {}
# ids of the language modules swapped by the launch in progress; None outside a launch
_SWAPPED: list = [None]
# helper calls whose swap was skipped (tests/test_interpreter_patch_once.py checks that the skip happens)
SKIPPED: list = [0]


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Patch the interpreter (idempotent); False, doing nothing, when its layout is not the one this expects."""
    global _INSTALLED
    if _INSTALLED:
        return True
    from triton import language as tl
    from triton.runtime import interpreter as interp

    if not (callable(getattr(interp, "_patch_lang", None)) and hasattr(interp, "GridExecutor")
            and hasattr(interp, "InterpretedFunction")):
        return False
    patch_lang, launch = interp._patch_lang, interp.GridExecutor.__call__
    _ORIGINALS.update(patch_lang=patch_lang, launch=launch)

    def langs_of(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}

    def patch_lang_once(fn):
        swapped = _SWAPPED[0]
        langs = langs_of(fn)
        if swapped is not None and langs and langs <= swapped:
            SKIPPED[0] += 1
            return _NothingToRestore()
        scope = patch_lang(fn)
        if swapped is not None:
            swapped |= langs
        return scope

    def launch_once(self, *args, **kwargs):
        outer, _SWAPPED[0] = _SWAPPED[0], set()  # the launch's own _patch_lang swaps (and fills the set) first
        try:
            return launch(self, *args, **kwargs)
        finally:
            _SWAPPED[0] = outer

    interp._patch_lang = patch_lang_once
    interp.GridExecutor.__call__ = launch_once
    _INSTALLED = True
    return True


def uninstall() -> None:
    """Undo :func:`install` (a no-op when it is not installed)."""
    global _INSTALLED
    if not _INSTALLED:
        return
    from triton.runtime import interpreter as interp

    interp._patch_lang = _ORIGINALS["patch_lang"]
    interp.GridExecutor.__call__ = _ORIGINALS["launch"]
    _SWAPPED[0] = None
    _INSTALLED = False


def installed() -> bool:
    return _INSTALLED
