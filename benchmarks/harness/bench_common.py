"""What every part of the attention benchmark shares: the result schema, status names and imports.

Importing this module first sets ``TRITON_INTERPRET=1`` when there is no CUDA device (before
``triton`` is imported) and makes ``sparse_attn`` importable from an uninstalled checkout.
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]

MODES = ("fwd", "bwd", "fwd+bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
OK, OOM, UNAVAILABLE, ERROR, SKIPPED = "ok", "OOM", "unavailable", "error", "skipped"
MIXED, LEARNABLE = "mixed", "learnable"
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}

COLUMNS = (
    "group", "method", "backend", "alpha", "mode", "dtype", "batch", "heads", "seq_q", "seq_k",
    "head_dim", "causal", "score_mult", "target_density", "status", "note", "ms", "ms_q20",
    "ms_q80", "tflops", "peak_mem_mib", "density", "tiles_skipped", "passes_mean", "passes_max", "visits_mean",
    "time_vs_sdpa_flash", "max_abs_err",
)
FLOAT_COLUMNS = (
    "score_mult", "target_density", "ms", "ms_q20", "ms_q80", "tflops", "peak_mem_mib", "density",
    "tiles_skipped", "passes_mean", "passes_max", "visits_mean", "time_vs_sdpa_flash", "max_abs_err",
)
INT_COLUMNS = ("batch", "heads", "seq_q", "seq_k", "head_dim")
CASE_COLUMNS = ("group", "dtype", "batch", "heads", "seq_q", "seq_k", "head_dim", "causal",
                "score_mult", "target_density")
ROW_KEY_COLUMNS = CASE_COLUMNS + ("method", "backend", "alpha", "mode")
STAMP_KEYS = ("gpu", "driver", "torch", "triton", "cuda", "python", "commit", "date", "command")

OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


class Unavailable(RuntimeError):
    """A method that cannot run on this machine or shape (e.g. a pinned SDPA backend without a kernel)."""


def import_sparse_attn():
    """Import the package from an installed copy, or straight from this checkout.

    ``sparse_attn.kernels`` lives in the top-level ``kernels/`` folder (a package-dir mapping of
    the installed package), so an uninstalled checkout needs that folder on the package path.
    """
    try:
        import sparse_attn
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import sparse_attn
    try:
        importlib.import_module("sparse_attn.kernels")
    except ImportError:
        sparse_attn.__path__.append(str(REPO_ROOT))
    return sparse_attn


import_sparse_attn()


def optional_import(module: str):
    """``(module, "")``, or ``(None, "<ExceptionType>: <message>")`` when importing it fails in any way."""
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # any import failure means "not available here"
        return None, f"{type(exc).__name__}: {exc}"


def free_memory(device: str, collect: bool = False):
    """Return cached CUDA memory; ``collect`` also runs the (slow) cycle collector, used after an OOM."""
    if collect:
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def fmt(value, digits: int = 3) -> str:
    """Cell text: ``""`` for a value not measured (None), ``"nan"`` for a measured NaN."""
    if value is None:
        return ""
    if isinstance(value, float) and not math.isnan(value):
        return f"{value:.{digits}g}"
    return str(value)


def split_resumed(base: dict, modes, previous: dict, key=None) -> tuple[list[dict], list[dict]]:
    """The rows ``{**base, "mode": m}`` to run, and the rows kept for them from an earlier run (``previous``, keyed by
    ``key(row)``, default :func:`row_key`)."""
    key = key or row_key
    todo, kept = [], []
    for mode in modes:
        row = {**base, "mode": mode}
        old = previous.get(key(row))
        (todo if old is None else kept).append(row if old is None else old)
    return todo, kept


def row_key(row: dict) -> tuple:
    """The identity of a result row (case, method, backend, alpha, mode) as CSV cell text."""
    return tuple(fmt(row[c], 6) for c in ROW_KEY_COLUMNS)
