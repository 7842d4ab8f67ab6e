"""Hugging Face ``transformers`` integration: ``attn_implementation="entmax"``.

Importing this module registers, in transformers' ``AttentionInterface`` and
``AttentionMaskInterface``, the attention function :func:`entmax_attention_forward` and the boolean
(``True`` = attend) mask builder under the name ``"entmax"``. Any model that dispatches through the
attention interface (Llama, Mistral, Qwen, BERT, ...) then runs entmax attention with::

    import sparse_attn.integrations.hf as entmax_hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="entmax")
    entmax_hf.attach_entmax_alpha(model, alpha=1.5, learnable=True)   # per-head alpha parameters

``import sparse_attn`` alone also registers ``"entmax"``, before or after transformers is imported, without
importing transformers itself (:func:`sparse_attn.integrations.register_hf_when_imported`); a failed automatic
registration is a ``UserWarning``, and transformers' error for ``attn_implementation="entmax"`` then names it.

Without :func:`attach_entmax_alpha` every head uses ``config.entmax_alpha`` if set, else 1.5;
``config.entmax_backend`` (``"auto"``, ``"triton"`` or ``"reference"``) picks the backend of
:func:`sparse_attn.entmax_attention` (default ``"auto"``: Triton on CUDA).
Attached alphas are submodules ``<attention module>.entmax_alpha`` (:class:`sparse_attn.modules.EntmaxAlpha`),
so a learnable alpha is trained with the model and saved by ``save_pretrained``; the settings go
to ``config.entmax``, and :func:`from_pretrained` rebuilds them when loading.
:func:`sparse_attn.record_head_stats` records every attention module of a model whose
configuration uses entmax attention, with or without attached alphas.
Query and key/value heads may differ (GQA/MQA); causal masks are bottom-right aligned, so
``generate()`` with a KV cache works; on the fused backend its steps after the prompt (at most 16 new queries
against the cache, no gradient) run the split-K decode kernels (docs/decode.md), and
``record_head_stats(model, history=True)`` gives the head densities of every step. Attention variants pass as
arguments of :func:`sparse_attn.entmax_attention`: a layer's ``sliding_window`` as ``window_size`` (Mistral, Gemma 2/3,
gpt-oss, ModernBERT: the mask builder :func:`entmax_mask` leaves windows and causality to the attention
function, so they are never materialized), gpt-oss's sinks (``s_aux``) as ``sinks``, Gemma-2's
``softcap``, ``alibi_slopes``, and value heads narrower than query/key heads (DeepSeek-V3).
Architectures that do not run their attention through the interface (with transformers 5.24: Falcon, GPT-Neo,
BLOOM, MPT, XGLM, DeBERTa-v2, MPNet, ...; :func:`routes_attention` reads it off the installed release) refuse
``attn_implementation="entmax"`` with a
``ValueError`` when they are built or loaded (:func:`check_routes_attention`, hooked into transformers'
check of the requested implementation) instead of silently keeping softmax.
Needs ``transformers`` (``pip install 'sparse_attn[hf]'``).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import sys

import torch
from torch import Tensor, nn

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import (
        AttentionMaskInterface,
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        sdpa_mask,
        sliding_window_bidirectional_overlay,
        sliding_window_overlay,
    )
except ImportError as exc:  # pragma: no cover - exercised only without (a recent enough) transformers
    raise ImportError(
        f"sparse_attn.integrations.hf needs Hugging Face transformers with AttentionInterface and "
        f"masking_utils (pip install 'sparse_attn[hf]'): {exc}"
    ) from exc

from sparse_attn._validation import check_number
from sparse_attn.attn.attention import run_layer_attention
from sparse_attn.attn.attn_inputs import prepare_attention
from sparse_attn.attn.masks import check_mask, combine_masks
from sparse_attn.models.modules import EntmaxAlpha, resolve_learnable
from sparse_attn.models.stats import head_stats_sink, register_layer_type

__all__ = [
    "IMPLEMENTATION",
    "attach_entmax_alpha",
    "attention_modules",
    "check_routes_attention",
    "entmax_attention_forward",
    "entmax_mask",
    "from_pretrained",
    "register_entmax_attention",
    "routes_attention",
]

IMPLEMENTATION = "entmax"
_DEFAULT_ALPHA = 1.5
_INTERFACE_CALLERS: dict[type, bool] = {}


def _module_alpha(module: nn.Module, n_heads: int):
    """``(alpha, in_range)`` of ``module``'s heads: its attached EntmaxAlpha (in range by construction),
    else ``config.entmax_alpha``, else 1.5."""
    holder = getattr(module, "entmax_alpha", None)
    if isinstance(holder, EntmaxAlpha):
        if holder.num_heads != n_heads:
            raise ValueError(
                f"the attached entmax_alpha has {holder.num_heads} heads but the attention has {n_heads} query heads"
            )
        return holder._alpha_arg(), True
    config = getattr(module, "config", None)
    value = getattr(config, "entmax_alpha", None) if config is not None else None
    return (_DEFAULT_ALPHA if value is None else value), False


def _structure_window(kwargs: dict, layer_causal: bool) -> tuple[int, int] | None:
    """flash-attn ``window_size`` of transformers' ``sliding_window`` kwarg (a window of ``W`` tokens,
    the query's included: ``(W - 1, 0)`` causal, ``(W - 1, W - 1)`` bidirectional, as transformers'
    own flash-attention path), or None."""
    width = kwargs.get("sliding_window")
    if width is None:
        return None
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"sliding_window must be None or a positive int, got {width!r}")
    return (width - 1, 0 if layer_causal else width - 1)


def entmax_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """Attention function for transformers' ``AttentionInterface`` (registered as ``"entmax"``).

    Args:
        module: the calling attention module (its ``entmax_alpha``, ``is_causal`` and
            ``config.entmax_alpha`` / ``config.entmax_backend`` are read).
        query: ``(B, Hq, Nq, D)``; key, value: ``(B, Hk, Nk, D)`` and ``(B, Hk, Nk, Dv)``, ``Hq % Hk == 0``
            (``Dv != D`` as in DeepSeek-V3).
        attention_mask: None or a 2-d boolean padding mask ``(B, Nk)`` (True = attend) from
            :func:`entmax_mask`: then causal masking and the sliding window are applied here, bottom-right
            aligned; or a complete 4-d mask, boolean ``(B, 1|Hq, Nq, Nk)`` or additive float.
        dropout: dropout on the weights (the caller passes 0 in eval mode). Default 0.
        scaling: score scale, default ``D ** -0.5``.
        is_causal: overrides ``module.is_causal``; causal masking applies only without a 4-d mask and,
            when no mask was built, for ``Nq > 1``, as for SDPA.
        **kwargs: ``output_attentions=True`` returns the weights (the materialized reference; with
            ``config.entmax_backend = "triton"`` it raises ``ValueError`` instead of leaving the kernels);
            ``position_bias`` (float, broadcastable to the scores) is added to the scores;
            ``sliding_window`` (int ``W``): the window ``(W - 1, 0)`` (``(W - 1, W - 1)`` for a
            bidirectional layer) without a 4-d mask; ``softcap`` (Gemma-2's logit soft-capping);
            ``s_aux`` (gpt-oss's per-head sinks, ``(Hq,)``); ``alibi_slopes`` (``(Hq,)`` or ``(B, Hq)``);
            ``block_mask`` (a :class:`sparse_attn.BlockSparseMask` or torch's ``BlockMask`` with its ``mask_mod``,
            intersected with the layer's masks; a ``BlockMask`` given as ``attention_mask`` is taken as this).
            See :func:`sparse_attn.entmax_attention` for their semantics.

    Returns:
        ``(out, weights)``: ``out`` ``(B, Nq, Hq, Dv)``, ``weights`` ``(B, Hq, Nq, Nk)`` or None.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of shape (batch, heads, seq, head_dim), got {got}")
    dropout = check_number("dropout", dropout, 0.0, 1.0, high_open=True)
    block_mask = kwargs.get("block_mask")
    if type(attention_mask).__name__ == "BlockMask":  # flex_attention's mask object: a block mask, no element mask
        block_mask, attention_mask = attention_mask, None
    n_heads, n_kv = query.shape[1], key.shape[1]
    q_len = query.shape[2]
    scores = (query.shape[0], n_heads, q_len, key.shape[2])
    padding = isinstance(attention_mask, Tensor) and attention_mask.dim() == 2
    if padding:
        if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (scores[0], scores[3]):
            raise ValueError(
                f"a 2-d attention_mask must be a boolean padding mask of shape (batch, seq_k) = "
                f"{(scores[0], scores[3])}, got {attention_mask.dtype} of shape {tuple(attention_mask.shape)}"
            )
        attention_mask = attention_mask[:, None, None, :]
    check_mask("attention_mask", attention_mask, query.device, scores)
    position_bias = kwargs.get("position_bias")
    check_mask("position_bias", position_bias, query.device)
    if position_bias is not None and not position_bias.is_floating_point():
        raise TypeError(f"position_bias must be a floating (additive) tensor, got {position_bias.dtype}")
    alpha, alpha_in_range = _module_alpha(module, n_heads)
    layer_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    structure = attention_mask is None or padding  # else the 4-d mask holds causality and the window
    causal = layer_causal and structure and (padding or q_len > 1)
    window = _structure_window(kwargs, layer_causal) if structure else None
    if causal and not padding and key.shape[2] > q_len:
        # The mask builder skips the mask only when the keys past q_len are empty cache slots.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if position_bias is not None:
        position_bias = position_bias[..., : key.shape[2]]
        check_mask("position_bias", position_bias, query.device, (*scores[:3], key.shape[2]))
    sink = head_stats_sink(module)
    output_attentions = bool(kwargs.get("output_attentions"))
    dense = output_attentions or (sink is not None and sink.wants_weights)
    backend = getattr(getattr(module, "config", None), "entmax_backend", None) or "auto"
    if dense and backend == "triton":
        why = ("output_attentions=True asks for" if output_attentions
               else "a record_head_stats(..., diversity=True) recorder needs")
        raise ValueError(
            f"config.entmax_backend='triton' cannot run this call on the fused Triton kernels: {why} the attention "
            f"weights, which only the materialized reference computes; set config.entmax_backend = 'auto' or "
            f"'reference' for such calls"
        )
    inputs = prepare_attention(
        query, key, value, alpha, attn_mask=combine_masks(attention_mask, position_bias), is_causal=causal,
        scale=scaling, dropout_p=dropout, enable_gqa=n_kv != n_heads, backend="reference" if dense else backend,
        window_size=window, alibi_slopes=kwargs.get("alibi_slopes"), sinks=kwargs.get("s_aux"),
        softcap=kwargs.get("softcap"), alpha_in_range=alpha_in_range, block_mask=block_mask,
    )
    out, weights = run_layer_attention(inputs, dense, sink)
    return out.transpose(1, 2).contiguous(), weights if output_attentions else None


def _closure(fn) -> list:
    return [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ())]


_AND_MASK_CODE = and_masks(causal_mask_function).__code__
_CAUSAL_OVERLAY_CODE = sliding_window_overlay(1).__code__
_BIDIRECTIONAL_OVERLAY_CODE = sliding_window_bidirectional_overlay(1).__code__


def _mask_structure(mask_function) -> tuple[str, int | None] | None:
    """``(kind, W)`` when ``mask_function`` is one of transformers' plain patterns: ``("causal", None)``,
    ``("bidirectional", None)``, or the sliding-window causal / bidirectional pattern of width ``W``;
    None for anything else (overlays, packed sequences, chunks, custom functions)."""
    if mask_function is causal_mask_function:
        return "causal", None
    if mask_function is bidirectional_mask_function:
        return "bidirectional", None
    parts = _closure(mask_function)
    if getattr(mask_function, "__code__", None) is not _AND_MASK_CODE or len(parts) != 1 or len(parts[0]) != 2:
        return None
    overlay, base = parts[0]
    code = getattr(overlay, "__code__", None)
    if code is _CAUSAL_OVERLAY_CODE and base is causal_mask_function:
        kind = "causal"
    elif code is _BIDIRECTIONAL_OVERLAY_CODE and base is bidirectional_mask_function:
        kind = "bidirectional"
    else:
        return None
    width = _closure(overlay)
    return (kind, width[0]) if len(width) == 1 and isinstance(width[0], int) else None


def entmax_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    **kwargs,
) -> Tensor | None:
    """Mask builder registered with :func:`entmax_attention_forward` in transformers' ``AttentionMaskInterface``.

    For transformers' plain causal, bidirectional and sliding-window patterns (when transformers
    allows skipping the mask, and for causal ones when the keys end at the last query, so that
    bottom-right alignment holds) it returns only the padding: None, or a boolean ``(B, kv_length)``
    mask (True = attend); the attention function then applies causal masking and the sliding window
    itself (``window_size``, never materialized). Every other pattern (chunked attention, overlays,
    packed sequences, static caches) gets transformers' materialized boolean ``(B, 1, Nq, Nk)`` mask
    from ``sdpa_mask``, which the attention function takes as complete; so does every pattern while
    ``torch.compile`` traces (the recognition reads function closures). Arguments as ``sdpa_mask``.
    """
    # the pattern is recognized by function identity and closures, which torch.compile does not trace
    structure = None if torch.compiler.is_compiling() else _mask_structure(mask_function)
    kind, width = structure if structure is not None else (None, None)
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and kv_offset + kv_length == q_offset + q_length)
    plain = (kind == "causal" and allow_is_causal_skip and aligned) or (
        kind == "bidirectional" and allow_is_bidirectional_skip and (width is None or aligned))
    if not plain or width != local_size:
        return sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
            allow_is_causal_skip=allow_is_causal_skip, allow_is_bidirectional_skip=allow_is_bidirectional_skip,
            **kwargs,
        )
    if attention_mask is None:
        if kind == "bidirectional" or q_length in (1, kv_length):
            return None
        return torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
    padding = attention_mask.to(torch.bool)
    if padding.shape[-1] < kv_offset + kv_length:
        padding = torch.nn.functional.pad(padding, (0, kv_offset + kv_length - padding.shape[-1]))
    return padding[:, kv_offset: kv_offset + kv_length]


