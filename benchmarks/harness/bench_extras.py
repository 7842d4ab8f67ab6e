"""The untimed numbers of a benchmark row: max error against the float64 reference and, for the fused
kernels, realized density, fraction of key tiles skipped, passes over K and tile visits."""

from __future__ import annotations

import importlib

import torch
from bench_cases import Inputs, alpha_arg
from bench_common import OOM_ERRORS, free_memory
from bench_methods import FUSED_MODULES, Method

from sparse_attn.attention import entmax_attention
from sparse_attn.kernels._args import alpha_class_of


def visitable_tiles(seq_q: int, seq_k: int, block_m: int, block_n: int, causal: bool) -> int:
    """Number of (query tile, key tile) pairs holding at least one unmasked pair (per batch-head).

    Causal masking is bottom-right aligned (row ``i`` sees key ``j`` iff ``j <= i + seq_k - seq_q``).
    """
    n_kt = -(-seq_k // block_n)
    total = 0
    for qt in range(-(-seq_q // block_m)):
        last_row = min((qt + 1) * block_m, seq_q) - 1
        last_col = last_row + seq_k - seq_q if causal else seq_k - 1
        if last_col >= 0:
            total += min(n_kt, last_col // block_n + 1)
    return total


def count_live_tiles(live: torch.Tensor, n_key_tiles: int) -> int:
    """Set bits of an int32 tile bitmap ``(..., words)`` (bit ``kt % 32`` of word ``kt // 32``) with
    ``kt < n_key_tiles``."""
    words = live.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32, device=live.device)) & 1
    kt = torch.arange(words.shape[-1], device=live.device)[:, None] * 32 + torch.arange(32, device=live.device)
    return int((bits * (kt < n_key_tiles)).sum().item())


def tile_stats(res, seq_q: int, seq_k: int, causal: bool, batch_heads: int, blocks: tuple[int, int]) -> dict:
    """Fraction of visitable tiles a fused forward result marks dead, its passes over K and key tiles loaded
    per query tile.

    ``res`` is what :func:`sparse_attn.kernels.attn.entmax_attn_fwd.entmax_attn_fwd` returns (``live``,
    ``n_passes``, ``tile_visits``); ``blocks`` its ``(block_m, block_n)``.
    """
    block_m, block_n = blocks
    visit = visitable_tiles(seq_q, seq_k, block_m, block_n, causal) * batch_heads
    live = count_live_tiles(res.live, -(-seq_k // block_n))
    passes = res.n_passes.float()
    return {
        "tiles_skipped": 1.0 - live / visit if visit else float("nan"),
        "passes_mean": float(passes.mean().item()),
        "passes_max": float(passes.max().item()),
        "visits_mean": float(res.tile_visits.float().mean().item()),
    }


def fused_blocks(res, head_dim: int) -> tuple[int, int]:
    """``(block_m, block_n)`` of a fused forward result, else from the module's ``fwd_block_sizes(head_dim)``."""
    if getattr(res, "block_m", None) is not None:
        return int(res.block_m), int(res.block_n)
    module = importlib.import_module(FUSED_MODULES[0])
    block_m, block_n = module.fwd_block_sizes(head_dim)[:2]
    return int(block_m), int(block_n)


def visible_pairs(batch: int, heads: int, seq_q: int, seq_k: int, causal: bool) -> int:
    """Number of unmasked (query, key) pairs; causal is bottom-right aligned."""
    if not causal:
        return batch * heads * seq_q * seq_k
    per_row = (torch.arange(seq_q) + seq_k - seq_q + 1).clamp(0, seq_k)
    return batch * heads * int(per_row.sum().item())


def reference_error(fn_out: torch.Tensor, inputs: Inputs, alpha, max_elems: int, cache: dict) -> float:
    """Max abs error of the output's last query rows (first batch item) against the float64 reference.

    Only the last ``r`` rows are compared (``r`` chosen so the reference scores hold at most
    ``max_elems`` entries); bottom-right causal alignment makes those rows a self-contained problem.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
    rows = min(n_q, 128, max(1, max_elems // max(1, heads * n_k)))
    key = (alpha if not isinstance(alpha, torch.Tensor) else tuple(alpha.detach().flatten().tolist()), rows)
    if key not in cache:
        a = alpha.detach().double() if isinstance(alpha, torch.Tensor) else alpha
        with torch.no_grad():
            cache[key] = entmax_attention(
                q[:1, :, n_q - rows:].detach().double(), k[:1].detach().double(), v[:1].detach().double(), a,
                is_causal=inputs.causal, backend="reference")
    ref = cache[key]
    got = fn_out[:1, :, n_q - rows:].detach().double()
    return float((got - ref).abs().max().item())


def fused_stats(fwd, method: Method, inputs: Inputs) -> tuple[dict, object]:
    """``(stats, result)`` of one call of the fused forward ``fwd`` as the timed training forward launches it (its
    alpha class and ``out_u``: no build the timing did not need): realized density, fraction of tiles skipped,
    passes and tile visits."""
    q, k = inputs.q.detach(), inputs.k.detach()
    a = alpha_arg(method.alpha, inputs)
    alpha_t = method.fused_alpha(inputs).detach().float().reshape(-1).expand(q.shape[1]).contiguous()
    cls = None if isinstance(a, torch.Tensor) else alpha_class_of([a])
    with torch.no_grad():
        res = fwd(q, k, inputs.v.detach(), alpha_t, q.shape[-1] ** -0.5, is_causal=inputs.causal, alpha_class=cls,
                  need_out_u=True)
    pairs = visible_pairs(q.shape[0], q.shape[1], q.shape[2], k.shape[2], inputs.causal)
    stats = {"density": float(res.nnz.double().sum().item()) / max(1, pairs)}
    stats.update(tile_stats(res, q.shape[2], k.shape[2], inputs.causal, q.shape[0] * q.shape[1],
                            fused_blocks(res, q.shape[-1])))
    return stats, res


def case_extras(method: Method, inputs: Inputs, fwd, args, ref_cache: dict, device: str,
                out: torch.Tensor | None = None) -> dict:
    """Untimed per-(case, method) numbers: max error vs the float64 reference and, for ``sparse_attn``,
    realized density, fraction of tiles skipped, passes and tile visits (one call of the fused forward).

    ``out`` is the output of a timed forward when there was one (else the method runs once more).
    """
    extra = {}
    try:
        a = alpha_arg(method.alpha, inputs)
        with torch.no_grad():
            if method.method == "sparse_attn":
                stats, res = fused_stats(fwd, method, inputs)
                extra.update(stats)
                out = res.out if out is None else out
            elif out is None:
                out = method.build(inputs)()
            extra["max_abs_err"] = reference_error(out, inputs, a, args.check_max_elems, ref_cache)
            if not bool(torch.isfinite(out).all()):
                extra["note"] = "output has NaN/inf"
    except OOM_ERRORS:
        free_memory(device, collect=True)
    except Exception as exc:  # the timing stands even if the untimed extras fail
        extra["note"] = f"extras failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    return extra
