"""Entmax attention for modules that call ``torch.nn.functional.scaled_dot_product_attention`` themselves.

Vision Transformers (timm), research code and some Hugging Face architectures (e.g. Falcon loaded with
``attn_implementation="sdpa"``) compute attention with a direct call to PyTorch's SDPA, which no
module swap can reach. Here the call is intercepted while a chosen module runs its forward (a
``torch.overrides.TorchFunctionMode``, so ``from torch.nn.functional import scaled_dot_product_attention``
is caught too) and answered by :func:`sparse_attn.entmax_attention` with the module's own per-head alpha::

    from sparse_attn.sdpa import swap_sdpa_attention
    names = swap_sdpa_attention(vit, alpha=1.5, learnable=True)   # every module whose forward calls SDPA
    opt = torch.optim.AdamW(vit.parameters())                       # includes each <module>.entmax_alpha

* :func:`attach_entmax_sdpa` does it for one module: it gets a submodule ``entmax_alpha``
  (:class:`sparse_attn.modules.EntmaxAlpha`, fixed or learnable, saved in the state dict next to the
  module's own unchanged parameters) and two forward hooks; :func:`detach_entmax_sdpa` undoes it.
* :func:`swap_sdpa_attention` attaches to every module of a model whose class's ``forward`` calls
  ``scaled_dot_product_attention`` (or to the modules you name).
* :func:`entmax_sdpa` is a context manager routing every SDPA call in its block, with a fixed alpha.
* :func:`sparse_attn.record_head_stats` records the attached modules (density, alpha, diversity).

SDPA's arguments keep their meaning: ``attn_mask`` boolean (True = attend) or additive float,
``dropout_p``, ``scale``, ``enable_gqa``, and ``is_causal`` with SDPA's top-left alignment (query ``i``
sees key ``j <= i``; with ``attn_mask`` both apply). Tensors must be 4-d ``(batch, heads, seq, head_dim)``;
as in SDPA, keys and values with batch size 1 or a single head broadcast (the latter is multi-query
attention).
Unlike SDPA, a query with no key to attend to gives zeros, not NaN. Calls made while the module's
forward runs, inside submodules too, are routed. Under ``torch.compile`` the routed call runs eagerly
(``torch.compiler.disable``: a graph break, so ``fullgraph=True`` raises instead of tracing it: traced
inside the mode, two learnable modules in one graph gave wrong outputs with torch 2.13).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from sparse_attn._validation import check_number
from sparse_attn.attn.attention import run_layer_attention
from sparse_attn.attn.attn_inputs import check_head_alpha, prepare_attention
from sparse_attn.attn.masks import causal_keep, combine_masks
from sparse_attn.models._sdpa_callers import _SDPA, sdpa_modules
from sparse_attn.models.modules import EntmaxAlpha, resolve_learnable
from sparse_attn.models.stats import head_stats_sink, register_layer_type

__all__ = ["attach_entmax_sdpa", "detach_entmax_sdpa", "entmax_sdpa", "sdpa_modules", "swap_sdpa_attention"]

_SDPA_SIGNATURE = inspect.Signature([
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
    for name, default in (("query", inspect.Parameter.empty), ("key", inspect.Parameter.empty),
                          ("value", inspect.Parameter.empty), ("attn_mask", None), ("dropout_p", 0.0),
                          ("is_causal", False), ("scale", None), ("enable_gqa", False))
])
_STATE = "_entmax_sdpa"
_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads")
_ROUTING = threading.local()  # .busy: an SDPA call is being answered (our own SDPA calls then run as they are)


class _AttachState:
    """What :func:`attach_entmax_sdpa` stored on a module: its backend, hook handles and the active routers."""

    def __init__(self, backend: str):
        self.backend = backend
        self.handles = []
        self.active = []
        self.warned = False


@torch.compiler.disable(reason="entmax attention answering an intercepted SDPA call runs eagerly")
def _sdpa_as_entmax(alpha, alpha_in_range: bool, backend: str, owner: nn.Module | None, args, kwargs) -> Tensor:
    """Answer one SDPA call with entmax attention (see the module docstring for the conventions)."""
    bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    q, k, v = a["query"], a["key"], a["value"]
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"entmax attention routes 4-d scaled_dot_product_attention calls (batch, heads, seq, head_dim); "
                f"got {name} of shape {got}"
            )
    gqa = a["enable_gqa"]
    if k.shape[0] != q.shape[0] and k.shape[0] == 1:  # SDPA broadcasts batch dims
        k, v = k.expand(q.shape[0], *k.shape[1:]), v.expand(q.shape[0], *v.shape[1:])
    if k.shape[1] == 1 and q.shape[1] != 1 and gqa is False:  # ... and a single key/value head: multi-query
        gqa = True
    mask, causal = a["attn_mask"], a["is_causal"]
    if not isinstance(causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(causal).__name__}")
    if causal and (mask is not None or q.shape[2] != k.shape[2]):
        # SDPA's causal mask is top-left aligned; ours is bottom-right: the same only when Nq == Nk
        mask, causal = combine_masks(mask, causal_keep(q.shape[2], k.shape[2], q.device, bottom_right=False)), False
    sink = head_stats_sink(owner) if owner is not None else None
    dense = sink is not None and sink.wants_weights
    if dense and backend == "triton":
        raise ValueError("backend='triton' cannot give the weights a record_head_stats(..., diversity=True) recorder "
                         "needs (only the materialized reference computes them): record without diversity, or use "
                         "backend='auto' or 'reference'")
    inputs = prepare_attention(
        q, k, v, alpha, attn_mask=mask, is_causal=causal, scale=a["scale"], dropout_p=a["dropout_p"],
        enable_gqa=gqa, backend="reference" if dense else backend, alpha_in_range=alpha_in_range,
    )
    return run_layer_attention(inputs, dense, sink)[0]


class _Router(TorchFunctionMode):
    """Answers ``scaled_dot_product_attention`` calls with entmax attention; other calls run unchanged.

    ``owner``: the attached module (its ``entmax_alpha`` and head-statistics sink), or None with a fixed
    ``alpha`` (:func:`entmax_sdpa`).
    """

    def __init__(self, owner: nn.Module | None, alpha=None, backend: str = "auto"):
        super().__init__()
        self.owner, self.alpha, self.backend = owner, alpha, backend
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA or getattr(_ROUTING, "busy", False):
            return func(*args, **kwargs)
        _ROUTING.busy = True
        self.calls += 1
        try:
            if self.owner is None:
                return _sdpa_as_entmax(self.alpha, False, self.backend, None, args, kwargs)
            return _sdpa_as_entmax(self.owner.entmax_alpha._alpha_arg(), True, getattr(self.owner, _STATE).backend,
                                   self.owner, args, kwargs)
        finally:
            _ROUTING.busy = False


def _enter(module: nn.Module, args) -> None:
    router = _Router(module)
    getattr(module, _STATE).active.append(router)
    router.__enter__()


def _leave(module: nn.Module, args, output) -> None:
    """Stop routing; warn (once) when the forward returned without any SDPA call (output None: it raised)."""
    state = getattr(module, _STATE)
    if not state.active:
        return
    router = state.active.pop()
    router.__exit__(None, None, None)
    if router.calls == 0 and output is not None and not state.warned and not torch.compiler.is_compiling():
        state.warned = True
        warnings.warn(
            f"{type(module).__name__} routes scaled_dot_product_attention to entmax attention, but its forward made "
            "no such call: it computed its attention another way, with softmax (e.g. timm's fused_attn=False)",
            UserWarning, stacklevel=2,
        )


def _infer_heads(module: nn.Module, num_heads) -> int:
    if num_heads is None:
        num_heads = next((n for attr in _HEAD_ATTRIBUTES if isinstance(n := getattr(module, attr, None), int)), None)
        if num_heads is None:
            raise ValueError(
                f"cannot tell the number of heads of {type(module).__name__} (no attribute among {_HEAD_ATTRIBUTES}): "
                "pass num_heads="
            )
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    return num_heads


def attach_entmax_sdpa(
    module: nn.Module,
    alpha: float | Tensor = 1.5,
    learnable: bool | None = None,
    alpha_min: float = 1.0,
    alpha_max: float = 2.0,
    alpha_init: float | Tensor | None = None,
    *,
    num_heads: int | None = None,
    backend: str = "auto",
) -> EntmaxAlpha:
    """Make ``module``'s forward answer its ``scaled_dot_product_attention`` calls with entmax attention, in place.

    The module gets the submodule ``entmax_alpha`` (:class:`sparse_attn.modules.EntmaxAlpha`, on the
    device of its parameters), a forward pre-hook that starts routing and a forward hook that stops it
    (also when the forward raises). Its own parameters and their state-dict names are unchanged; a
    learnable alpha adds ``entmax_alpha.alpha_logit``, which ``module.parameters()`` yields.

    Args:
        module: any ``nn.Module`` whose forward (or a submodule's) calls SDPA on 4-d tensors.
        alpha: float in [1, 2] or a ``(num_heads,)`` tensor: the fixed alpha of each head, or the
            initial one when learnable. Default 1.5.
        learnable: learn one alpha per head (``alpha_min + (alpha_max - alpha_min) * sigmoid(logit)``).
            Default False.
        alpha_min, alpha_max, alpha_init: range and initial value of a learnable alpha, as
            :class:`sparse_attn.EntmaxMultiheadAttention`.
        num_heads: number of heads of the SDPA calls; default: the module's ``num_heads`` (or
            ``num_attention_heads``, ``n_heads``, ``n_head``, ``heads``) attribute.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see :func:`sparse_attn.entmax_attention`).

    Returns:
        The attached :class:`EntmaxAlpha`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if getattr(module, _STATE, None) is not None:
        raise ValueError(f"{type(module).__name__} already routes SDPA to entmax attention; detach_entmax_sdpa first")
    if not isinstance(backend, str) or backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'reference'), got {backend!r}")
    learnable = resolve_learnable(learnable, None, default=False)
    ref = next(module.parameters(), None)
    holder = EntmaxAlpha(_infer_heads(module, num_heads), alpha=alpha, learnable=learnable, alpha_min=alpha_min,
                         alpha_max=alpha_max, alpha_init=alpha_init, device=ref.device if ref is not None else None)
    state = _AttachState(backend)
    module.entmax_alpha = holder
    setattr(module, _STATE, state)
    state.handles = [module.register_forward_pre_hook(_enter),
                     module.register_forward_hook(_leave, always_call=True)]
    return holder


