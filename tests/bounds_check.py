"""Out-of-bounds checks for Triton kernels run under the interpreter (``SPARSE_ATTN_BOUNDS_CHECK=1``).

On a GPU an unmasked load or store outside every allocation is a CUDA "illegal memory access" that poisons the
process; one inside a neighbouring allocation silently reads or writes someone else's data. The interpreter does
neither: it dereferences raw host addresses, so such a kernel passes every CPU test. With the check on, every
kernel launch records the memory of its tensor arguments (each one's whole storage, in bytes), and every load,
store and atomic whose lane is enabled must touch bytes inside one of them, else the launch fails with
``OutOfBounds`` naming the kernel, the operation and the first offending address relative to the nearest argument.
Masked-off lanes are never checked (a GPU does not touch them either).

``install()`` patches the interpreter (tests/conftest.py calls it when the variable is set); ``installed()`` says
whether it is on.
"""

from __future__ import annotations

import contextvars

import numpy as np
import torch

_RANGES: contextvars.ContextVar = contextvars.ContextVar("bounds_ranges", default=None)
_INSTALLED = False
_ORIGINALS: dict = {}


class OutOfBounds(AssertionError):
    """An enabled lane of a load, store or atomic touches memory outside every tensor argument of its launch."""


def _element_bytes(ptrs) -> int:
    ty = ptrs.get_element_ty()
    return max(1, getattr(ty, "primitive_bitwidth", 8) // 8)


def _check(op: str, ptrs, mask) -> None:
    ranges = _RANGES.get()
    if ranges is None:
        return
    addr = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        enabled = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        addr = addr[enabled]
    addr = addr.reshape(-1)
    if addr.size == 0:
        return
    starts, ends, names = ranges
    size = np.uint64(_element_bytes(ptrs))
    i = np.searchsorted(starts, addr, side="right") - 1
    ok = (i >= 0) & (addr + size <= ends[np.maximum(i, 0)])
    if ok.all():
        return
    bad = int(addr[~ok][0])
    j = int(np.argmin([min(abs(bad - int(s)), abs(bad - int(e))) for s, e in zip(starts, ends)]))
    where = (f"{bad - int(starts[j])} bytes from the start of {names[j]} ({int(ends[j] - starts[j])} bytes)"
             if len(names) else "no tensor arguments")
    raise OutOfBounds(f"{op}: {int((~ok).sum())} enabled lane(s) outside every tensor argument; first at {where}")


def install() -> None:
    """Patch the Triton interpreter so every launch checks its memory accesses (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    _ORIGINALS.update(load=builder.create_masked_load, store=builder.create_masked_store,
                      rmw=builder.create_atomic_rmw, cas=builder.create_atomic_cas,
                      init=interp.GridExecutor._init_args_hst)
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check("load", ptrs, mask)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check("store", ptrs, mask)
        return store(self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        _check("atomic", ptr, mask)
        return rmw(self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _check("atomic_cas", ptr, None)
        return cas(self, ptr, cmp, val, sem, scope)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas

    init_args = interp.GridExecutor._init_args_hst

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        spans = {}

        def visit(name, arg):
            if isinstance(arg, tuple):
                for k, a in enumerate(arg):
                    visit(f"{name}[{k}]", a)
            elif hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                start = storage.data_ptr()
                spans.setdefault(start, (start + storage.nbytes(), name))
            elif hasattr(arg, "base") and hasattr(arg.base, "untyped_storage"):  # host TensorDescriptor
                visit(name, arg.base)

        names = getattr(self, "arg_names", None) or [f"arg{k}" for k in range(len(args_hst))]
        for name, arg in zip(names, args_hst):
            visit(name, arg)
        for name, arg in kwargs_hst.items():
            visit(name, arg)
        order = sorted(spans)
        _RANGES.set((np.array(order, dtype=np.uint64), np.array([spans[s][0] for s in order], dtype=np.uint64),
                     [f"{spans[s][1]} of {self.fn.__name__}" for s in order]))
        return args_hst, kwargs_hst

    interp.GridExecutor._init_args_hst = init_args_hst
    _INSTALLED = True


def installed() -> bool:
    return _INSTALLED


def uninstall() -> None:
    """Undo :func:`install` (a no-op when it is not installed)."""
    global _INSTALLED
    if not _INSTALLED:
        return
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    builder.create_masked_load, builder.create_masked_store = _ORIGINALS["load"], _ORIGINALS["store"]
    builder.create_atomic_rmw, builder.create_atomic_cas = _ORIGINALS["rmw"], _ORIGINALS["cas"]
    interp.GridExecutor._init_args_hst = _ORIGINALS["init"]
    _RANGES.set(None)
    _INSTALLED = False


def emulate_gpu_launches() -> None:
    """Make the launchers choose as on a GPU while the interpreter runs the kernels: the pinned GPU tiles of the
    forward, backward and decode (``_pick_config`` with ``interpret=False``), the TMA tensor descriptors of the
    kernels that take them on sm_90 where the layout allows (``_args.tma_device``), and the decode's key-range splits
    of a 132-SM device (up to 32)."""
    from sparse_attn.kernels import _args
    from sparse_attn.kernels.attn import _decode_launch, entmax_attn_bwd, entmax_attn_fwd

    for module in (entmax_attn_fwd, entmax_attn_bwd, _decode_launch):
        pick, pos = module._pick_config, _INTERPRET_POS[module.__name__.rsplit(".", 1)[-1]]

        def gpu_pick(*args, _pick=pick, _pos=pos, **kwargs):
            if "interpret" in kwargs:
                kwargs["interpret"] = False
            else:
                args = tuple(False if i == _pos else a for i, a in enumerate(args))
            return _pick(*args, **kwargs)

        module._pick_config = gpu_pick
    _args.tma_device = lambda device: True
    _decode_launch.sm_count = lambda device: 132
    splits = _decode_launch.default_num_splits

    def gpu_splits(batch, n_kv_heads, n_row_tiles, n_kblocks, device):
        return splits(batch, n_kv_heads, n_row_tiles, n_kblocks, torch.device("cuda"))

    _decode_launch.default_num_splits = gpu_splits


# the position of ``interpret`` in each module's ``_pick_config``
_INTERPRET_POS = {"entmax_attn_fwd": 1, "entmax_attn_bwd": 1, "_decode_launch": 2}
