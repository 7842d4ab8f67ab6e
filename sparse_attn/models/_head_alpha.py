"""Per-head alpha of the attention modules: fixed (a float or a buffer) or learnable through a logit, as in
Correia, Niculae and Martins (2019), "Adaptively Sparse Transformers":
``alpha = alpha_min + (alpha_max - alpha_min) * sigmoid(alpha_logit)``. :class:`EntmaxAlpha` holds one for code that
calls attention itself (public as ``sparse_attn.modules.EntmaxAlpha``)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from sparse_attn._validation import check_number
from sparse_attn.attn.attn_inputs import check_head_alpha


def _per_head(name: str, value, num_heads: int, low: float, high: float) -> Tensor:
    """``value`` (float, or tensor of shape () or (num_heads,)) as a float64 CPU tensor (num_heads,)."""
    check_head_alpha(name, value, num_heads)
    if isinstance(value, Tensor):
        vals = value.detach().to("cpu", torch.float64).reshape(-1).expand(num_heads).clone()
    else:
        vals = torch.full((num_heads,), check_number(name, value, low, high), dtype=torch.float64)
    if not torch.isfinite(vals).all() or (vals < low).any() or (vals > high).any():
        raise ValueError(f"{name} must be finite and in [{low:g}, {high:g}], got {vals.tolist()}")
    return vals


def resolve_learnable(learnable, learnable_alpha, default: bool) -> bool:
    """The ``learnable`` flag, accepting the deprecated alias ``learnable_alpha`` (not both)."""
    if learnable_alpha is not None:
        if learnable is not None:
            raise TypeError("got both learnable= and its deprecated alias learnable_alpha=: pass learnable= only")
        warnings.warn("learnable_alpha= is deprecated, use learnable=", DeprecationWarning, stacklevel=3)
        learnable = learnable_alpha
    learnable = default if learnable is None else learnable
    if not isinstance(learnable, bool):
        raise TypeError(f"learnable must be a bool, got {type(learnable).__name__}")
    return learnable


def _check_factory(device, dtype) -> None:
    """``device`` (None or anything ``torch.device`` accepts) and ``dtype`` (None or a floating-point dtype)."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
    if device is not None:
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be None or a torch device, got {device!r}") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but CUDA is not available here (torch.cuda.is_available() is "
                             f"False: a CPU-only torch build or no GPU); use device='cpu' or leave it None")