def detach_entmax_sdpa(module: nn.Module) -> None:
    """Undo :func:`attach_entmax_sdpa`: remove the hooks and the ``entmax_alpha`` submodule."""
    state = getattr(module, _STATE, None)
    if state is None:
        raise ValueError(f"{type(module).__name__} does not route SDPA to entmax attention (nothing to detach)")
    for handle in state.handles:
        handle.remove()
    delattr(module, _STATE)
    del module.entmax_alpha


def swap_sdpa_attention(model: nn.Module, alpha: float | Tensor = 1.5, learnable: bool | None = None, *,
                        modules=None, **kw) -> list[str]:
    """Attach entmax attention (:func:`attach_entmax_sdpa`) to the SDPA-calling modules of ``model``, in place.

    Args:
        model: any ``nn.Module``.
        alpha, learnable: as :func:`attach_entmax_sdpa` (one alpha holder per module).
        modules: which modules: None (default) for :func:`sdpa_modules`; a class or tuple of classes
            (every instance); or a callable ``f(name, module) -> bool``. Modules already attached are
            skipped.
        **kw: ``alpha_min``, ``alpha_max``, ``alpha_init``, ``num_heads``, ``backend`` of
            :func:`attach_entmax_sdpa`.

    Returns:
        The qualified names of the modules attached to (a ``UserWarning`` when none).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if modules is None:
        targets = sdpa_modules(model)
    elif isinstance(modules, type) or (isinstance(modules, tuple) and all(isinstance(c, type) for c in modules)):
        targets = [(n, m) for n, m in model.named_modules() if isinstance(m, modules)]
    elif callable(modules):
        targets = [(n, m) for n, m in model.named_modules() if modules(n, m)]
    else:
        raise TypeError(
            f"modules must be None, a class, a tuple of classes or a callable, got {type(modules).__name__}")
    attached = []
    for name, m in targets:
        if getattr(m, _STATE, None) is None:
            attach_entmax_sdpa(m, alpha, learnable, **kw)
            attached.append(name)
    if not attached:
        warnings.warn(
            f"swap_sdpa_attention attached to no module of {type(model).__name__}: none calls "
            "torch.nn.functional.scaled_dot_product_attention in its forward (or all are attached already); "
            "for nn.MultiheadAttention use sparse_attn.swap_attention, for Hugging Face models "
            "attn_implementation='entmax'",
            UserWarning, stacklevel=2,
        )
    return attached


@contextlib.contextmanager
def entmax_sdpa(alpha: float | Tensor = 1.5, backend: str = "auto"):
    """Route every ``scaled_dot_product_attention`` call made inside the block to entmax attention.

    Args:
        alpha: float in [1, 2], or a per-head tensor ``()`` / ``(heads,)`` (differentiable; its values are
            checked as :func:`sparse_attn.entmax_attention` checks them). Default 1.5.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Example::

        with entmax_sdpa(alpha=1.5):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # 1.5-entmax weights
    """
    if isinstance(alpha, Tensor):
        check_head_alpha("alpha", alpha, alpha.numel() or 1)
    elif isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a float or a tensor, got {type(alpha).__name__}")
    else:
        alpha = check_number("alpha", alpha, 1.0, 2.0)
    if not isinstance(backend, str) or backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'reference'), got {backend!r}")
    with _Router(None, alpha, backend):
        yield


register_layer_type(lambda m: getattr(m, _STATE, None) is not None, lambda m: m.entmax_alpha.alpha)
