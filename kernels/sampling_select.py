"""The sampler's path for steps where rows filter: top-k / top-p thresholds by a histogram cut and
a compacted window, with no ``torch.topk`` and no sort.

Same function as :mod:`kernels.sampling_ref` (same keyed uniforms, thresholds and first-index tie
rules), in five launches and two reads of the logits, none reading a device value on the host
(capturable):

1. ``_chunk_kernel``, grid ``(S, NCH)``, the first read: each ``BLOCK``-wide chunk's max and first
   argmax (greedy rows are done after this); for rows with neither top-k, top-p nor min-p the
   chunk's Gumbel-max winner (it needs no row max); for filtering rows a 64-bucket histogram
   (``tl.histogram``) of the distance ``d = m_c - s`` from the *chunk's* max ``m_c`` (buckets 1/4
   wide up to ``d = 12``, then 4 per octave of ``d + 4``, read off the float's bits, the last one
   open: :func:`_bucket`), stored as running counts, and for top-p rows without top-k each
   bucket's mass bound and the chunk's float32 mass ``sum exp(s - m_c)``.
2. ``_cut_kernel``, grid ``(S,)``: the row max, and a cut ``e`` (keep ``s >= e``) from the chunks'
   histograms shifted by ``smax - m_c`` (a chunk bucket counts on one side of a row edge only when
   all of it is there): for top-k the first row edge with *at least* ``top_k`` logits above it
   for sure; for top-p alone the first edge whose upper bound of the mass below it is
   ``<= (1 - top_p) Z`` (``Z`` estimated from the chunk masses); with min-p (and not both top-k
   and top-p) no lower than just under the min-p threshold.
3. ``_compact_kernel``, grid ``(S, NCH)``, the second read: every logit with ``s >= e`` goes into
   the row's window (``capacity`` slots, one atomic per hit for its slot), packed as one int64 key
   (value, then lowest index: :func:`kernels.topn.tl_pack`); top-p rows without top-k add the
   chunk's ``sum exp(s - smax)`` (float32 terms, float64 sum: the reference's ``Z``); rows with
   min-p but no top-k / top-p take the chunk's Gumbel-max winner here (they need ``smax``).
4. and 5. :mod:`kernels.sampling_select_finish`: the window put in order by ranks (each key counts
   the larger keys; several programs per row, no sort), then per row the reference's rule on it.

The cut is only a guess; exactness is checked, not assumed.  The window is a prefix of the row's
sorted order (all of ``s >= e``, ties included), so the result is exact when the window did not
overflow and it closes the decision: ``top_k <= count`` (then every top-k survivor, and so the
top-p mass over them, is inside), or, for top-p alone, the window's mass reaches ``top_p * Z``.
Rows that fail (a nucleus or ``top_k`` wider than ``capacity``, e.g. a nearly flat distribution at
top_p 0.99) are marked not done and :func:`kernels.sampling.sample` finishes them with the
one-program-per-row kernel (slow but exact).

Ties, as in the reference: the thresholds are values, so logits tied at the ``top_k``-th value or
at the nucleus edge are kept or dropped together (``-0.0`` and ``+0.0`` are one value); the window
holds all of a tie because it is ``s >= e``; among equal Gumbel scores the lowest vocab index
wins; an all ``-inf`` row (every survivor's score ``-inf``) gives token 0.

Cost on an H100 at 64 x 128256 (``scripts/bench_kernels.py sampling``, docs/performance.md): top-k 50
67 us, top-p 0.9 84 us, both 68 us, mixed rows 75 us (the previous select path: 104 / 146 / 103 /
122 us; a ``torch.topk`` window: ~200 us).

Float caveat (as for the other paths): ``Z`` for top-p without top-k is summed in a different
order than the reference's, and Triton's ``exp`` / ``log`` are not torch's, so a token can differ
only when a top-p boundary mass or two Gumbel scores agree to within float rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_hash import tl_row_key, tl_uniform
from .sampling_ref import GREEDY_EPS
from .sampling_select_finish import finish_window, row_params
from .topn import tl_pack

__all__ = ["sample_select", "DEFAULT_CAPACITY"]

DEFAULT_CAPACITY = 2048
_NB = 128  # histogram buckets
_LIN = 96  # buckets of width 1/4 for d < _LIN / 4 = 24, then 4 per octave (see _edge)


@triton.jit
def _edge(j, LIN: tl.constexpr, LOG0: tl.constexpr):
    """Where bucket ``j`` starts, as a distance below the max (see :func:`_bucket`)."""
    lg = ((j - LIN + LOG0) << 21).to(tl.float32, bitcast=True) - LIN / 12.0
    return tl.where(j <= LIN, j.to(tl.float32) * 0.25, lg)


@triton.jit
def _bucket(d, NB: tl.constexpr, LIN: tl.constexpr, LOG0: tl.constexpr):
    """The bucket ``j`` of a distance ``d >= 0`` (``_edge(j) <= d < _edge(j + 1)``, the last one open).

    1/4 wide below ``LIN / 4``, then 4 per octave of ``d + LIN / 12`` (whose octaves start at
    ``LIN / 3``, a power of two): the exponent and top two mantissa bits of that float, so no
    ``log2``.  ``LOG0`` is those bits of ``LIN / 3``.
    """
    lin = (tl.minimum(d, LIN * 0.25) * 4.0).to(tl.int32)  # truncation is floor here (d >= 0, or -0.0)
    lg = LIN + (((tl.minimum(d, 1e30) + LIN / 12.0).to(tl.int32, bitcast=True) >> 21) - LOG0)
    b = tl.where(d < LIN * 0.25, lin, tl.minimum(lg, NB - 1))
    return tl.where(d == d, b, NB - 1)  # NaN (an infinite max): the last bucket


@triton.jit
def _chunk_kernel(x_ptr, stride_x, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, pmax_ptr, parg_ptr,
                  pcum_ptr, pwsuf_ptr, pzc_ptr, pbest_ptr, pidx_ptr, V, NCH, GREEDY_EPS: tl.constexpr,
                  FILTERED: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, LIN: tl.constexpr, LOG0: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=m, other=float("-inf")).to(tl.float32)
    sampled, temp, k, p, k_on, p_on = row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    min_p = tl.load(minp_ptr + row)
    mx = tl.max(x, axis=0)
    tl.store(pmax_ptr + row * NCH + c, mx)
    tl.store(parg_ptr + row * NCH + c, tl.min(tl.where(x == mx, idx, 2147483647), axis=0))
    if sampled:
        inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        s = x * inv_t
        if k_on | p_on:
            if FILTERED:
                jj = tl.arange(0, NB)
                mc = mx * inv_t
                # no mask: the lanes past V hold -inf, so their bucket is the last one; take them out after
                hist = tl.histogram(_bucket(mc - s, NB, LIN, LOG0), NB)
                hist -= tl.where(jj == NB - 1, BLOCK - tl.minimum(V - c * BLOCK, BLOCK), 0)
                at = (row * NCH + c) * NB + jj
                tl.store(pcum_ptr + at, tl.cumsum(hist, axis=0))  # logits in buckets <= j
                if p_on & ~k_on:
                    # bucket j's logits weigh at most exp(-edge(j)) (times exp(m_c - smax)): from bucket j on
                    hi_w = hist.to(tl.float32) * tl.exp(-_edge(jj, LIN, LOG0))
                    tl.store(pwsuf_ptr + at, tl.sum(hi_w, axis=0) - tl.cumsum(hi_w, axis=0) + hi_w)
                    # the chunk's mass, float32: the cut's estimate of Z (the exact Z comes with the window)
                    tl.store(pzc_ptr + row * NCH + c, tl.sum(tl.where(m, tl.exp(s - mc), 0.0), axis=0))
        elif min_p <= 0:  # temperature alone: the Gumbel-max winner needs no row max
            key = tl_row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
            score = tl.where(m, s - tl.log(-tl.log(tl_uniform(idx, key))), float("-inf"))
            best = tl.max(score, axis=0)
            tl.store(pbest_ptr + row * NCH + c, best)
            tl.store(pidx_ptr + row * NCH + c, tl.min(tl.where(score == best, idx, 2147483647), axis=0))


@triton.jit
def _cut_kernel(temp_ptr, topk_ptr, topp_ptr, minp_ptr, pmax_ptr, parg_ptr, pcum_ptr, pwsuf_ptr, pzc_ptr,
                rmax_ptr, rarg_ptr, cut_ptr, count_ptr, V, NCH, GREEDY_EPS: tl.constexpr, FILTERED: tl.constexpr,
                BLOCK_C: tl.constexpr, NB: tl.constexpr, LIN: tl.constexpr, LOG0: tl.constexpr):
    row = tl.program_id(0)
    tl.store(count_ptr + row, 0)  # the compact kernel's counter (runs after this launch)
    cc = tl.arange(0, BLOCK_C)
    cm = cc < NCH
    pm = tl.load(pmax_ptr + row * NCH + cc, mask=cm, other=float("-inf"))
    pa = tl.load(parg_ptr + row * NCH + cc, mask=cm, other=2147483647)
    xmax = tl.max(pm, axis=0)
    amax = tl.min(tl.where(pm == xmax, pa, 2147483647), axis=0)
    tl.store(rmax_ptr + row, xmax)
    tl.store(rarg_ptr + row, tl.where(xmax == float("-inf"), 0, amax))
    sampled, temp, k, p, k_on, p_on = row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    if sampled & (k_on | p_on) & FILTERED:
        inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        smax = xmax * inv_t
        sh = smax - pm * inv_t  # chunk c's distances are d - sh
        jj = tl.arange(0, NB)
        # a chunk bucket counts below the row edge E only when all of it is (a margin for rounding)
        a = _edge(jj, LIN, LOG0)[:, None] - sh[None, :] - 1e-4 * (1.0 + tl.abs(smax))
        off = (row * NCH + cc[None, :]) * NB
        if k_on:  # a lower bound of the logits above each row edge
            jb = tl.where(a > 0, _bucket(tl.where(a > 0, a, 0.0), NB, LIN, LOG0) - 1, -1)
            above = tl.sum(tl.load(pcum_ptr + off + jb, mask=cm[None, :] & (jb >= 0), other=0), axis=1)
            ok = above >= k
        else:  # an upper bound of the mass below each row edge, against Z
            shift = tl.exp(-sh + 1e-3)
            jb = tl.where(a > 0, _bucket(tl.where(a > 0, a, 0.0), NB, LIN, LOG0), 0)
            wsuf = tl.load(pwsuf_ptr + off + jb, mask=cm[None, :], other=0.0)
            below = tl.sum(tl.where(cm[None, :], wsuf * shift[None, :], 0.0), axis=1)
            zc = tl.load(pzc_ptr + row * NCH + cc, mask=cm, other=0.0)
            z_est = tl.sum(tl.where(cm, zc * tl.exp(-sh), 0.0), axis=0) * 0.9999  # float32 rounding, far inside
            ok = below <= (1.0 - p) * z_est
        j = tl.min(tl.where(ok, jj, NB), axis=0)
        cut = tl.where(j >= NB, float("-inf"), smax - _edge(j, LIN, LOG0))
        if ~(k_on & p_on):  # min-p alone may settle the row: cut a little below its threshold
            min_p = tl.load(minp_ptr + row).to(tl.float32)
            if min_p > 0:
                cut = tl.maximum(cut, smax + tl.log(min_p) - 1e-3 * (1.0 + tl.abs(smax)))
        tl.store(cut_ptr + row, cut)


@triton.jit
def _compact_kernel(x_ptr, stride_x, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, rmax_ptr, cut_ptr,
                    count_ptr, win_ptr, pz_ptr, pbest_ptr, pidx_ptr, V, NCH, GREEDY_EPS: tl.constexpr,
                    FILTERED: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    # every load first, none behind a branch on another: one memory round trip
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=m, other=0.0).to(tl.float32)
    xmax = tl.load(rmax_ptr + row)
    cut = tl.load(cut_ptr + row)
    sampled, temp, k, p, k_on, p_on = row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    min_p = tl.load(minp_ptr + row).to(tl.float32)
    if FILTERED:
        work = k_on | p_on | (min_p > 0)
    else:
        work = ~(k_on | p_on) & (min_p > 0)
    if sampled & work:
        inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        s = x * inv_t
        smax = xmax * inv_t
        if k_on | p_on:
            hit = m & (s >= cut)
            # one atomic per hit for its window slot: no prefix sum (one atomic per chunk and a
            # tl.cumsum measured twice as slow: 35 against 16 us at 64 x 128k)
            at = tl.atomic_add(count_ptr + row + tl.zeros_like(idx), 1, mask=hit, sem="relaxed")
            tl.store(win_ptr + row.to(tl.int64) * CAP + at, tl_pack(s, idx), mask=hit & (at < CAP))
            if p_on & ~k_on:
                tl.store(pz_ptr + row * NCH + c, tl.sum(tl.where(m, tl.exp(s - smax), 0.0).to(tl.float64), axis=0))
        else:  # min-p without top-k / top-p: Gumbel-max over s - smax >= log(min_p)
            key = tl_row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
            keep = m & ((s - smax) >= tl.log(min_p))
            score = tl.where(keep, s - tl.log(-tl.log(tl_uniform(idx, key))), float("-inf"))
            best = tl.max(score, axis=0)
            tl.store(pbest_ptr + row * NCH + c, best)
            tl.store(pidx_ptr + row * NCH + c, tl.min(tl.where(score == best, idx, 2147483647), axis=0))


def sample_select(logits, temperature, top_k, top_p, min_p, seed, position, out: torch.Tensor, done: torch.Tensor,
                  *, capacity: int = DEFAULT_CAPACITY, filtered: bool = True, block: int = 4096,
                  warps: tuple[int, int] = (8, 8), buckets: int = 64,
                  rank: tuple[int, int] = (128, 128)) -> None:
    """Write tokens into ``out`` ``[S]`` int64 and ``done`` ``[S]`` int32 (0: the row still needs the
    one-program-per-row kernel).  Arguments as :func:`kernels.sampling.sample` (checked there).

    ``capacity`` (a power of two) is the window's size per row: rows whose survivors it cannot hold
    come back not done.  ``filtered=False`` promises no row has top-k / top-p (skips the histogram,
    cut and window; such rows would just come back not done).  Tuning knobs (the result does not
    depend on them): ``block`` the chunk width, ``warps`` the warps of the two reads of the logits,
    ``buckets`` 64 or 128 histogram buckets, ``rank`` the keys per program and per step of the rank
    kernel.
    """
    S, V = logits.shape
    dev = logits.device
    assert capacity >= 1 and capacity & (capacity - 1) == 0, capacity
    assert buckets in (64, 128), buckets
    nb, lin = buckets, buckets * 3 // 4  # LIN / 3 is a power of two (see _bucket)
    log0 = (127 + (lin // 3).bit_length() - 1) << 2
    block = min(block, triton.next_power_of_2(V))
    nch = triton.cdiv(V, block)
    block_c = triton.next_power_of_2(nch)
    f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
    pmax, parg = torch.empty(S, nch, **f32), torch.empty(S, nch, **i32)
    pbest, pidx = torch.empty(S, nch, **f32), torch.empty(S, nch, **i32)
    rmax, rarg, cut, count = torch.empty(S, **f32), torch.empty(S, **i32), torch.empty(S, **f32), torch.empty(S, **i32)
    if filtered:
        pcum, pwsuf = torch.empty(S, nch, nb, **i32), torch.empty(S, nch, nb, **f32)
        pzc, pz = torch.empty(S, nch, **f32), torch.empty(S, nch, dtype=torch.float64, device=dev)
        win = torch.empty(S, capacity, dtype=torch.int64, device=dev)
    else:
        pcum = pwsuf = pzc = pz = win = pmax  # never read
    params = (temperature, top_k, top_p, min_p, seed, position)
    common = dict(GREEDY_EPS=GREEDY_EPS, FILTERED=filtered)
    hist = dict(NB=nb, LIN=lin, LOG0=log0)
    _chunk_kernel[(S, nch)](logits, logits.stride(0), *params, pmax, parg, pcum, pwsuf, pzc, pbest, pidx, V, nch,
                            BLOCK=block, num_warps=warps[0], **common, **hist)
    _cut_kernel[(S,)](*params[:4], pmax, parg, pcum, pwsuf, pzc, rmax, rarg, cut, count, V, nch, BLOCK_C=block_c,
                      num_warps=4, **common, **hist)
    _compact_kernel[(S, nch)](logits, logits.stride(0), *params, rmax, cut, count, win, pz, pbest, pidx, V, nch,
                              BLOCK=block, CAP=capacity, num_warps=warps[1], **common)
    finish_window(params, rarg, rmax, cut, count, win, pz, pbest, pidx, out, done, V, nch, capacity, filtered, rank)