class _HeadAlphaMixin:
    """Per-head alpha shared by the modules: fixed (a float or a buffer) or learnable (``alpha_logit``).

    The alpha tensors are float32, or float64 in a float64 module: module casts to float16 or
    bfloat16 (``.half()``, ``.to(torch.bfloat16)``) move them but keep them float32, recomputed
    from their values before the cast, so that ``alpha = 1.2`` stays 1.2 and the learnable
    logits keep full precision. Needs ``num_heads`` set before :meth:`_init_alpha` is called.
    """

    def _init_alpha(self, alpha, learnable, alpha_min, alpha_max, alpha_init, device, dtype) -> None:
        _check_factory(device, dtype)
        alpha_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self._alpha_float = None
        self.alpha_min = check_number("alpha_min", alpha_min, 1.0, 2.0)
        self.alpha_max = check_number("alpha_max", alpha_max, 1.0, 2.0)
        check_head_alpha("alpha", alpha, self.num_heads)
        if not learnable:
            self.register_parameter("alpha_logit", None)
            if isinstance(alpha, Tensor):
                vals = _per_head("alpha", alpha, self.num_heads, 1.0, 2.0)
                self.register_buffer("alpha_fixed", vals.to(device=device, dtype=alpha_dtype), persistent=False)
            else:
                self._alpha_float = check_number("alpha", alpha, 1.0, 2.0)
                self.register_buffer("alpha_fixed", None, persistent=False)
            return
        if self.alpha_min >= self.alpha_max:
            raise ValueError(
                f"alpha_min must be < alpha_max, got alpha_min={self.alpha_min}, alpha_max={self.alpha_max}"
            )
        init = _per_head("alpha_init" if alpha_init is not None else "alpha",
                         alpha if alpha_init is None else alpha_init, self.num_heads, 1.0, 2.0)
        if (init <= self.alpha_min).any() or (init >= self.alpha_max).any():
            raise ValueError(
                f"the initial learnable alpha (alpha_init, or alpha when alpha_init is None) must lie strictly "
                f"between alpha_min={self.alpha_min} and alpha_max={self.alpha_max}, got {init.tolist()}"
            )
        frac = (init - self.alpha_min) / (self.alpha_max - self.alpha_min)
        self.alpha_logit = nn.Parameter(torch.logit(frac).to(device=device, dtype=alpha_dtype))
        self.register_buffer("alpha_fixed", None, persistent=False)

    @property
    def learnable_alpha(self) -> bool:
        """Whether alpha is learned (through the parameter ``alpha_logit``)."""
        return self.alpha_logit is not None

    @property
    def alpha(self) -> Tensor:
        """Current alpha of each head, shape ``(num_heads,)``, float32 (float64 for a float64 module).

        Float32 also in a float16/bfloat16 module. Differentiable with respect to ``alpha_logit``
        when alpha is learnable; in range by construction, so computing it reads nothing back
        to the host.
        """
        if self.alpha_logit is not None:
            logit = self.alpha_logit if self.alpha_logit.dtype == torch.float64 else self.alpha_logit.float()
            return self.alpha_min + (self.alpha_max - self.alpha_min) * torch.sigmoid(logit)
        if self.alpha_fixed is not None:
            return self.alpha_fixed
        ref = next(self.parameters(), None)
        return torch.full((self.num_heads,), self._alpha_float, dtype=torch.float32,
                          device=ref.device if ref is not None else None)

    def _alpha_arg(self):
        """alpha as given to entmax_attention: a Python float when it is one fixed value."""
        return self._alpha_float if self._alpha_float is not None else self.alpha

    def _alpha_repr(self) -> str:
        if self.alpha_logit is not None:
            return f"learnable in [{self.alpha_min}, {self.alpha_max}]"
        if self._alpha_float is not None:
            return str(self._alpha_float)
        return str([round(a, 4) for a in self.alpha_fixed.tolist()])

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply``, then alpha tensors cast below float32 are restored as float32 (see class)."""
        before = {name: (t.detach(), None if t.grad is None else t.grad.detach())
                  for name in ("alpha_logit", "alpha_fixed") if (t := getattr(self, name)) is not None}
        super()._apply(fn, recurse)
        for name, (old, old_grad) in before.items():
            new = getattr(self, name)
            if new.dtype in (torch.float32, torch.float64):
                continue
            kept = old.to(device=new.device, dtype=torch.float32)
            if isinstance(new, nn.Parameter):
                new.data = kept
                if new.grad is not None:
                    new.grad = old_grad.to(device=new.device, dtype=torch.float32)
            else:
                self._buffers[name] = kept
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "alpha_logit"
        if self.alpha_logit is not None and key not in state_dict:
            state_dict[key] = self.alpha_logit.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, *args)


class EntmaxAlpha(_HeadAlphaMixin, nn.Module):
    """Holder of one alpha per head, for attention layers that are not :class:`EntmaxMultiheadAttention`.

    Calling it returns the current alpha ``(num_heads,)``. Arguments as the alpha arguments of
    :class:`EntmaxMultiheadAttention` (``learnable`` default False; ``learnable_alpha`` is its
    deprecated alias); a learnable alpha is the parameter ``alpha_logit`` (saved in the state
    dict), a fixed one is not saved.
    """

    def __init__(self, num_heads: int, alpha: float | Tensor = 1.5, learnable: bool | None = None,
                 alpha_min: float = 1.0, alpha_max: float = 2.0, alpha_init: float | Tensor | None = None,
                 device=None, dtype=None, *, learnable_alpha: bool | None = None):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.num_heads = num_heads
        learnable = resolve_learnable(learnable, learnable_alpha, default=False)
        self._init_alpha(alpha, learnable, alpha_min, alpha_max, alpha_init, device, dtype)

    def forward(self) -> Tensor:
        return self.alpha

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, alpha={self._alpha_repr()}"