_ROUTES: dict[type, bool] = {}


def routes_attention(model_cls: type) -> bool:
    """Whether a transformers model class runs its attention through the attention interface.

    True when the class declares ``_supports_attention_backend``, or when its modeling module defines
    no ``*Attention*(nn.Module)`` class or looks the attention function up in
    ``ALL_ATTENTION_FUNCTIONS``; also True when the source cannot be read (nothing to tell from).
    """
    if model_cls not in _ROUTES:
        routes = bool(getattr(model_cls, "_supports_attention_backend", False))
        if not routes:
            try:
                src = inspect.getsource(sys.modules[model_cls.__module__])
            except (KeyError, OSError, TypeError):
                src = None
            routes = src is None or "ALL_ATTENTION_FUNCTIONS" in src or not re.search(
                r"^class \w*Attention\w*\(nn\.Module\):", src, re.MULTILINE)
        _ROUTES[model_cls] = routes
    return _ROUTES[model_cls]


def check_routes_attention(model_cls: type, implementation) -> None:
    """Raise ``ValueError`` when ``implementation`` is registered to entmax attention but ``model_cls``
    would never call it (its layers keep softmax, or look the name up in their own table)."""
    if not isinstance(implementation, str) or AttentionInterface().get(implementation) is not entmax_attention_forward:
        return
    if routes_attention(model_cls):
        return
    model_type = getattr(getattr(model_cls, "config_class", None), "model_type", None) or "?"
    remedy = ("use an architecture that does (Llama, Mistral, Qwen, Gemma, gpt-oss, DeepSeek-V3, BERT, ...)")
    if getattr(model_cls, "_supports_sdpa", False):
        remedy += (", or load this one with attn_implementation='sdpa' and make the modules that call "
                   "torch.nn.functional.scaled_dot_product_attention use entmax with "
                   "sparse_attn.sdpa.swap_sdpa_attention(model)")
    raise ValueError(
        f"{model_cls.__name__} (model_type {model_type!r}) does not run its attention through transformers' "
        f"AttentionInterface, so attn_implementation={implementation!r} cannot reach its attention layers "
        f"(they would keep softmax or fail): {remedy}"
    )


