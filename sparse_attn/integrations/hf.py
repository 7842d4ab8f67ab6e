"""Hugging Face ``transformers`` integration: ``attn_implementation="entmax"``.

Importing this module registers, in transformers' ``AttentionInterface`` and
``AttentionMaskInterface``, the attention function :func:`entmax_attention_forward` and the boolean
(``True`` = attend) mask builder under the name ``"entmax"``. Any model that dispatches through the
attention interface (Llama, Mistral, Qwen, BERT, ...) then runs entmax attention with::

    import sparse_attn.integrations.hf as entmax_hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="entmax")
    entmax_hf.attach_entmax_alpha(model, alpha=1.5, learnable=True)   # per-head alpha parameters

Without :func:`attach_entmax_alpha` every head uses ``config.entmax_alpha`` if set, else 1.5;
``config.entmax_backend`` (``"auto"``, ``"triton"`` or ``"reference"``) picks the backend of
:func:`sparse_attn.entmax_attention` (default ``"auto"``: Triton on CUDA).
Attached alphas are submodules ``<attention module>.entmax_alpha`` (:class:`sparse_attn.modules.EntmaxAlpha`),
so a learnable alpha is trained with the model and saved by ``save_pretrained``; the settings go
to ``config.entmax``, and :func:`from_pretrained` rebuilds them when loading.
:func:`sparse_attn.record_head_stats` records every attention module of a model whose
configuration uses entmax attention, with or without attached alphas.
Query and key/value heads may differ (GQA/MQA); causal masks are bottom-right aligned, so
``generate()`` with a KV cache works. Needs ``transformers`` (``pip install 'sparse_attn[hf]'``).
"""

from __future__ import annotations

import inspect
import json
import os

import torch
from torch import Tensor, nn

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "sparse_attn.integrations.hf needs Hugging Face transformers: pip install 'sparse_attn[hf]'"
    ) from exc

from sparse_attn._validation import check_number
from sparse_attn.attention import run_layer_attention
from sparse_attn.attn_inputs import prepare_attention
from sparse_attn.masks import check_mask, combine_masks
from sparse_attn.modules import EntmaxAlpha, resolve_learnable
from sparse_attn.stats import head_stats_sink, register_layer_type

__all__ = [
    "IMPLEMENTATION",
    "attach_entmax_alpha",
    "attention_modules",
    "entmax_attention_forward",
    "from_pretrained",
    "register_entmax_attention",
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
        query: ``(B, Hq, Nq, D)``; key, value: ``(B, Hk, Nk, D)``, ``Hq % Hk == 0``.
        attention_mask: boolean ``(B, 1|Hq, Nq, Nk)`` (True = attend) or additive float, or None.
        dropout: dropout on the weights (the caller passes 0 in eval mode). Default 0.
        scaling: score scale, default ``D ** -0.5``.
        is_causal: overrides ``module.is_causal``; causal masking applies only when no mask was
            built (``attention_mask is None``) and ``Nq > 1``, as for SDPA.
        **kwargs: ``output_attentions=True`` returns the weights (dense path);
            ``position_bias`` (float, broadcastable to the scores) is added to the scores.

    Returns:
        ``(out, weights)``: ``out`` ``(B, Nq, Hq, D)``, ``weights`` ``(B, Hq, Nq, Nk)`` or None.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='entmax' does not support softcap (logit soft-capping)")
    if kwargs.get("sliding_window") is not None and attention_mask is None:
        raise ValueError("attn_implementation='entmax' needs an explicit mask for sliding-window attention")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of shape (batch, heads, seq, head_dim), got {got}")
    dropout = check_number("dropout", dropout, 0.0, 1.0, high_open=True)
    n_heads, n_kv = query.shape[1], key.shape[1]
    q_len = query.shape[2]
    scores = (query.shape[0], n_heads, q_len, key.shape[2])
    check_mask("attention_mask", attention_mask, query.device, scores)
    position_bias = kwargs.get("position_bias")
    check_mask("position_bias", position_bias, query.device)
    if position_bias is not None and not position_bias.is_floating_point():
        raise TypeError(f"position_bias must be a floating (additive) tensor, got {position_bias.dtype}")
    alpha, alpha_in_range = _module_alpha(module, n_heads)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and q_len > 1
    if causal and key.shape[2] > q_len:
        # The mask builder skips the mask only when the keys past q_len are empty cache slots.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if position_bias is not None:
        position_bias = position_bias[..., : key.shape[2]]
        check_mask("position_bias", position_bias, query.device, (*scores[:3], key.shape[2]))
    sink = head_stats_sink(module)
    output_attentions = bool(kwargs.get("output_attentions"))
    dense = output_attentions or (sink is not None and sink.wants_weights)
    backend = getattr(getattr(module, "config", None), "entmax_backend", None) or "auto"
    inputs = prepare_attention(
        query, key, value, alpha, attn_mask=combine_masks(attention_mask, position_bias), is_causal=causal,
        scale=scaling, dropout_p=dropout, enable_gqa=n_kv != n_heads, backend="reference" if dense else backend,
        alpha_in_range=alpha_in_range,
    )
    out, weights = run_layer_attention(inputs, dense, sink)
    return out.transpose(1, 2).contiguous(), weights if output_attentions else None


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
    AttentionMaskInterface.register(name, sdpa_mask)


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
