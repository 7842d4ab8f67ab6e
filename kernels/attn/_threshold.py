"""The threshold algorithm of the fused entmax forward, the split forward and the decode kernels, row by row: the
threshold constants, the row arithmetic (evaluation points, the bracket state ``Bracket``, certified brackets, the
estimate) and the stopping rules. Its per-key-tile half, the passes that feed them (the grid pass's ring of ``GRID_K``
points below the running max and its first bracket, the candidate passes' points, sums and merge), is
``kernels/attn/_threshold_tiles.py``. The loops over key tiles stay with their kernels:
``kernels/attn/_fwd_rows.py``, ``kernels/attn/_fwd_entmax.py``, ``kernels/attn/_fwd_split.py`` and
``kernels/attn/entmax_decode.py``.

For ``alpha > 1`` a row's threshold ``tau`` solves ``f(tau) = sum_j [z_j - tau]_+^beta = 1`` with
``z = (alpha - 1) * score`` and ``beta = 1 / (alpha - 1)``. ``phi = f^(1/beta) - 1`` is convex and
decreasing, so from ``phi`` and ``phi'`` at the two ends of a bracket ``[a, b]`` (``phi(a) >= 0 > phi(b)``):

* the Newton (tangent) roots of ``phi`` from either end are certified lower bounds of ``tau``;
* the secant root is a certified upper bound;
* for beta in {1, 2}, if no key lies inside the bracket (equal counts ``c = #{z > t}`` at both
  ends), ``f`` is a polynomial there and its root is exact (a count of 0 is "not counted": the
  grid counts only at alpha = 2, where the count is ``g``);
* otherwise the root of the cubic Hermite interpolant of ``phi``, clamped to the certified
  ``[lo, hi]``, is the estimate.

All values are per row, ``[BLOCK_M]`` vectors. ``POW`` (constexpr) is 1 (alpha = 2), 2 (alpha = 1.5)
or 0 (any other alpha). On the general path thresholds are carried as ``theta = tau + 1`` and the
sums at a point are scaled by the term of the row maximum, ``(m - tau)^beta``, so that neither the
large powers near alpha = 1 overflow below the threshold nor the small ones underflow above it:
the maximal key contributes exactly 1 and ``phi = (m - tau) * F^(1/beta) - 1``.

Shift invariance: every score, point and threshold is relative to a per-row reference score ``ref`` (``anchor``;
0 for rows whose maximum stays below 64 in magnitude), set where the grid pass restarts its whole ring, so adding a
constant to a row changes nothing but the rounding of its scores: ``z - ref`` is exact near the maximum (Sterbenz)
and the threshold arithmetic never sees the magnitude of the scores. The fused forward saves ``tau = ref + tau_rel``
as two floats (``tau``, ``tau_lo``, the rounding residual), from which the backward forms the same relative scores.
Derivation and measurements: docs/kernels.md.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._common import fast_log2, log2_1p

# rows whose running max stays below this in magnitude keep the reference score 0 (``anchor``): their scores are used
# as they are, bitwise as in absolute arithmetic
ANCHOR_FREE = tl.constexpr(64.0)
# (grid points, candidate points per later pass) by threshold arithmetic (POW 1: alpha = 2, 2: alpha = 1.5, 0: other
# alpha). The fused forward's: chosen in docs/kernels.md from the pass counts and the per-score cost model
FWD_POINTS = {1: (8, 4), 2: (8, 1), 0: (4, 1)}
# the decode kernels' (candidate points >= 2): the fewest that keep bfloat16 at one candidate pass and float32 at two
# on the measured caches (docs/decode.md); candidate passes read only the stored scores, so their points cost no
# cache reads
DECODE_POINTS = {1: (8, 8), 2: (8, 8), 0: (8, 4)}
# the largest beta = 1 / (alpha - 1) at which the value pass of 16-bit outputs takes the fast log2 (``weights``)
FAST_BETA_MAX = tl.constexpr(256.0)
# passes over the key range per query tile at most (grid and value pass included) in the fused forward
FWD_MAX_PASSES = 32
# passes of a decode step at most (score pass and value pass included) by input dtype; the candidate passes between
# them stop once the row tile has converged
DECODE_MAX_PASSES = {torch.float16: 3, torch.bfloat16: 3, torch.float32: 5}
# Stop refining a row's threshold once its certified bracket is this narrow (forward: relative to 1 + |tau|; decode:
# the change of the row's total weight across it): the value pass renormalizes, and half-precision outputs round far
# above these (docs/kernels.md).
TOLERANCE = {torch.float16: 3e-4, torch.bfloat16: 1e-3, torch.float32: 1e-6}


def default_tolerance(dtype: torch.dtype) -> float:
    """The default ``tol`` of the forward and the decode kernels for inputs of ``dtype`` (``TOLERANCE``)."""
    return TOLERANCE[dtype]


@triton.jit
def row_sums(x, LANES: tl.constexpr):
    """Row sums of ``x [BLOCK_M, BLOCK_N]``: ``[BLOCK_M]`` with ``LANES == 0``, else ``[BLOCK_M, LANES]`` partial sums
    that a caller accumulates over key tiles and adds up once (``tl.sum(., 1)``) at the end of a pass.

    An MMA accumulator spreads a row over a quad of 4 lanes, each holding column pairs ``8 i + 2 l + {0, 1}``
    (lane ``l``): the reshape ``[BLOCK_M, BLOCK_N / 8, 4, 2]`` puts the quad on axis 2, so the partials are summed in
    each thread with no lane shuffles (``LANES = 4``); on any other layout they are still the right sums.
    """
    if LANES == 0:
        out = tl.sum(x, 1)
    else:
        BM: tl.constexpr = x.shape[0]
        BN: tl.constexpr = x.shape[1]
        out = tl.sum(tl.sum(tl.reshape(x, [BM, BN // (2 * LANES), LANES, 2]), 3), 1)
    return out


@triton.jit
def point_sums(z, t, POW: tl.constexpr, bm1, lref, LANES: tl.constexpr = 0):
    """``f``, ``g``, ``c`` (each ``[BLOCK_M]``, or ``[BLOCK_M, LANES]`` partials: ``row_sums``) of the score tile
    ``z [BLOCK_M, BLOCK_N]`` at the points ``t``.

    POW 1, 2: ``f = sum [z - t]_+^beta``, ``g = sum [z - t]_+^(beta - 1)``, ``c = #{z > t}`` (float).
    POW 0: ``t = tau + 1``, ``r = 1 + (z - t)``, and the sums are scaled by the maximal key's term:
    ``f = sum (r / r_max)^beta``, ``g = sum (r / r_max)^(beta - 1)`` with ``lref = log2(r_max)``;
    ``c`` is 0. ``bm1 = beta - 1``. ``[z - t]_+`` is ``maximum(z - t, 0)`` (one FMNMX; a NaN or ``-inf`` score
    gives 0, bitwise as ``where(z > t, z - t, 0)``).
    """
    if POW == 1:
        r = z - t[:, None]
        f = row_sums(tl.maximum(r, 0.0), LANES)
        c = row_sums((r > 0.0).to(tl.float32), LANES)
        g = c
    elif POW == 2:
        r = tl.maximum(z - t[:, None], 0.0)
        f = row_sums(r * r, LANES)
        g = row_sums(r, LANES)
        c = row_sums((r > 0.0).to(tl.float32), LANES)
    else:
        r = tl.maximum(1.0 + (z - t[:, None]), 0.0)
        # log2(0) = -inf: whatever the exponent gives there is discarded by the one select
        gp = tl.where(r > 0.0, tl.exp2(bm1 * (fast_log2(r) - lref[:, None])), 0.0)
        f = row_sums(gp * r, LANES)
        if LANES == 0:
            f = f * tl.exp2(-lref)
        else:
            f = f * tl.exp2(-lref)[:, None]
        g = row_sums(gp, LANES)
        c = g * 0.0
    return f, g, c


@triton.jit
def weights(z, t, POW: tl.constexpr, beta, FAST: tl.constexpr = False):
    """Unnormalized weights ``[z - tau]_+^beta`` ``[BLOCK_M, BLOCK_N]`` at the thresholds ``t`` (as ``point_sums``).

    The general path forms ``log2(1 + w)``, ``w = z - (tau + 1)``, with ``log2_1p``: near alpha = 1,
    ``r = 1 + w`` is within O(alpha - 1) of 1 and rounding it would cost ``beta`` ulps per weight. ``FAST``
    (weights that are rounded to 16 bits before the value product): ``fast_log2(1 + w)``, a relative error of
    about ``2.3e-7 * beta`` per weight (1.7e-5 at alpha 1.01), far below the rounding to 16 bits (2**-9) while
    ``beta <= FAST_BETA_MAX``; callers take the accurate form above it.
    """
    if POW == 1:
        p = tl.maximum(z - t[:, None], 0.0)
    elif POW == 2:
        r = tl.maximum(z - t[:, None], 0.0)
        p = r * r
    else:
        w = z - t[:, None]
        if FAST:
            p = tl.where(w > -1.0, tl.exp2(beta * fast_log2(tl.maximum(1.0 + w, 0.0))), 0.0)
        else:
            p, _ = pow_weights(w, beta)
    return p


@triton.jit
def pow_weights(w, beta):
    """``(r^beta, r^(beta - 1))`` with ``r = [1 + w]_+`` (the general class's weights and ``U``), both from one
    ``log2_1p``: ``U = exp2((beta - 1) log2 r)``, ``p = U r``, as the backward forms them (docs/backward.md), so that a
    value pass that also needs ``U`` (the training forward) computes bitwise the weights of one that does not.
    """
    pos = w > -1.0
    u = tl.where(pos, tl.exp2((beta - 1.0) * log2_1p(tl.where(pos, w, 0.0))), 0.0)
    return tl.where(pos, u * (1.0 + w), 0.0), u


@triton.jit
def log_ref(m, t):
    """``log2(r_max)``, ``r_max = 1 + (m - t)``: the maximal key's base at the points ``t = tau + 1`` (POW 0).

    Rounded exactly as ``point_sums`` rounds ``r`` of a key and with the same ``fast_log2``, so that the maximal
    key's ratio is exactly 1 (another key's, up to the approximation's non-monotonicity, at most ``1 + 1e-6``).
    """
    return fast_log2(tl.maximum(1.0 + (m - t), 1e-30))


@triton.jit
def phi(F, G, POW: tl.constexpr, inv_beta, lref):
    """``phi = f^(1/beta) - 1`` and ``phi'`` from the sums of ``point_sums``; ``(-1, -1)`` where no key is above."""
    pos = F > 0.0
    fs = tl.where(pos, F, 1.0)
    if POW == 1:
        ph = F - 1.0
        dph = -G
    elif POW == 2:
        rt = tl.sqrt(fs)
        ph = rt - 1.0
        dph = -G / rt
    else:
        lf = tl.log2(fs)
        ph = tl.exp2(lref + lf * inv_beta) - 1.0
        dph = -tl.exp2(lf * (inv_beta - 1.0)) * G
    ph = tl.where(pos, ph, -1.0)
    dph = tl.where(pos & (dph < 0.0), dph, -1.0)
    return ph, dph


class Bracket(NamedTuple):
    """The bracket state of a row (each field ``[BLOCK_M]``): ``[a, b]`` with ``phi(a) >= 0 > phi(b)``; ``phi``,
    ``phi'``, ``f``, ``g`` and the count ``c`` at ``a`` (``pa``, ``da``, ``fa``, ``ga``, ``ca``), ``phi``, ``phi'`` and
    ``c`` at ``b`` (``pb``, ``db``, ``cb``), and ``top``: ``b`` is the row max (a bool; the decode state stores it as a
    0/1 float). A tuple of tensors: a ``@triton.jit`` argument and return value like any tensor."""

    a: tl.tensor
    pa: tl.tensor
    da: tl.tensor
    fa: tl.tensor
    ga: tl.tensor
    ca: tl.tensor
    b: tl.tensor
    pb: tl.tensor
    db: tl.tensor
    cb: tl.tensor
    top: tl.tensor


@triton.jit
def open_bracket(m, grid_ok, shift):
    """The bracket before any point is merged (:class:`Bracket`, thresholds ``tau + shift``). ``b`` is the row max
    ``m`` (``top``, ``phi = phi' = -1``); ``a`` is ``-inf`` for the rows whose grid points will close it
    (``grid_ok``), else ``m - 1`` with ``phi(a)`` unknown (NaN: ``solve`` bisects) and ``f(a) = 1``."""
    zero = tl.zeros_like(m)
    a = tl.where(grid_ok, float("-inf"), m - 1.0 + shift)
    return Bracket(a, zero + float("nan"), zero - 1.0, zero + 1.0, zero, zero, m + shift, zero - 1.0, zero - 1.0, zero,
                   m == m)


@triton.jit
def pick_bracket(act, new, old):
    """The bracket ``new`` on the rows ``act``, ``old`` on the others."""
    return Bracket(tl.where(act, new.a, old.a), tl.where(act, new.pa, old.pa), tl.where(act, new.da, old.da),
                   tl.where(act, new.fa, old.fa), tl.where(act, new.ga, old.ga), tl.where(act, new.ca, old.ca),
                   tl.where(act, new.b, old.b), tl.where(act, new.pb, old.pb), tl.where(act, new.db, old.db),
                   tl.where(act, new.cb, old.cb), tl.where(act, new.top, old.top))


@triton.jit
def merge_point(br, t, ph, dph, f, g, c):
    """Tighten the bracket ``br`` (``phi(a) >= 0 > phi(b)``) with point ``t`` (``phi``, ``phi'``, ``f``, ``g``, ``c``
    there, each ``[BLOCK_M]``)."""
    up_a = (ph >= 0.0) & (t > br.a)
    a = tl.where(up_a, t, br.a)
    pa = tl.where(up_a, ph, br.pa)
    da = tl.where(up_a, dph, br.da)
    fa = tl.where(up_a, f, br.fa)
    ga = tl.where(up_a, g, br.ga)
    ca = tl.where(up_a, c, br.ca)
    up_b = (ph < 0.0) & (t < br.b)
    return Bracket(a, pa, da, fa, ga, ca, tl.where(up_b, t, br.b), tl.where(up_b, ph, br.pb),
                   tl.where(up_b, dph, br.db), tl.where(up_b, c, br.cb), br.top & (up_b == 0))


@triton.jit
def _col(x, sel):
    """Column ``sel`` (a ``[1, N]`` one-hot mask) of ``x [BLOCK_M, N]`` as ``[BLOCK_M]``."""
    return tl.sum(tl.where(sel, x, 0.0), 1)


@triton.jit
def merge_points(br, t, ph, dph, f, g, c, N: tl.constexpr):
    """``merge_point`` for ``N`` points at once (``t``, ``ph``, ``dph``, ``f``, ``g``, ``c``: ``[BLOCK_M, N]``): the
    bracket ends move to the highest point with ``phi >= 0`` above ``a`` and the lowest with ``phi < 0`` below ``b``
    (the first such column on ties), as merging them one by one would."""
    idx = tl.arange(0, N)[None, :]
    up_a = (ph >= 0.0) & (t > br.a[:, None])
    best_a = tl.max(tl.where(up_a, t, float("-inf")), 1)
    sel_a = idx == tl.min(tl.where(up_a & (t == best_a[:, None]), idx, N), 1)[:, None]
    has_a = best_a > float("-inf")
    up_b = (ph < 0.0) & (t < br.b[:, None])
    best_b = tl.min(tl.where(up_b, t, float("inf")), 1)
    sel_b = idx == tl.min(tl.where(up_b & (t == best_b[:, None]), idx, N), 1)[:, None]
    has_b = best_b < float("inf")
    return Bracket(tl.where(has_a, best_a, br.a), tl.where(has_a, _col(ph, sel_a), br.pa),
                   tl.where(has_a, _col(dph, sel_a), br.da), tl.where(has_a, _col(f, sel_a), br.fa),
                   tl.where(has_a, _col(g, sel_a), br.ga), tl.where(has_a, _col(c, sel_a), br.ca),
                   tl.where(has_b, best_b, br.b), tl.where(has_b, _col(ph, sel_b), br.pb),
                   tl.where(has_b, _col(dph, sel_b), br.db), tl.where(has_b, _col(c, sel_b), br.cb),
                   br.top & (has_b == 0))


@triton.jit
def solve(br, POW: tl.constexpr):
    """``(estimate, lo, hi, exact)`` of the root of ``phi`` in the bracket ``br``; ``lo <= tau <= hi`` certified.

    At the row max ``phi = -1`` and ``phi' = -1`` with a single maximal key (with ties the true
    tangent root is larger, so the bound stays valid).
    """
    a, pa, da, fa, ga, ca, b, pb, db, cb, b_top = br
    pb = tl.where(b_top, -1.0, pb)
    db = tl.where(b_top, -1.0, db)
    h = tl.maximum(b - a, 1e-30)
    lo = tl.maximum(tl.maximum(a - pa / da, b - pb / db), a)
    hi = tl.minimum(a + h * (pa / tl.maximum(pa - pb, 1e-30)), b)
    lo = tl.minimum(lo, hi)
    if POW == 0:
        exact = a != a
        root = a
    else:
        # no key inside the bracket: f is a polynomial on it (the top bracket holds only the max key if c(a) == 1)
        exact = tl.where(b_top, ca == 1.0, ca == cb) & (ca > 0.0)
        c_safe = tl.maximum(ca, 1.0)
        if POW == 1:
            root = a + (fa - 1.0) / c_safe
        else:
            disc = tl.maximum(ga * ga - c_safe * (fa - 1.0), 0.0)
            root = a + (fa - 1.0) / tl.maximum(ga + tl.sqrt(disc), 1e-30)
        root = tl.minimum(tl.maximum(root, a), b)
        lo = tl.where(exact, root, lo)
        hi = tl.where(exact, root, hi)
    # safeguarded Newton on the cubic Hermite interpolant of phi over [a, b], in s = (t - a) / h
    s_lo = (lo - a) / h
    s_hi = (hi - a) / h
    s = 0.5 * (s_lo + s_hi)
    for _ in tl.static_range(6):
        s2 = s * s
        s3 = s2 * s
        p = ((2.0 * s3 - 3.0 * s2 + 1.0) * pa + (s3 - 2.0 * s2 + s) * h * da + (3.0 * s2 - 2.0 * s3) * pb
             + (s3 - s2) * h * db)
        dp = ((6.0 * s2 - 6.0 * s) * pa + (3.0 * s2 - 4.0 * s + 1.0) * h * da + (6.0 * s - 6.0 * s2) * pb
              + (3.0 * s2 - 2.0 * s) * h * db)
        s = s - p / tl.where(dp < 0.0, dp, -1.0)
        s = tl.minimum(tl.maximum(s, s_lo), s_hi)
    est = tl.where(exact, root, a + s * h)
    est = tl.where(est == est, est, lo)
    # phi(a) unknown (no usable grid): bisect
    known = pa == pa
    lo = tl.where(known, lo, a)
    hi = tl.where(known, hi, b)
    est = tl.where(known, est, 0.5 * (a + b))
    est = tl.minimum(tl.maximum(est, lo), hi)
    return est, lo, hi, exact


@triton.jit
def tighten(act, br, new, est, lo, hi, exact, POW: tl.constexpr):
    """After a pass that merged new points into ``new`` (from ``br``): on the rows ``act`` the bracket ``new``, its
    estimate and its certified bounds intersected with ``[lo, hi]`` (``solve``); the other rows unchanged. Returns
    ``(br, est, lo, hi, exact)``."""
    br = pick_bracket(act, new, br)
    n_est, n_lo, n_hi, n_exact = solve(br, POW)
    lo = tl.where(act, tl.maximum(lo, n_lo), lo)
    hi = tl.where(act, tl.minimum(hi, n_hi), hi)
    lo = tl.minimum(lo, hi)
    est = tl.minimum(tl.maximum(tl.where(act, n_est, est), lo), hi)
    return br, est, lo, hi, tl.where(act, n_exact, exact)


@triton.jit
def width_done(exact, lo, hi, usable, tol):
    """The fused forward's stopping rule: rows whose threshold needs no more passes, i.e. exact, unusable, or with a
    certified bracket narrower than ``tol + 4.8e-7 |lo|`` (``[BLOCK_M]``)."""
    return exact | (hi - lo <= tol + 4.8e-7 * tl.abs(lo)) | (usable == 0)


@triton.jit
def more_passes(done, n_passes, max_passes):
    """The fused forward's loop test: some row of the tile is not ``done`` and one more pass (the value pass still
    to come) stays within ``max_passes``."""
    return (tl.min(done.to(tl.int32)) == 0) & (n_passes + 1 < max_passes)


@triton.jit
def weight_done(exact, lo, hi, da, beta, usable, tol):
    """The decode kernels' stopping rule: rows whose threshold needs no more passes: exact, unusable, or a certified
    bracket so narrow that moving the threshold across it changes the row's total weight by at most ``tol``
    (relative): ``(hi - lo) beta |phi'(a)|``, ``|phi'(a)|`` close to ``g(tau) = sum_j p_j^(1 - 1/beta)`` near the root
    (docs/decode.md), or float32 cannot split it further (a few ulps of ``lo``). Flags as 0/1 floats (the decode
    state's)."""
    width = hi - lo
    return ((exact != 0.0) | (usable == 0.0) | (width * tl.maximum(beta * tl.abs(da), 1.0) <= tol)
            | (width <= 4.8e-7 * (1.0 + tl.abs(lo))))