def _install_routing_check() -> None:
    """Make transformers' check of a requested attention implementation (run when a model is built, loaded or
    switched with ``set_attn_implementation``) call :func:`check_routes_attention`."""
    original = getattr(PreTrainedModel, "get_correct_attn_implementation", None)
    if original is None or getattr(original, "_sparse_attn_routing_check", False):
        return

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        implementation = original(self, requested_attention, *args, **kwargs)
        check_routes_attention(type(self), implementation)
        return implementation

    get_correct_attn_implementation._sparse_attn_routing_check = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def _uses_entmax(module: nn.Module) -> bool:
    """Whether ``module`` calls the attention interface with an implementation registered to entmax."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return (isinstance(impl, str) and AttentionInterface().get(impl) is entmax_attention_forward
            and _calls_attention_interface(module))


def _head_alpha(module: nn.Module) -> Tensor:
    """Current alpha of each query head of an attention module, ``(num_heads,)`` (for the head statistics)."""
    n_heads = _num_heads(module)
    alpha, _ = _module_alpha(module, n_heads)
    if isinstance(alpha, Tensor):
        return alpha.detach().reshape(-1).expand(n_heads)
    ref = next(module.parameters(), None)
    return torch.full((n_heads,), float(alpha), device=ref.device if ref is not None else None)


def register_entmax_attention(name: str = IMPLEMENTATION) -> None:
    """Register :func:`entmax_attention_forward` and its mask builder in transformers under ``name``.

    Done on import for ``"entmax"``; calling it again is harmless.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    AttentionInterface.register(name, entmax_attention_forward)
    AttentionMaskInterface.register(name, entmax_mask)


