"""Which attention variants each execution route runs: one table, and routers that refuse what it does not list.

A call's variants are named by :func:`used_variants` (from the normalized arguments of
:func:`sparse_attn.attn.attn_inputs.prepare_attention`, or :meth:`AttnSpec.used`). Each route declares the set it
implements in :data:`SUPPORTED`; ``refused(route, used)`` is what is left over, as phrases for an error message. A
variant missing from a route's set is refused there, so a new variant is off every route until a route lists it
(fail closed), and ``tests/attn/test_routes.py`` checks that every field of the spec (``AttnSpec``) is named here.

Routes:

* ``"sdpa"``: PyTorch's ``scaled_dot_product_attention`` for softmax heads (alpha = 1 for every head, CUDA, no
  statistics; :func:`sparse_attn.attn._attn_autograd.sdpa_refuses` adds those conditions);
* ``"decode"``: the split-K decode kernels (a few queries against a KV cache; :func:`sparse_attn.decode.decode_fits`);
* ``"fused"``: the general fused Triton forward and backward;
* ``"chunked"``: the reference backend's CPU path in row blocks (:func:`sparse_attn.attn._cpu_chunked.chunked_fits`);
* ``"reference"``: the materialized float64-capable reference (everything the library defines);
* ``"context_parallel"`` and ``"ulysses"``: :func:`sparse_attn.distributed.context_parallel_attention` (K/V
  all-gathered) and :func:`sparse_attn.distributed.ulysses_attention` (heads exchanged); their masks are key padding
  masks, and gradients of replicated tensors are per rank (alpha and sinks documented, summed by the caller).
"""

from __future__ import annotations

from sparse_attn.kernels._spec import (
    DECLS,
    used_variants,  # re-exported: the variants of a call, read from its spec
)

__all__ = ["VARIANTS", "SUPPORTED", "PROBLEM_FIELDS", "ROUTE_NAMES", "used_variants", "refused", "refusal_message"]

VARIANTS: dict[str, str] = {
    "varlen": "packed sequences (cu_seqlens)",
    "bool_mask": "a boolean attn_mask",
    "float_mask": "a float attn_mask",
    "mask_grad": "an attn_mask that requires grad",
    "causal": "is_causal",
    "window": "window_size",
    "alibi": "alibi_slopes",
    "alibi_grad": "alibi_slopes that require grad (the kernels give no gradient for the slopes; detach them)",
    "sinks": "sinks",
    "softcap": "softcap",
    "dropout": "dropout",
    "gqa": "grouped-query heads (fewer k/v heads than q heads)",
    "dv": "a value head dim different from the query/key head dim",
    "grad": "gradients",
    "block_mask": "a block-sparse block_mask",
}
"""Every variant a call can use, with the phrase an error message names it by."""

_ALL = frozenset(VARIANTS)
SUPPORTED: dict[str, frozenset] = {
    "sdpa": frozenset({"causal", "dropout", "gqa", "dv", "grad"}),
    "decode": frozenset({"bool_mask", "float_mask", "causal", "window", "alibi", "sinks", "softcap", "gqa", "dv",
                         "block_mask"}),
    "fused": frozenset({"varlen", "bool_mask", "float_mask", "mask_grad", "causal", "window", "alibi", "sinks",
                        "softcap", "dropout", "gqa", "dv", "grad", "block_mask"}),
    "chunked": frozenset({"varlen", "bool_mask", "float_mask", "mask_grad", "causal", "window", "alibi",
                          "alibi_grad", "sinks", "softcap", "dropout", "gqa", "dv", "grad"}),
    "context_parallel": frozenset({"bool_mask", "float_mask", "mask_grad", "causal", "window", "alibi", "sinks",
                                   "softcap", "dropout", "gqa", "dv", "grad"}),
    "ulysses": frozenset({"bool_mask", "float_mask", "mask_grad", "causal", "window", "alibi", "sinks", "softcap",
                          "dropout", "gqa", "dv", "grad"}),
    "reference": frozenset({"varlen", "bool_mask", "float_mask", "mask_grad", "causal", "window", "alibi",
                            "alibi_grad", "sinks", "softcap", "dropout", "gqa", "dv", "grad", "block_mask"}),
}
"""The variants each route implements, listed by hand: a variant a route does not list is refused there."""

PROBLEM_FIELDS = frozenset(name for name, decl in DECLS.items() if not decl.variants)
"""Fields of the spec (``AttnSpec`` = ``AttentionInputs``) that state the problem itself, not a variant
(``cu_seqlens_k`` travels with ``cu_seqlens_q``, the ``varlen`` variant; ``need_grad`` is read by the ``grad``
variant; the KV cache fields are the decode route's own layout; ``block_size`` and ``block_bits`` travel with
``block_mask``; ``deterministic`` permits the fused backward's atomics and asks nothing of a route that is
deterministic anyway); every other field must map to a variant in :func:`used_variants`. Each field declares its
variants in ``kernels/_spec.py`` (``DECLS``)."""


def refused(route: str, used) -> list[str]:
    """The variants in ``used`` that ``route`` does not implement, as phrases (in :data:`VARIANTS` order; a name
    :data:`VARIANTS` does not know is refused by its own name)."""
    if route not in SUPPORTED:
        raise ValueError(f"route must be one of {sorted(SUPPORTED)}, got {route!r}")
    left = set(used) - SUPPORTED[route]
    return [VARIANTS[name] for name in VARIANTS if name in left] + sorted(left - _ALL)


ROUTE_NAMES = {"sdpa": "PyTorch scaled_dot_product_attention", "decode": "the split-K decode kernels",
               "fused": "the fused Triton kernels", "chunked": "the reference in row blocks on CPU",
               "reference": "the materialized reference",
               "context_parallel": "context_parallel_attention", "ulysses": "ulysses_attention"}


def refusal_message(route: str, phrases: list[str], remedy: str) -> str:
    """The ``ValueError`` text of a route that cannot run a call: what it lacks, the route, and what to do."""
    return f"{'; '.join(phrases)}: not supported on route {route!r} ({ROUTE_NAMES[route]}); {remedy}"
