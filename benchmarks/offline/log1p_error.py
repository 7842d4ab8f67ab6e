"""Error model of the general-alpha weights' ``log2(1 + w)`` (``kernels/_common.py``, ``log2_1p``), in float32 numpy.

The kernels form ``r^beta = exp2(beta log2_1p(w))`` with ``w = r - 1 <= 0``. ``log2_1p`` evaluates the series
``log2(e) (w - w^2/2 + ... - w^8/8)`` for ``|w| < 1/8`` and ``lg2.approx(1 + w)`` (the special-function unit,
absolute error at most ``2**-22`` on [0.5, 2] per the PTX ISA) above. This model evaluates the series in float32 as
the kernel does (Horner, coefficients rounded to float32), the special-function branch as the exact ``log2`` of the
float32 ``1 + w`` plus ``+-2**-22`` (its worst case), and prints, for each ``beta``, the largest absolute error of
the weight ``r^beta`` over ``w`` in (-1, 0] (the row's largest weight is 1), next to a plain ``log2(fl(1 + w))``
without the series (rounding ``1 + w`` first: ``beta`` ulps near alpha = 1).

Usage: ``python benchmarks/offline/log1p_error.py [--samples N]``.
"""

from __future__ import annotations

import argparse

import numpy as np

LOG2E = 1.4426950408889634
SERIES_MAX = 0.125
TERMS = 8
MUFU_ERR = 2.0 ** -22
F32 = np.float32


def series(w: np.ndarray) -> np.ndarray:
    """The kernel's series in float32: ``c = -LOG2E/8``, then ``c = c w + (-1)^(k+1) LOG2E / k`` for k = 7 .. 1,
    times ``w``."""
    c = np.full_like(w, F32(-LOG2E / TERMS))
    for k in range(TERMS - 1, 0, -1):
        c = (c * w + F32((-1) ** (k + 1) * LOG2E / k)).astype(F32)
    return (c * w).astype(F32)


def sfu(w: np.ndarray, err: float) -> np.ndarray:
    """``lg2.approx(fl(1 + w))`` with its worst-case absolute error ``err`` added."""
    return (np.log2((F32(1) + w).astype(np.float64)) + err).astype(F32)


def log2_1p(w: np.ndarray, err: float) -> np.ndarray:
    small = np.abs(w) < SERIES_MAX
    return np.where(small, series(np.where(small, w, 0).astype(F32)), sfu(w, err))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    w = np.concatenate([-np.logspace(-12, 0, args.samples, endpoint=False), -rng.random(args.samples)]).astype(F32)
    w = w[w > -1]
    exact = np.log1p(w.astype(np.float64)) / np.log(2.0)
    small = np.abs(w) < SERIES_MAX
    rel = np.abs(series(w[small]).astype(np.float64) - exact[small]) / np.abs(exact[small]).clip(1e-300)
    print(f"# log1p_error: float32 model, {w.size} points in (-1, 0]; series for |w| < {SERIES_MAX}, {TERMS} terms: "
          f"largest relative error {rel.max():.2e}")
    betas = [1.01, 2, 4, 8, 16, 32, 64, 256, 4096, 2.0 ** 23]
    print("beta          " + " ".join(f"{b:>9.4g}" for b in betas))
    rows = [("series + SFU, error +2^-22", lambda: log2_1p(w, MUFU_ERR)),
            ("series + SFU, error -2^-22", lambda: log2_1p(w, -MUFU_ERR)),
            ("plain log2(fl(1 + w)), exact", lambda: sfu(w, 0.0))]
    for name, f in rows:
        got = f().astype(np.float64)
        errs = [np.max(np.abs(np.exp2(b * got) - np.exp2(b * exact))) for b in betas]
        print(f"{name:30s}" + " ".join(f"{e:9.1e}" for e in errs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
