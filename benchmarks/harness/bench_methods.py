"""Who the attention benchmark times: our fused kernels, pinned SDPA backends, flash-attn, AdaSplash and
the materialized recipe (scores + the ``entmax`` package, else ``sparse_attn.mappings``)."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from bench_cases import Case, Inputs, alpha_arg, alpha_label
from bench_common import LEARNABLE, MIXED, SDPA_BACKENDS, Unavailable, optional_import

from sparse_attn import mappings
from sparse_attn.attention import entmax_attention
from sparse_attn.reference import causal_keep

FUSED_MODULES = ("sparse_attn.kernels.attn.entmax_attn_fwd", "sparse_attn.kernels.attn.entmax_attn_bwd",
                 "sparse_attn.attn._attn_autograd")
_NO_SDPA_KERNEL = ("No viable backend", "No available kernel")


@dataclass
class Method:
    """One benchmarked implementation: ``build(inputs)`` returns a zero-argument forward callable."""

    method: str
    backend: str
    alpha: str
    build: Callable[[Inputs], Callable[[], torch.Tensor]]
    extra_grads: Callable[[Inputs], list] = field(default=lambda inputs: [])
    fused_alpha: Callable[[Inputs], torch.Tensor] | None = None


def fused_forward_launcher():
    """Return ``(entmax_attn_fwd, "")``, or ``(None, reason)`` when a fused-kernel module does not exist.

    A module that exists but fails to import is not a reason to skip: the ``sparse_attn`` rows
    then run and report the error.
    """
    for name in FUSED_MODULES:
        if importlib.util.find_spec(name) is None:
            return None, f"fused kernel module {name} missing"
    fwd_mod, _ = optional_import(FUSED_MODULES[0])
    return getattr(fwd_mod, "entmax_attn_fwd", None), ""


def sparse_attn_method(alpha: str) -> Method:
    def build(inputs: Inputs):
        a = alpha_arg(alpha, inputs)
        if not isinstance(a, torch.Tensor) and a == 1.0:
            # alpha 1 without statistics is handed to SDPA: asking for them keeps it on our own softmax class
            return lambda: entmax_attention(inputs.q, inputs.k, inputs.v, a, is_causal=inputs.causal,
                                            backend="triton", return_stats=True)[0]
        return lambda: entmax_attention(inputs.q, inputs.k, inputs.v, a, is_causal=inputs.causal, backend="triton")

    def fused_alpha(inputs: Inputs):
        a = alpha_arg(alpha, inputs)
        return a if isinstance(a, torch.Tensor) else torch.full((inputs.q.shape[1],), a, device=inputs.q.device)

    extra = (lambda inputs: [inputs.learnable_alpha]) if alpha == LEARNABLE else (lambda inputs: [])
    return Method("sparse_attn", "triton", alpha, build, extra, fused_alpha)


def sdpa_method(backend: str) -> Method:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = getattr(SDPBackend, SDPA_BACKENDS[backend])

    def build(inputs: Inputs):
        def run():
            try:
                with sdpa_kernel(pinned):
                    return torch.nn.functional.scaled_dot_product_attention(
                        inputs.q, inputs.k, inputs.v, is_causal=inputs.causal)
            except RuntimeError as exc:
                if any(msg in str(exc) for msg in _NO_SDPA_KERNEL):
                    raise Unavailable(f"SDPA backend {backend!r} has no kernel for this input") from exc
                raise
        return run

    return Method("sdpa", backend, "1", build)


def flash_attn_method(module) -> Method:
    def build(inputs: Inputs):
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        return lambda: module.flash_attn_func(q, k, v, causal=inputs.causal).transpose(1, 2)

    return Method("flash_attn", getattr(module, "__version__", "?"), "1", build)


ADASPLASH_HEAD_DIMS = (16, 32, 64, 128, 256)
ADASPLASH_VARIANTS = ("v1", "v2")


def adasplash_limits(variant: str, alpha: str, causal: bool, seq_q: int, seq_k: int, head_dim: int) -> str:
    """Why AdaSplash's ``variant`` cannot run a case, or ``""`` when it can (the checks of its 0.2.2 launchers).

    ``v1`` is ``adasplash_v1(q, k, v, alpha, is_causal)``: one Python float alpha in (1, 2], causal or not; ``v2`` is
    ``adasplash_v2(q, k, v)``: alpha 1.5, causal only, ``N >= 64``. Both: self-attention (``Nq = Nk``), ``N`` a power
    of two (no ``varlen``), head dim in {16, 32, 64, 128, 256}, contiguous ``(B, H, N, D)``, scale ``1/sqrt(D)``.
    """
    if variant not in ADASPLASH_VARIANTS:
        raise ValueError(f"variant must be one of {ADASPLASH_VARIANTS}, got {variant!r}")
    try:
        a = float(alpha)
    except ValueError:
        return f"AdaSplash takes one Python float alpha per call, not {alpha!r}"
    if variant == "v2" and a != 1.5:
        return f"AdaSplash-2 is alpha = 1.5 only (asked {alpha})"
    if variant == "v2" and not causal:
        return "AdaSplash-2 is causal only"
    if not 1.0 < a <= 2.0:
        return f"AdaSplash-1 takes alpha in (1, 2] (asked {alpha})"
    if seq_q != seq_k:
        return f"AdaSplash is self-attention only (Nq = Nk), got Nq {seq_q}, Nk {seq_k}"
    if seq_q & (seq_q - 1):
        return f"AdaSplash needs N a power of two without varlen, got {seq_q}"
    if variant == "v2" and seq_q < 64:
        return f"AdaSplash-2 needs N >= 64 (its 64 x 64 block mask), got {seq_q}"
    if head_dim not in ADASPLASH_HEAD_DIMS:
        return f"AdaSplash takes head dims {ADASPLASH_HEAD_DIMS}, got {head_dim}"
    return ""


def adasplash_version(module) -> str:
    """The installed distribution's version (0.2.2 says ``__version__ = "0.2.0"``), else the module's."""
    version = package_version("adasplash")
    return version if version != "?" else str(getattr(module, "__version__", "?"))


def adasplash_method(module, variant: str, alpha: str, missing: str = "") -> Method:
    """AdaSplash's ``adasplash_v1`` or ``adasplash_v2`` called explicitly (its dispatcher ``adasplash`` picks one
    silently), with its defaults (v1 ``niter=10``, v2 ``niter=1``) and its own autotuning. A case it cannot run, or a
    module that did not import (``missing`` says why), gives a callable raising :class:`Unavailable` with the
    reason, so the row says it."""
    name = f"adasplash_{variant}"
    backend = adasplash_version(module) if module is not None else "not importable"

    def build(inputs: Inputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        why = missing or adasplash_limits(variant, alpha, inputs.causal, q.shape[2], k.shape[2], q.shape[3])
        if why:
            def unavailable():
                raise Unavailable(why)
            return unavailable
        if variant == "v1":
            return lambda: module.adasplash_v1(q, k, v, alpha=float(alpha), is_causal=inputs.causal)
        return lambda: module.adasplash_v2(q, k, v)

    return Method(name, backend, alpha, build)


def recipe_impl():
    """The row mappings of the materialized recipe: the ``entmax`` package if importable, else ours."""
    pkg, _ = optional_import("entmax")
    if pkg is not None:
        version = package_version("entmax")
        return f"entmax {version}", pkg.entmax15, pkg.sparsemax, pkg.entmax_bisect
    return "sparse_attn.mappings", mappings.entmax15, mappings.sparsemax, mappings.entmax


def package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def recipe_method(alpha: str) -> Method:
    """What a user writes without a fused kernel: materialize the scores in float32, map the rows, aggregate."""
    impl, entmax15, sparsemax, general = recipe_impl()

    def build(inputs: Inputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        scale = q.shape[-1] ** -0.5
        a = alpha_arg(alpha, inputs)
        if isinstance(a, torch.Tensor):
            mapping = functools.partial(general, alpha=a.reshape(1, -1, 1, 1), dim=-1)
        elif a in (1.0, 1.5, 2.0):
            mapping = functools.partial({1.0: torch.softmax, 1.5: entmax15, 2.0: sparsemax}[a], dim=-1)
        else:
            mapping = functools.partial(general, alpha=a, dim=-1)
        keep = causal_keep(q.shape[2], k.shape[2], q.device) if inputs.causal else None

        def run():
            s = torch.matmul(q, k.transpose(-2, -1)).float() * scale
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            return torch.matmul(mapping(s).to(v.dtype), v)
        return run

    return Method("torch_recipe", impl, alpha, build)


def methods_for(case: Case, args, providers: dict) -> list[Method]:
    """The methods run on a case, by group."""
    flash = [sdpa_method("flash")]
    if case.group == "flash":
        out = [sparse_attn_method(alpha_label(a)) for a in args.alphas]
        out += [sdpa_method(b) for b in args.sdpa_backends]
        if providers.get("flash_attn"):
            out.append(flash_attn_method(providers["flash_attn"]))
        if providers.get("adasplash"):
            out += [adasplash_method(providers["adasplash"], "v1", alpha_label(a)) for a in args.alphas if a > 1]
            if 1.5 in args.alphas:
                out.append(adasplash_method(providers["adasplash"], "v2", "1.5"))
        out += [recipe_method(alpha_label(a)) for a in args.recipe_alphas]
        return out
    if case.group == "sparsity":
        out = [sparse_attn_method(case.alpha)] + flash
        if providers.get("adasplash"):
            out.append(adasplash_method(providers["adasplash"], "v1", case.alpha))
            if case.alpha == "1.5":
                out.append(adasplash_method(providers["adasplash"], "v2", case.alpha))
        return out
    return [sparse_attn_method(MIXED), sparse_attn_method(LEARNABLE), sparse_attn_method("1.5")] + flash + [
        recipe_method(MIXED)]
