"""Which modules call ``torch.nn.functional.scaled_dot_product_attention``: found by their ``forward``'s syntax tree.

Below both :mod:`sparse_attn.modules` (whose ``swap_attention`` names the SDPA callers it cannot replace) and
:mod:`sparse_attn.sdpa` (which routes their calls), so that neither imports the other for it; the public name is
``sparse_attn.sdpa.sdpa_modules``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch.nn.functional as F
from torch import nn

_SDPA = F.scaled_dot_product_attention

_CALLERS: dict[type, bool] = {}


def _is_sdpa_call(node, namespace: dict) -> bool:
    """Whether a call node calls SDPA: ``F.scaled_dot_product_attention(...)``, ``torch.nn.functional.<same>``, or
    any name or attribute chain bound to it in ``namespace`` (e.g. ``from ... import scaled_dot_product_attention
    as sdpa``)."""
    func, chain = node.func, []
    while isinstance(func, ast.Attribute):
        chain.append(func.attr)
        func = func.value
    if chain and chain[0] == _SDPA.__name__:
        return True
    if not isinstance(func, ast.Name) or func.id not in namespace:
        return False
    obj = namespace[func.id]
    for attr in reversed(chain):
        obj = getattr(obj, attr, None)
    return obj is _SDPA


def _calls_sdpa(cls: type) -> bool:
    """Whether ``cls.forward`` calls ``scaled_dot_product_attention`` (by its syntax tree: docstrings do not count)."""
    if cls not in _CALLERS:
        forward = inspect.unwrap(cls.forward)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        namespace = getattr(forward, "__globals__", {})
        _CALLERS[cls] = tree is not None and any(
            isinstance(node, ast.Call) and _is_sdpa_call(node, namespace) for node in ast.walk(tree))
    return _CALLERS[cls]


def sdpa_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules of ``model`` whose class's ``forward`` calls ``scaled_dot_product_attention``
    (by its source), outermost first; modules inside one of them are left out (their calls are routed with it)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found = []
    for name, m in model.named_modules():
        if _calls_sdpa(type(m)) and not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            found.append((name, m))
    return found