def _calls_attention_interface(module: nn.Module) -> bool:
    cls = type(module)
    if cls not in _INTERFACE_CALLERS:
        try:
            src = inspect.getsource(cls.forward)
            calls = "_attn_implementation" in src and "attention_interface" in src
        except (OSError, TypeError):
            calls = cls.__name__.endswith("Attention") and hasattr(module, "config") and hasattr(module, "is_causal")
        _INTERFACE_CALLERS[cls] = calls
    return _INTERFACE_CALLERS[cls]


def _num_heads(module: nn.Module) -> int:
    for attr in ("num_attention_heads", "num_heads"):
        n = getattr(module, attr, None)
        if isinstance(n, int):
            return n
    config = getattr(module, "config", None)
    n = getattr(config, "num_attention_heads", None)
    if not isinstance(n, int):
        raise ValueError(f"cannot tell the number of heads of {type(module).__name__}")
    return n


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` that calls transformers' attention interface."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules() if _calls_attention_interface(m)]


def attach_entmax_alpha(
    model: nn.Module,
    alpha: float | Tensor | list = 1.5,
    learnable: bool | None = None,
    alpha_min: float = 1.0,
    alpha_max: float = 2.0,
    alpha_init: float | Tensor | None = None,
    *,
    learnable_alpha: bool | None = None,
) -> list[str]:
    """Give every attention module of a transformers model its own per-head alpha (in place).

    Each attention module gets a submodule ``entmax_alpha`` (:class:`sparse_attn.modules.EntmaxAlpha`,
    ``(num_heads,)``, on the device of the module's parameters); a learnable alpha is the
    parameter ``entmax_alpha.alpha_logit``, trained with the model and saved by ``save_pretrained``.
    The settings are stored in ``model.config.entmax`` so :func:`from_pretrained` can rebuild them.
    The model must use ``attn_implementation="entmax"`` for the alphas to take effect.

    Args:
        model: a transformers ``PreTrainedModel`` (or any module containing attention modules
            that call the attention interface).
        alpha: initial (or fixed) alpha: float, or a per-head list/tensor. Default 1.5.
        learnable: learn the alphas. Default True. ``learnable_alpha`` is a deprecated alias.
        alpha_min, alpha_max: range of a learnable alpha. Default (1, 2).
        alpha_init: initial learnable alpha (float, or a per-head list/tensor), default ``alpha``.

    Returns:
        The names of the modules that received an alpha.
    """
    learnable = resolve_learnable(learnable, learnable_alpha, default=True)
    alpha, alpha_init = (torch.tensor(a, dtype=torch.float64) if isinstance(a, (list, tuple)) else a
                         for a in (alpha, alpha_init))
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attention module that uses transformers' attention interface")
    for _, m in mods:
        ref = next(m.parameters(), None)
        m.entmax_alpha = EntmaxAlpha(_num_heads(m), alpha=alpha, learnable=learnable, alpha_min=alpha_min,
                                     alpha_max=alpha_max, alpha_init=alpha_init,
                                     device=ref.device if ref is not None else None)
    config = getattr(model, "config", None)
    if config is not None:
        config.entmax = {
            "alpha": _jsonable(alpha),
            "learnable": bool(learnable),
            "alpha_min": float(alpha_min),
            "alpha_max": float(alpha_max),
            "alpha_init": None if alpha_init is None else _jsonable(alpha_init),
        }
    return [name for name, _ in mods]


def _jsonable(value) -> float | list[float]:
    """A float or per-head tensor as stored in ``config.entmax`` (JSON)."""
    return value.detach().reshape(-1).tolist() if isinstance(value, Tensor) else float(value)


def _checkpoint_tensors(path: str) -> dict[str, Tensor]:
    """The ``entmax_alpha`` tensors of the safetensors files of a local directory, by name."""
    from safetensors import safe_open

    files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    found = {}
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt") as fh:
            for key in fh.keys():
                if "entmax_alpha" in key:
                    found[key] = fh.get_tensor(key)
    return found


def from_pretrained(model_cls, path: str, **kwargs):
    """Load a model saved after :func:`attach_entmax_alpha` with its alphas, using entmax attention.

    ``model_cls.from_pretrained(path, attn_implementation="entmax", **kwargs)``, then the alphas of
    ``config.entmax`` are attached again and learned alpha values are read from the checkpoint
    (a local directory of safetensors files).

    Args:
        model_cls: a transformers model class or auto class (e.g. ``AutoModelForCausalLM``).
        path: local directory written by ``save_pretrained``.
        **kwargs: passed to ``from_pretrained``.
    """
    if not os.path.isdir(path):
        raise ValueError(f"path must be a local directory written by save_pretrained, got {path!r}")
    kwargs.setdefault("attn_implementation", IMPLEMENTATION)
    model = model_cls.from_pretrained(path, **kwargs)
    settings = getattr(model.config, "entmax", None)
    if not settings:
        return model
    attach_entmax_alpha(model, **settings)
    names = [n for n, _ in model.named_parameters() if n.endswith("entmax_alpha.alpha_logit")]
    if names:
        saved = _checkpoint_tensors(path)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in names:
                match = [k for k in saved if k == name or k.endswith("." + name) or name.endswith("." + k)]
                if len(match) != 1:
                    raise ValueError(f"the checkpoint in {path!r} has no unique entry for {name!r} (found {match})")
                params[name].copy_(saved[match[0]])
    return model


register_entmax_attention()
register_layer_type(_uses_entmax, _head_alpha)
_install_routing_check()
