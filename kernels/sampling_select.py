"""The sampler's path for steps where rows filter: top-k / top-p thresholds by a histogram cut and
a compacted window, with no ``torch.topk`` and no sort of the row.

Same function as :mod:`kernels.sampling_ref` (same keyed uniforms, thresholds and first-index tie
rules), in five launches, none reading a device value on the host (capturable):

1. ``_max_part_kernel`` (:mod:`kernels.sampling_window`), grid ``(S, NCH)``: each chunk's max and
   first argmax.  Greedy rows are done after this.
2. ``_hist_kernel``, grid ``(S, NCH)``: rows with neither top-k nor top-p get the chunk's
   Gumbel-max winner.  Filtering rows get a 128-bucket histogram (``tl.histogram``) of each
   logit's distance ``d = max(s) - s``: buckets 1/4 wide up to ``d = 24``, then 4 per octave, the
   last one open; top-p rows without top-k also the chunk's mass ``sum exp(s - max)`` (float32
   terms, float64 sum).
3. ``_cut_kernel``, grid ``(S,)``: the row's histogram picks a cut ``e`` (keep ``s >= e``) meant to
   hold every survivor in few entries: for top-k the first bucket edge with ``>= top_k`` logits
   above it; for top-p alone the first edge whose *upper bound* of the mass below it
   (``count * exp(-lower edge)`` per bucket) is ``<= (1 - top_p) * Z``; with min-p (and not both
   top-k and top-p) no lower than just under the min-p threshold.
4. ``_compact_kernel``, grid ``(S, NCH)``: every logit with ``s >= e`` goes into the row's window
   (``capacity`` slots; an atomic counter per row hands out positions), packed as one int64 key
   (value, then lowest index: :func:`kernels.topn.tl_pack`).
5. ``_finish_kernel``, grid ``(S,)``: sorts the window (``tl.sort``, 256 slots when the window is
   that small, else ``capacity``) and applies the reference's rule on it: the ``top_k``-th
   largest, the prefix masses (``tl.cumsum``, float64, in the reference's sorted order), min-p,
   Gumbel-max over the survivors.

The cut is only a guess; exactness is checked, not assumed.  The window is a prefix of the row's
sorted order (all of ``s >= e``, ties included), so the result is exact when the window did not
overflow and it closes the decision: ``top_k <= count`` (then every top-k survivor, and so the
top-p mass ``Z`` over them, is inside), or, for top-p alone, the window's mass reaches
``top_p * Z``.  Rows that fail (a nucleus or ``top_k`` wider than ``capacity``, e.g. a nearly flat
distribution at top_p 0.99) are marked not done and :func:`kernels.sampling.sample` finishes them
with the one-program-per-row kernel (slow but exact).

Ties, as in the reference: the thresholds are values, so logits tied at the ``top_k``-th value or
at the nucleus edge are kept or dropped together (``-0.0`` and ``+0.0`` are one value); the window
holds all of a tie because it is ``s >= e``; among equal Gumbel scores the lowest vocab index
wins; an all ``-inf`` row (every survivor's score ``-inf``) gives token 0.

Cost on an H100 at 64 x 128256 (``scripts/bench_topp.py``, docs/performance.md): top-k 50
104 us, top-p 0.9 146 us, both 103 us, mixed rows 122 us (``torch.topk`` window: ~200 us).

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
from .sampling_window import _max_part_kernel, _row_max
from .topn import tl_key_index, tl_key_value, tl_pack

__all__ = ["sample_select", "DEFAULT_CAPACITY"]

DEFAULT_CAPACITY = 2048
_NB = 128  # histogram buckets
_LIN = 96  # buckets of width 1/4 for d = max(s) - s < _LIN / 4 = 24, then 4 per octave (see _edge)
_SMALL = 256  # window slots sorted when the window is that small


@triton.jit
def _row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS: tl.constexpr):
    temp = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(topk_ptr + row).to(tl.int64)
    p = tl.load(topp_ptr + row).to(tl.float32)
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    return temp >= GREEDY_EPS, temp, k, p, k_on, p_on


@triton.jit
def _edge(j, LIN: tl.constexpr):
    """Where bucket ``j`` starts, as a distance below the max: ``j / 4`` up to ``LIN / 4``, then 4 per octave."""
    jf = j.to(tl.float32)
    return tl.where(j <= LIN, jf * 0.25, LIN * 0.25 * tl.exp2((jf - LIN) * 0.25))


@triton.jit
def _bucket(d, NB: tl.constexpr, LIN: tl.constexpr):
    """The bucket of a distance ``d >= 0``: ``j`` with ``_edge(j) <= d < _edge(j + 1)`` (the last one open)."""
    lin = tl.floor(d * 4.0)
    lg = LIN + tl.floor(4.0 * tl.log2(tl.minimum(tl.maximum(d, LIN * 0.25) * (4.0 / LIN), 2.0**60)))
    b = tl.minimum(tl.where(d < LIN * 0.25, lin, lg), NB - 1.0).to(tl.int32)
    return tl.where(d == d, b, NB - 1)  # NaN (an infinite max): the last bucket


@triton.jit
def _hist_kernel(x_ptr, stride_x, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, pmax_ptr, parg_ptr,
                 pcnt_ptr, pz_ptr, pbest_ptr, pidx_ptr, V, NCH, GREEDY_EPS: tl.constexpr, FILTERED: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, NB: tl.constexpr, LIN: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    # every load first, none behind a branch on another: one memory round trip, not three
    idx = c * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=m, other=0.0).to(tl.float32)
    xmax, amax = _row_max(pmax_ptr, parg_ptr, row, NCH, BLOCK_C)
    sampled, temp, k, p, k_on, p_on = _row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    if sampled:
        inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        smax = xmax * inv_t
        s = x * inv_t
        if k_on | p_on:
            if FILTERED:
                b = _bucket(smax - s, NB, LIN)
                hist = tl.histogram(b, NB, mask=m)
                tl.store(pcnt_ptr + (row * NCH + c) * NB + tl.arange(0, NB), hist)
                if p_on & ~k_on:
                    w = tl.where(m, tl.exp(s - smax), 0.0).to(tl.float64)
                    tl.store(pz_ptr + row * NCH + c, tl.sum(w, axis=0))
        else:
            min_p = tl.load(minp_ptr + row).to(tl.float32)
            log_mp = tl.where(min_p > 0, tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))
            key = tl_row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
            keep = m & ((s - smax) >= log_mp)
            score = tl.where(keep, s - tl.log(-tl.log(tl_uniform(idx, key))), float("-inf"))
            best = tl.max(score, axis=0)
            tl.store(pbest_ptr + row * NCH + c, best)
            tl.store(pidx_ptr + row * NCH + c, tl.min(tl.where(score == best, idx, 2147483647), axis=0))


@triton.jit
def _cut_kernel(temp_ptr, topk_ptr, topp_ptr, minp_ptr, pmax_ptr, parg_ptr, pcnt_ptr, pz_ptr, cut_ptr, z_ptr,
                count_ptr, V, NCH,
                GREEDY_EPS: tl.constexpr, BLOCK_C: tl.constexpr, NB: tl.constexpr, LIN: tl.constexpr):
    row = tl.program_id(0)
    tl.store(count_ptr + row, 0)  # the compact kernel's counter (runs after this launch)
    sampled, temp, k, p, k_on, p_on = _row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    if sampled & (k_on | p_on):
        inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        xmax, amax = _row_max(pmax_ptr, parg_ptr, row, NCH, BLOCK_C)
        cc = tl.arange(0, BLOCK_C)
        jj = tl.arange(0, NB)
        cnt = tl.sum(tl.load(pcnt_ptr + (row * NCH + cc[:, None]) * NB + jj[None, :], mask=(cc < NCH)[:, None],
                             other=0), axis=0)
        above = tl.cumsum(cnt, axis=0) - cnt  # logits in buckets < j, i.e. with d < edge(j)
        if k_on:
            ok = above >= k
        else:
            z = tl.sum(tl.load(pz_ptr + row * NCH + cc, mask=cc < NCH, other=0.0), axis=0)
            tl.store(z_ptr + row, z)
            # each logit of bucket i weighs at most exp(-edge(i)): an upper bound of the mass below edge j
            hi_w = cnt.to(tl.float64) * tl.exp(-_edge(jj, LIN)).to(tl.float64)
            below = tl.sum(hi_w, axis=0) - (tl.cumsum(hi_w, axis=0) - hi_w)
            ok = below <= (1.0 - p.to(tl.float64)) * z
        j = tl.min(tl.where(ok, jj, NB), axis=0)
        smax = xmax * inv_t
        cut = tl.where(j >= NB, float("-inf"), smax - _edge(j, LIN))
        if ~(k_on & p_on):  # min-p alone may settle the row: cut a little below its threshold
            min_p = tl.load(minp_ptr + row).to(tl.float32)
            if min_p > 0:
                cut = tl.maximum(cut, smax + tl.log(min_p) - 1e-3 * (1.0 + tl.abs(smax)))
        tl.store(cut_ptr + row, cut)


@triton.jit
def _compact_kernel(x_ptr, stride_x, temp_ptr, topk_ptr, topp_ptr, cut_ptr, count_ptr, win_ptr, V,
                    GREEDY_EPS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=m, other=0.0).to(tl.float32)
    cut = tl.load(cut_ptr + row)
    sampled, temp, k, p, k_on, p_on = _row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    if sampled & (k_on | p_on):
        s = x * tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        hit = m & (s >= cut)
        n = tl.sum(hit.to(tl.int32), axis=0)
        if n > 0:
            base = tl.atomic_add(count_ptr + row, n)
            at = base + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(win_ptr + row.to(tl.int64) * CAP + at, tl_pack(s, idx), mask=hit & (at < CAP))


@triton.jit
def _rank_pass(base, keys, n_w, tau, smax, W: tl.constexpr, RB: tl.constexpr, MASS: tl.constexpr):
    """Per window key: how many keys are larger (``MASS``: their mass ``exp(s - smax)`` over s >= tau, float64)."""
    if MASS:
        acc = tl.zeros([W], tl.float64)
    else:
        acc = tl.zeros([W], tl.int32)
    for jb in range(0, W, RB):
        jj = jb + tl.arange(0, RB)
        kb = tl.load(base + jj, mask=jj < n_w, other=-9223372036854775807 - 1)
        gt = kb[None, :] > keys[:, None]
        if MASS:
            sb = tl_key_value(kb)
            wb = tl.where((jj < n_w) & (sb >= tau), tl.exp(sb - smax), 0.0).to(tl.float64)
            acc += tl.sum(tl.where(gt, wb[None, :], 0.0), axis=1)
        else:
            acc += tl.sum(gt.to(tl.int32), axis=1)
    return acc


@triton.jit
def _decide(win_ptr, row, n_w, cut, smax, k, p, z, min_p, seed, pos, k_on, p_on, CAP: tl.constexpr,
            W: tl.constexpr, RANK: tl.constexpr):
    """(token, exact) from the row's window of ``n_w <= W`` keys (all logits with s >= the cut).

    ``RANK``: each key's place in the descending order by counting the larger keys (no sort); else ``tl.sort``.
    """
    j = tl.arange(0, W)
    valid = j < n_w
    base = win_ptr + row.to(tl.int64) * CAP
    keys = tl.load(base + j, mask=valid, other=-9223372036854775807 - 1)
    if RANK:
        place = _rank_pass(base, keys, n_w, 0.0, smax, W, 8192 // W, False)
    else:
        keys = tl.sort(keys, descending=True)  # value descending, then lowest index; padding last
        place = j
    valid = j < n_w  # (a key's slot may move in the sort; padding is smallest, so still the tail)
    s = tl.where(valid, tl_key_value(keys), float("-inf"))
    ids = tl_key_index(keys)
    tau = tl.full((), float("-inf"), tl.float32)
    exact = tl.full((), 1, tl.int32)
    if k_on:
        tau = tl.max(tl.where(valid & (place == k - 1), s, float("-inf")), axis=0)
        exact = (k <= n_w).to(tl.int32)  # then every top-k survivor is inside
    in_k = valid & (s >= tau)
    w = tl.where(in_k, tl.exp(s - smax), 0.0).to(tl.float64)
    if p_on:
        mass = tl.sum(w, axis=0)
        if k_on:
            z = mass
        else:
            exact = (mass >= p.to(tl.float64) * z).to(tl.int32)  # the nucleus ends inside the window
        if RANK:
            excl = _rank_pass(base, keys, n_w, tau, smax, W, 8192 // W, True)
        else:
            excl = tl.cumsum(w, axis=0) - w
        n = tl.maximum(tl.sum((in_k & (excl < p.to(tl.float64) * z)).to(tl.int32), axis=0), 1)
        tau = tl.maximum(tau, tl.max(tl.where(valid & (place == n - 1), s, float("-inf")), axis=0))
    log_mp = tl.where(min_p > 0, tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))
    # not closed, but min-p drops everything outside (s < cut): exact unless top-k and top-p both
    # apply (then Z needs all top-k survivors).  The window's tau is then <= every entry.
    exact = exact | ((~(k_on & p_on)) & ((cut - smax) < log_mp)).to(tl.int32)
    survive = valid & (s >= tau) & ((s - smax) >= log_mp)
    score = tl.where(survive, s - tl.log(-tl.log(tl_uniform(ids, tl_row_key(seed, pos)))), float("-inf"))
    best = tl.max(score, axis=0)
    tok = tl.min(tl.where(score == best, ids, 2147483647), axis=0)
    return tl.where(best == float("-inf"), 0, tok), exact


@triton.jit
def _finish_kernel(temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, pmax_ptr, parg_ptr, pbest_ptr,
                   pidx_ptr, z_ptr, cut_ptr, count_ptr, win_ptr, out_ptr, done_ptr, V, NCH, GREEDY_EPS: tl.constexpr,
                   FILTERED: tl.constexpr, BLOCK_C: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr,
                   RANK: tl.constexpr):
    row = tl.program_id(0)
    xmax, tok = _row_max(pmax_ptr, parg_ptr, row, NCH, BLOCK_C)
    done = tl.full((), 1, tl.int32)
    sampled, temp, k, p, k_on, p_on = _row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    if sampled:
        if k_on | p_on:
            done = tl.full((), 0, tl.int32)
            if FILTERED:
                n_w = tl.load(count_ptr + row)
                if n_w <= CAP:
                    smax = xmax * tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
                    z = tl.load(z_ptr + row)
                    cut = tl.load(cut_ptr + row)
                    min_p = tl.load(minp_ptr + row)
                    seed = tl.load(seed_ptr + row)
                    pos = tl.load(pos_ptr + row)
                    if n_w <= SMALL:
                        tok, done = _decide(win_ptr, row, n_w, cut, smax, k, p, z, min_p, seed, pos, k_on, p_on,
                                            CAP, SMALL, RANK)
                    else:
                        tok, done = _decide(win_ptr, row, n_w, cut, smax, k, p, z, min_p, seed, pos, k_on, p_on,
                                            CAP, CAP, RANK)
        else:
            cc = tl.arange(0, BLOCK_C)
            pb = tl.load(pbest_ptr + row * NCH + cc, mask=cc < NCH, other=float("-inf"))
            pi = tl.load(pidx_ptr + row * NCH + cc, mask=cc < NCH, other=2147483647)
            best = tl.max(pb, axis=0)
            tok = tl.where(best == float("-inf"), 0, tl.min(tl.where(pb == best, pi, 2147483647), axis=0))
    tl.store(out_ptr + row, tok.to(tl.int64))
    tl.store(done_ptr + row, done)


def sample_select(logits, temperature, top_k, top_p, min_p, seed, position, out: torch.Tensor, done: torch.Tensor,
                  *, capacity: int = DEFAULT_CAPACITY, filtered: bool = True, block: int = 4096,
                  finish: str = "sort") -> None:
    """Write tokens into ``out`` ``[S]`` int64 and ``done`` ``[S]`` int32 (0: the row still needs the
    one-program-per-row kernel).  Arguments as :func:`kernels.sampling.sample` (checked there).

    ``capacity`` (a power of two) is the window's size per row: rows whose survivors it cannot
    hold come back not done.  ``filtered=False`` promises no row has top-k / top-p (skips the
    histogram, cut, window; such rows would just come back not done).  ``block`` is the chunk
    width and ``finish`` how the window is ordered: ``"sort"`` (``tl.sort``) or ``"rank"`` (each key
    counts the larger keys, a ``W x W`` comparison in blocks; no sort): tuning knobs, the result
    does not depend on them.
    """
    S, V = logits.shape
    dev = logits.device
    assert capacity >= 1 and capacity & (capacity - 1) == 0, capacity
    assert finish in ("sort", "rank") and capacity <= 8192, (finish, capacity)
    block = min(block, triton.next_power_of_2(V))
    nch = triton.cdiv(V, block)
    block_c = triton.next_power_of_2(nch)
    pmax = torch.empty(S, nch, dtype=torch.float32, device=dev)
    parg = torch.empty(S, nch, dtype=torch.int32, device=dev)
    pbest = torch.empty(S, nch, dtype=torch.float32, device=dev)
    pidx = torch.empty(S, nch, dtype=torch.int32, device=dev)
    if filtered:
        pcnt = torch.empty(S, nch, _NB, dtype=torch.int32, device=dev)
        pz = torch.empty(S, nch, dtype=torch.float64, device=dev)
        cut = torch.empty(S, dtype=torch.float32, device=dev)
        z = torch.empty(S, dtype=torch.float64, device=dev)
        count = torch.empty(S, dtype=torch.int32, device=dev)
        win = torch.empty(S, capacity, dtype=torch.int64, device=dev)
    else:
        pcnt = pz = cut = z = count = win = pmax  # never read
    rows = (logits, logits.stride(0), temperature, top_k, top_p)
    _max_part_kernel[(S, nch)](logits, logits.stride(0), pmax, parg, V, nch, BLOCK=block, num_warps=8)
    _hist_kernel[(S, nch)](*rows, min_p, seed, position, pmax, parg, pcnt, pz, pbest, pidx, V, nch,
                           GREEDY_EPS=GREEDY_EPS, FILTERED=filtered, BLOCK=block, BLOCK_C=block_c, NB=_NB, LIN=_LIN,
                           num_warps=8)
    if filtered:
        _cut_kernel[(S,)](temperature, top_k, top_p, min_p, pmax, parg, pcnt, pz, cut, z, count, V, nch,
                          GREEDY_EPS=GREEDY_EPS, BLOCK_C=block_c, NB=_NB, LIN=_LIN, num_warps=4)
        _compact_kernel[(S, nch)](*rows, cut, count, win, V, GREEDY_EPS=GREEDY_EPS, BLOCK=block, CAP=capacity,
                                  num_warps=8)
    _finish_kernel[(S,)](temperature, top_k, top_p, min_p, seed, position, pmax, parg, pbest, pidx, z, cut, count, win,
                         out, done, V, nch, GREEDY_EPS=GREEDY_EPS, FILTERED=filtered, BLOCK_C=block_c, CAP=capacity,
                         SMALL=min(_SMALL, capacity), RANK=finish == "rank", num_warps=8)
