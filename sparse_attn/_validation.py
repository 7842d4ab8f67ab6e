"""Small argument checks shared by the public functions.

Every check raises ``TypeError`` (wrong kind of object) or ``ValueError`` (right kind,
wrong value) with a message naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
import os
from numbers import Real

import torch

__all__ = [
    "check_tensor",
    "check_floating",
    "check_dim",
    "check_positive_int",
    "check_alpha",
    "check_choice",
    "check_real",
    "check_bool",
    "check_int",
    "check_device",
    "check_bool_mask",
]


def check_tensor(name: str, x) -> None:
    """Raise ``TypeError`` unless ``x`` is a ``torch.Tensor``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_floating(name: str, x) -> None:
    """Raise ``TypeError`` unless ``x`` is a floating-point ``torch.Tensor``."""
    check_tensor(name, x)
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or "
            f"float64), got dtype {x.dtype}"
        )


def check_dim(name: str, dim, ndim: int) -> int:
    """Check that ``dim`` is an int in ``[-ndim, ndim)`` and return it as non-negative.

    Args:
        name: argument name used in the error message.
        dim: the dimension given by the user.
        ndim: number of dimensions of the tensor it indexes.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    if ndim == 0:
        raise ValueError(f"{name}={dim} cannot index a 0-dimensional tensor; give a tensor with at least 1 dimension")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} must be in [{-ndim}, {ndim - 1}] for a {ndim}-d tensor, got {dim}")
    return dim % ndim


def _finite(value: float) -> bool:
    """``math.isfinite`` by comparisons, which ``torch.compile(dynamic=True)`` also traces on a symbolic float (a
    float argument or default of a compiled function)."""
    return -math.inf < value < math.inf


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    """Raise unless ``value`` is an int >= 1 (or ``None`` when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        expected = "a positive int or None" if allow_none else "a positive int"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_real(name: str, value, low: float, low_open: bool, high: float = math.inf) -> float:
    """``value`` as a float, checked finite and in ``(low, high]`` (``[low, high]`` unless ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    bad_low = v <= low if low_open else v < low
    if not _finite(v) or bad_low or v > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be finite and in {bracket}{low}, {high}], got {v}")
    return v


def check_bool(name: str, value) -> None:
    """Raise ``TypeError`` unless ``value`` is a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_int(name: str, value) -> None:
    """Raise ``TypeError`` unless ``value`` is a Python int (bools are rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def check_int_or_0d_tensor(name: str, value):
    """``value`` as an int, or as a detached 0-d int64 tensor when it is given as a non-CPU tensor.

    Accepts a Python int or a 0-d integer tensor on any device (what the ``entmax`` package accepts for its
    ``ignore_index``, e.g. ``y[0]``). A CPU tensor is read once (``.item()``, no device sync); a CUDA tensor is
    kept on its device and compared there, so the check itself reads nothing back.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a 0-d integer tensor, got a tensor of dtype {value.dtype}")
        if value.ndim != 0:
            raise ValueError(f"{name} must be an int or a 0-d integer tensor, got a tensor of shape "
                             f"{tuple(value.shape)}")
        if value.device.type == "cpu":
            return int(value.item())
        return value.detach().to(torch.int64)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or a 0-d integer tensor, got {type(value).__name__}")
    return value


def check_device(name: str, t: torch.Tensor, device: torch.device, of: str = "the input") -> None:
    """Raise ``ValueError`` unless ``t`` is on ``device``; a 0-d CPU tensor is accepted anywhere, as in torch."""
    if t.device != device and not (t.ndim == 0 and t.device.type == "cpu"):
        raise ValueError(f"{name} must be on the device of {of} ({device}), got {t.device}")


def check_bool_mask(name: str, mask, device: torch.device, meaning: str, of: str) -> None:
    """Raise unless ``mask`` is a boolean tensor on ``device`` (the device of ``of``); the caller checks the shape."""
    check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a boolean tensor {meaning}, got dtype {mask.dtype}")
    check_device(name, mask, device, of)


def check_choice(name: str, value, choices) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def check_alpha(name: str, alpha, x: torch.Tensor, dim: int, low: float = 0.0,
                high: float = math.inf) -> tuple[float, float]:
    """Check an entmax ``alpha``: a real number or a floating tensor broadcastable to ``x``.

    A tensor ``alpha`` must broadcast to ``x.shape`` without growing it and have size 1
    along ``dim`` (one alpha per row). Every value must be finite and in ``(low, high]``
    (``low`` excluded). Checking tensor values reads them back to the host, so under
    ``torch.compile`` the values of a tensor alpha are not checked (only its type, shape and
    device) and ``(nan, nan)`` is returned.

    Args:
        name: argument name used in the error message.
        alpha: float or tensor.
        x: the input the mapping is applied to.
        dim: non-negative dimension of ``x`` the mapping normalizes over.
        low, high: the open lower and closed upper bound on alpha.

    Returns:
        ``(min, max)`` of the alpha values (``(nan, nan)`` for an empty tensor or while
        compiling).
    """
    if isinstance(alpha, torch.Tensor):
        if not alpha.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float or a floating-point tensor, got dtype {alpha.dtype}")
        if alpha.ndim > x.ndim:
            raise ValueError(
                f"{name} must be broadcastable to the input shape {tuple(x.shape)} with size 1 "
                f"along dim {dim}, got shape {tuple(alpha.shape)}"
            )
        shape = (1,) * (x.ndim - alpha.ndim) + tuple(alpha.shape)
        ok = all(a in (1, s) for a, s in zip(shape, x.shape)) and shape[dim] == 1
        if not ok:
            raise ValueError(
                f"{name} must be broadcastable to the input shape {tuple(x.shape)} with size 1 "
                f"along dim {dim}, got shape {tuple(alpha.shape)}"
            )
        if alpha.device != x.device and alpha.numel() != 1:
            raise ValueError(f"{name} must be on the input's device {x.device}, got {alpha.device}")
        if alpha.numel() == 0 or torch.compiler.is_compiling():
            return math.nan, math.nan
        lo_val = float(alpha.detach().min())
        hi_val = float(alpha.detach().max())
        bad = not (_finite(lo_val) and _finite(hi_val)) or lo_val <= low or hi_val > high
        if bad:
            raise ValueError(
                f"{name} must be finite and in ({low}, {high}], got values in [{lo_val}, {hi_val}]"
            )
        return lo_val, hi_val
    if isinstance(alpha, bool) or not isinstance(alpha, Real):
        raise TypeError(f"{name} must be a float or a floating-point tensor, got {type(alpha).__name__}")
    a = float(alpha)
    if not _finite(a) or a <= low or a > high:
        raise ValueError(f"{name} must be finite and in ({low}, {high}], got {a}")
    return a, a


_CHECKS_ENABLED = os.environ.get("SPARSE_ATTN_CHECKS", "").strip().lower() not in ("", "0", "false", "no", "off")
_FREE_READ_DEVICES = frozenset({"cpu"})  # device types whose values are read without a synchronization


def set_checks(enabled: bool) -> bool:
    """Turn on (or off) the value checks that read device tensors back to the host.

    Checks of tensor *values* (a tensor ``alpha`` in ``[1, 2]``, a float attention mask free of
    NaN/``+inf`` on the fused path, ``cu_seqlens`` offsets, ``max_seqlen`` bounds) need a
    device-to-host read, which on CUDA is a synchronization on every call. They always run for
    CPU tensors (free there) and, for device tensors, only while this switch is on. Off by
    default; the environment variable ``SPARSE_ATTN_CHECKS=1`` turns it on at import.
    Checks of types, shapes, dtypes, devices and Python numbers always run.

    Args:
        enabled: True to check device tensors' values on every call.

    Returns:
        The previous setting.
    """
    global _CHECKS_ENABLED
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous, _CHECKS_ENABLED = _CHECKS_ENABLED, enabled
    return previous


def checks_enabled() -> bool:
    """Whether :func:`set_checks` (or ``SPARSE_ATTN_CHECKS=1``) turned the device value checks on."""
    return _CHECKS_ENABLED


def values_checkable(*tensors) -> bool:
    """Whether the values of ``tensors`` are checked now: never while compiling; always for CPU
    tensors; for other devices only with :func:`set_checks` on (meta tensors never)."""
    if torch.compiler.is_compiling():
        return False
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if "meta" in devices:
        return False
    return devices <= _FREE_READ_DEVICES or _CHECKS_ENABLED


def check_number(name: str, value, low: float, high: float, high_open: bool = False) -> float:
    """Check a Python real number in ``[low, high]`` (``[low, high)`` when ``high_open``); return it as float."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    value = float(value)
    ok = _finite(value) and low <= value and (value < high if high_open else value <= high)
    if not ok:
        raise ValueError(f"{name} must be finite and in [{low:g}, {high:g}{')' if high_open else ']'}, got {value}")
    return value
