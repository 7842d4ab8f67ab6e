"""Two project-wide rules for the Triton kernels behind the row-wise mappings: autograd wiring and dispatch.

Autograd wiring. Every Triton kernel is reached through a ``torch.library.custom_op``
(namespace ``sparse_attn``) with a ``register_fake`` implementation (output shapes only, so
``torch.compile(fullgraph=True)`` traces through it) and, when it is differentiable, a
``register_autograd`` backward: the fused attention (``sparse_attn.attn._attn_autograd``), the
alpha-entmax row kernels (``sparse_attn.rows._triton_rows``), the 1-d TV prox and the OSCAR prox
with its isotonic-regression kernel (``sparse_attn.rows._structured_rows``). Such an op may also
hold the PyTorch implementation of the same operation, chosen by a flag, so that one
autograd formula serves both (the proxes do). A backward that launches kernels is
first-order only and raises ``RuntimeError`` when asked for a graph
(``create_graph=True``). Pure-PyTorch math with a hand-written gradient and no kernel inside
(the PyTorch path of the mappings, the Fenchel-Young losses, sq-pnorm-max, csoftmax,
csparsemax) stays a ``torch.autograd.Function``.

Dispatch. The public mappings take no backend argument; they always dispatch as ``auto``:

* ``entmax``, ``sparsemax``, ``entmax15``, ``entmax_bisect``: the Triton row kernels run
  when ``X`` is a CUDA tensor of dtype float16, bfloat16 or float32 whose rows have at least
  ``sparse_attn.mappings.TRITON_MIN_ROW`` entries and every alpha is in ``[1, 2]``, outside
  ``torch.compile`` (while tracing, alpha values cannot be read, so the PyTorch path is traced).
  Everything else runs the PyTorch path.
* ``fusedmax``, ``oscarmax``, ``tv_prox``, ``oscar_prox``: the TV-prox / isotonic kernels run
  for CUDA tensors (any row length; computed in float32 or float64), PyTorch otherwise.
* If Triton cannot be imported, ``auto`` runs the PyTorch path and warns once
  (``RuntimeWarning``). Both paths compute the same function to rounding.

A *forced* kernel path never falls back: ``sparse_attn.rows._triton_rows.entmax_rows_triton``,
the launchers in ``sparse_attn.kernels`` and ``entmax_attention(..., backend="triton")``
raise ``ValueError``/``TypeError`` when the kernel cannot run the input (wrong device, dtype
or alpha range); they never silently switch to PyTorch.
"""

from __future__ import annotations

import importlib
import warnings

_failed: set[str] = set()


def load_kernel(module: str, name: str):
    """``getattr(importlib.import_module(module), name)``, or ``None`` (and one warning) if the import fails.

    Used by the ``auto`` dispatch only: a failed import of a Triton module means "run the
    PyTorch path"; it is reported once per module with a ``RuntimeWarning``.
    """
    if module in _failed:
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:  # noqa: BLE001 - any import problem means: use PyTorch
        _failed.add(module)
        warnings.warn(
            f"sparse_attn: Triton kernels of {module} unavailable ({exc!r}); using the PyTorch path",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
