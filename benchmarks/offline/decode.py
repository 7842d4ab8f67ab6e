"""Decode-step counters of the split-K entmax kernel (``kernels/attn/entmax_decode.py``), and GPU timings when a GPU is
at hand.

CPU (``TRITON_INTERPRET=1``, the default without CUDA): for alpha in {1, 1.25, 1.5, 2} and caches with random
keys at two temperatures (score std 1 and 3), flat scores (std 0.3) and locally correlated tokens (AR(1) keys,
the query close to the last key), one decode step (``Nq = 1``, GQA group 4) prints per configuration:

* ``passes``: mean / max over row tiles (score pass and value pass included),
* ``K``: key blocks read from the cache by the score pass, per (sequence, kv head) (all blocks),
* ``cand``: score blocks re-read (from the stored scores) by all candidate passes, as a fraction of ``K``,
* ``zval``: score blocks read by the value pass, ``V``: value blocks read from the cache (those with a positive
  weight), both as fractions of ``K``,
* ``bytes``: cache bytes read over those of one softmax pass (K and V once): ``(K + V) / 2K``,
* ``skip mm`` / ``skip ball``: fraction of key blocks that per-block key summaries would let the score pass skip
  (an upper bound on each block's scores below the final row max minus 1, where no key can have weight):
  ``mm`` bounds ``q.k`` with per-dimension min / max of the block's keys, ``ball`` with the block's mean key and
  radius. Measured, not implemented: see docs/decode.md.
* ``err`` / ``ratio``: max |out - out64| and its ratio to a FlashAttention-style pipeline in the same dtype
  (exact float64 threshold, weights rounded to the dtype before the value product; ``passes.pipeline_out``).

GPU (``--gpu``): median time of one decode step (``triton.testing.do_bench``) against
``torch.nn.functional.scaled_dot_product_attention`` on the same (contiguous) cache, for a few batch sizes and
contexts, with the pass and block counters of the run; then the same steps replayed from CUDA graphs (``graph``
columns: no host work) and the host-bound rate of eager calls issued back to back (``host us``).

Offline builds (``--sm90``; no GPU needed): every kernel of a decode step compiled for sm_90 with the launch
specialization (``benchmarks/offline/sm90_build.py``), registers, spills, shared memory, async copies, instruction mix.

Usage: ``python benchmarks/offline/decode.py [--n 2048] [--dtype bf16 fp32] [--alpha ...] [--dist ...] [--quick]
[--markdown] [--gpu] [--sm90 [--d 64 128 256]] [--sm90-check]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

if "--sm90" in sys.argv or "--sm90-check" in sys.argv or "--gpu" in sys.argv:
    # offline builds and GPU timings: the kernels must be real JIT functions (passes.py, imported below, turns the
    # interpreter on for its own counters unless this is set first)
    os.environ["TRITON_INTERPRET"] = "0"
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from passes import make_inputs, pipeline_out  # noqa: E402

from sparse_attn.kernels._args import CLASS_NAMES  # noqa: E402
from sparse_attn.kernels.attn import entmax_decode as dec  # noqa: E402

DISTS = ("std1", "std3", "flat", "local")
ALPHAS = (1.0, 1.25, 1.5, 2.0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_cache(dist: str, n: int, d: int, n_kv_heads: int, group: int, seed: int):
    """q ``(1, Hk * group, 1, d)``, k, v ``(1, Hk, n, d)`` in float32: the sequences of ``passes.make_inputs``, with
    the queries of the last ``group`` positions of each kv head's sequence as that head's decode queries (for
    ``"local"``, each close to its own, recent key)."""
    q, k, v = make_inputs(dist, n, d, n_kv_heads, seed)
    return q[:, :, -group:].reshape(1, n_kv_heads * group, 1, d), k, v


def summary_skips(q, k, s64, alpha: float, scale: float, block: int):
    """Fractions of key blocks whose score bound (min/max box, mean + radius ball) lies below ``max - 1/(alpha-1)``
    for every query row of the kv head (z-scale ``m - 1``: such a block holds no weight)."""
    if alpha == 1.0:
        return 0.0, 0.0
    group = q.shape[1] // k.shape[1]
    n = k.shape[2]
    nb = n // block
    kb = k[0, :, : nb * block].double().reshape(k.shape[1], nb, block, -1)  # (Hk, nb, block, d)
    qh = q[0, :, 0].double().reshape(k.shape[1], group, -1)  # (Hk, group, d)
    kmin, kmax = kb.amin(2), kb.amax(2)
    box = torch.maximum(qh[:, :, None] * kmin[:, None], qh[:, :, None] * kmax[:, None]).sum(-1) * scale
    centre = kb.mean(2)
    radius = (kb - centre[:, :, None]).norm(dim=-1).amax(2)
    ball = (torch.einsum("hgd,hbd->hgb", qh, centre) + qh.norm(dim=-1)[..., None] * radius[:, None]) * scale
    floor = s64[0, :, 0].reshape(k.shape[1], group, -1).amax(-1) - 1.0 / (alpha - 1)  # (Hk, group)
    skip_box = (box <= floor[..., None]).all(1).double().mean().item()
    skip_ball = (ball <= floor[..., None]).all(1).double().mean().item()
    return skip_box, skip_ball


def measure(dist, n, alpha, dtype, n_kv_heads=1, group=4, d=64, seed=0, block=64, splits=4):
    q, k, v = make_cache(dist, n, d, n_kv_heads, group, seed + n)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = d ** -0.5
    seqlens = torch.full((1,), n, dtype=torch.int32)
    t0 = time.perf_counter()
    res = dec.entmax_decode_fwd(q, k, v, seqlens, alpha, scale, num_splits=splits, block_n=block)
    secs = time.perf_counter() - t0
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out_lp, out64 = pipeline_out(q, k_rep, v_rep, alpha, scale, dtype)
    s64 = (q.double() @ k_rep.double().transpose(-1, -2)) * scale
    err = (res.out.double() - out64).abs().max().item()
    err_ref = (out_lp - out64).abs().max().item()
    reads = res.blocks_read.sum(dim=(0, 1, 2, 3, 4)).double()  # per slot
    per_tile = n_kv_heads * res.n_passes.shape[-1]
    k_blocks = reads[0].item() / per_tile
    cand = reads[1:-2].sum().item() / per_tile
    zval = reads[-2].item() / per_tile
    vblocks = reads[-1].item() / per_tile
    skip_box, skip_ball = summary_skips(q, k, s64, alpha, scale, block)
    passes = res.n_passes[res.n_passes > 0].double()
    return dict(dist=dist, n=n, alpha=alpha, dtype=str(dtype).replace("torch.", ""), passes=passes.mean().item(),
                passes_max=int(passes.max().item()), k_blocks=k_blocks, cand=cand / k_blocks,
                zval=zval / k_blocks, v=vblocks / k_blocks, bytes=(k_blocks + vblocks) / (2 * k_blocks),
                skip_box=skip_box, skip_ball=skip_ball, err=err, ratio=err / max(err_ref, 1e-30), secs=secs)


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after two eager warm-up calls on a side stream), as its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _host_us(fn, calls: int = 200) -> float:
    """Microseconds per call of ``fn`` issued back to back with one synchronization at the end: the host's rate when
    it, not the GPU, is the bottleneck (for small steps)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def gpu_timings(dtype, contexts=(1024, 8192, 32768), batches=(1, 8, 32), heads=32, kv_heads=8, d=128, window=4096):
    """Median milliseconds of one decode step: entmax (alpha 1.5, 1; alpha 1.5 with a ``window``-key sliding window)
    vs SDPA, contiguous cache, Nq = 1; the same steps replayed from CUDA graphs; the microseconds per eager call
    issued back to back (host-bound rate) at alpha = 1.5 and for SDPA."""
    import triton.testing

    from sparse_attn.decode import entmax_decode

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} dtype {dtype} Hq {heads} Hk {kv_heads} D {d}")
    print(f"| B | context | SDPA ms | alpha=1 ms | alpha=1.5 ms | alpha=1.5, window {window} ms | passes (1.5) "
          "| V blocks read (1.5) | SDPA graph ms | alpha=1 graph ms | alpha=1.5 graph ms | SDPA host us | "
          "alpha=1.5 host us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in contexts:
        for b in batches:
            q = torch.randn(b, heads, 1, d, device="cuda", dtype=dtype)
            k = torch.randn(b, kv_heads, n, d, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
            steps = {
                "sdpa": functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=True),
                "soft": functools.partial(entmax_decode, q, k, v, seqlens, 1.0),
                "ent": functools.partial(entmax_decode, q, k, v, seqlens, 1.5),
                "win": functools.partial(entmax_decode, q, k, v, seqlens, 1.5, window_size=(window - 1, 0)),
            }
            ms = {name: triton.testing.do_bench(fn) for name, fn in steps.items()}
            graph_ms = {name: triton.testing.do_bench(_graphed(steps[name])) for name in ("sdpa", "soft", "ent")}
            host = {name: _host_us(steps[name]) for name in ("sdpa", "ent")}
            res = dec.entmax_decode_fwd(q, k, v, seqlens, 1.5, d ** -0.5)
            reads = res.blocks_read.sum(dim=(0, 1, 2, 3, 4)).double()
            print(f"| {b} | {n} | {ms['sdpa']:.3f} | {ms['soft']:.3f} | {ms['ent']:.3f} | {ms['win']:.3f} | "
                  f"{res.n_passes.double().mean().item():.2f} | {reads[-1].item() / reads[0].item():.2f} | "
                  f"{graph_ms['sdpa']:.3f} | {graph_ms['soft']:.3f} | {graph_ms['ent']:.3f} | {host['sdpa']:.0f} | "
                  f"{host['ent']:.0f} |", flush=True)


SM90_CLASSES = {"softmax": 1.0, "sparsemax": 2.0, "entmax15": 1.5, "general": 1.25, "mixed": None}


def sm90_builds(head_dim: int, alpha_class: str, paged: bool = True, mask: str | None = None, causal: bool = False,
                dtype=torch.bfloat16, batch: int = 4, n: int = 4096, heads: int = 32, kv_heads: int = 8,
                variants: bool = False, hint: bool = False):
    """Build every kernel one decode step launches (the score and the value pass of each alpha class, each with its
    last-program part: the candidate passes, the combine) for sm_90 as the launcher launches it
    (``benchmarks/offline/sm90_build.py``); one analysis dict per distinct kernel.

    ``mask``: None, ``"float"`` (an additive ``(B, 1, 1, Nk)`` bias) or ``"bool"`` (a keep mask). ``variants``:
    every attention variant at once (a ``(1024, 0)`` window, ALiBi, a soft cap, sinks, ``Dv = head_dim / 2``).
    ``hint``: with a threshold hint (``tau_hint``).
    """
    from sm90_build import analyse, captured_launches, compile_like_launch

    q = torch.empty(batch, heads, 1, head_dim, dtype=dtype)
    if paged:
        k = torch.empty(batch * n // 16 + 8, 16, kv_heads, head_dim, dtype=dtype)
        table = torch.zeros(batch, n // 16, dtype=torch.int32)
    else:
        k, table = torch.empty(batch, kv_heads, n, head_dim, dtype=dtype), None
    bias = None if mask is None else torch.empty(batch, 1, 1, n, dtype=torch.bool if mask == "bool" else dtype)
    v = torch.empty(*k.shape[:-1], max(16, head_dim // 2) if variants else head_dim, dtype=dtype)
    extra = dict(window_size=(1024, 0), alibi_slopes=torch.full((heads,), 0.05), softcap=30.0,
                 sinks=torch.zeros(heads)) if variants else {}
    value = SM90_CLASSES[alpha_class]
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25] * (heads // 4)) if value is None else value
    split_kernel, launches = captured_launches(
        dec, "_entmax_decode_split_kernel", dec.entmax_decode_fwd, q, k, v, torch.full((batch,), n, dtype=torch.int32),
        alpha, head_dim ** -0.5, block_table=table, bias=bias, is_causal=causal, num_splits=8, alpha_class=alpha_class,
        tau_hint=torch.zeros(batch, heads, 1) if hint else None, **extra)
    seen, out = set(), []
    for _, args, kwargs in launches:
        name = f"phase{kwargs['PHASE']}"
        key = (name, kwargs.get("ALPHA_CLASS"))
        if key in seen:
            continue
        seen.add(key)
        info = analyse(compile_like_launch(split_kernel, args, kwargs))
        cls = CLASS_NAMES.get(kwargs.get("ALPHA_CLASS"), "all")
        info.update(kernel=name, d=head_dim, alpha=cls + (" (filtered)" if kwargs.get("FILTER") else ""),
                    block=f"{kwargs['BLOCK_M']}x{kwargs.get('BLOCK_N', '-')}", warps=kwargs.get("num_warps", 4),
                    stages=kwargs.get("num_stages", 3))
        out.append(info)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2048])
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--alpha", type=float, nargs="+", default=list(ALPHAS))
    ap.add_argument("--dist", nargs="+", default=list(DISTS), choices=DISTS)
    ap.add_argument("--block", type=int, default=64, help="keys per block (the liveness granularity)")
    ap.add_argument("--quick", action="store_true", help="N = 256, std1 and local only (a smoke run)")
    ap.add_argument("--markdown", action="store_true", help="print one markdown table")
    ap.add_argument("--gpu", action="store_true", help="time decode steps on the GPU instead")
    ap.add_argument("--sm90", action="store_true", help="offline sm_90 builds of every decode kernel instead")
    ap.add_argument("--sm90-check", action="store_true", help="build one feature-complete set for sm_90 and exit")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256], help="head dims of --sm90")
    args = ap.parse_args(argv)
    if args.sm90_check:
        # each feature on in one set and off in the other: a float mask with the threshold hint, a boolean mask with
        # every variant
        sm90_builds(128, "mixed", paged=True, mask="float", causal=True, hint=True)
        sm90_builds(128, "mixed", paged=True, mask="bool", causal=True, variants=True)
        print("built")
        return 0
    if args.sm90:
        from sm90_build import COLUMNS

        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        for d in args.d:
            for cls in SM90_CLASSES:
                if cls == "mixed":
                    continue
                for info in sm90_builds(d, cls):
                    print("| " + " | ".join(str(info[c]) for c in COLUMNS) + " |", flush=True)
        return 0
    if args.gpu:
        if not torch.cuda.is_available():
            ap.error("--gpu needs a CUDA device")
        for dt in args.dtype:
            gpu_timings(DTYPES[dt])
        return 0
    torch.set_num_threads(1)
    ns = [256] if args.quick else args.n
    dists = ["std1", "local"] if args.quick else args.dist
    cols = ("dtype", "dist", "N", "alpha", "passes mean/max", "K", "cand", "zval", "V", "bytes", "skip mm",
            "skip ball", "max err", "ratio")
    if args.markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
    for dt in args.dtype:
        for dist in dists:
            for n in ns:
                for alpha in args.alpha:
                    r = measure(dist, n, alpha, DTYPES[dt], block=args.block)
                    vals = (dt, dist, n, alpha, f"{r['passes']:.2f} / {r['passes_max']}", f"{r['k_blocks']:.0f}",
                            f"{r['cand']:.2f}", f"{r['zval']:.2f}", f"{r['v']:.2f}", f"{r['bytes']:.2f}",
                            f"{r['skip_box']:.2f}", f"{r['skip_ball']:.2f}", f"{r['err']:.1e}", f"{r['ratio']:.2f}")
                    if args.markdown:
                        print("| " + " | ".join(str(x) for x in vals) + " |", flush=True)
                    else:
                        print("  ".join(f"{c}={x}" for c, x in zip(cols, vals)) + f"  ({r['secs']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
