"""The last two launches of :mod:`kernels.sampling_select`: the row's window put in order, then the
reference's rule on it.

4. ``_rank_kernel``, grid ``(S, capacity / RB)``: program ``b`` takes window keys ``b * RB ..`` and
   counts, for each, the larger keys of the window (blocks of ``CB``, an ``RB x CB`` comparison
   each): that count is the key's place in the descending order (keys are unique: value, then
   lowest index), and the key is stored there.  No sort: a window of ``n`` keys costs ``n * n``
   comparisons spread over ``ceil(n / RB)`` programs (``tl.sort`` of one row's window in one
   program was the select path's largest cost, 45 us at 64 x 128k).
5. ``_decide_kernel``, grid ``(S,)``: per row the ordered window (256 or 1,024 slots when it is
   that small, else ``capacity``) and the reference's rule on it: the ``top_k``-th largest, the prefix
   masses (``tl.cumsum``, float64, in the reference's sorted order), min-p, Gumbel-max over the
   survivors with the same hashed uniforms; or, for rows without top-k / top-p, the chunks'
   Gumbel-max winners; greedy rows take the row's first argmax.  A row is marked not done when
   the window cannot close its decision (see :mod:`kernels.sampling_select`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_hash import tl_row_key, tl_uniform
from .sampling_ref import GREEDY_EPS
from .topn import tl_key_index, tl_key_value

__all__ = ["finish_window", "row_params"]

_SMALL, _MID = 256, 1024  # window slots the decision reads when the window is that small


@triton.jit
def row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS: tl.constexpr):
    """(sampled, temperature, top_k, top_p, top-k on, top-p on) of a row."""
    temp = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(topk_ptr + row).to(tl.int64)
    p = tl.load(topp_ptr + row).to(tl.float32)
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    return temp >= GREEDY_EPS, temp, k, p, k_on, p_on


@triton.jit
def _rank_kernel(count_ptr, win_ptr, sorted_ptr, CAP: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1)
    n_w = tl.load(count_ptr + row)
    if (n_w <= CAP) & (b * RB < n_w):
        i = b * RB + tl.arange(0, RB)
        base = win_ptr + row.to(tl.int64) * CAP
        mine = tl.load(base + i, mask=i < n_w, other=-9223372036854775807 - 1)
        place = tl.zeros([RB], tl.int32)
        for jb in range(0, n_w, CB):
            jj = jb + tl.arange(0, CB)
            kb = tl.load(base + jj, mask=jj < n_w, other=-9223372036854775807 - 1)  # padding: never larger
            place += tl.sum((kb[None, :] > mine[:, None]).to(tl.int32), axis=1)
        tl.store(sorted_ptr + row.to(tl.int64) * CAP + place, mine, mask=i < n_w)


@triton.jit
def _decide(sorted_ptr, row, n_w, cut, smax, k, p, z, min_p, seed, pos, k_on, p_on, CAP: tl.constexpr,
            W: tl.constexpr):
    """(token, exact) from the row's ordered window of ``n_w <= W`` keys (all logits with s >= the cut)."""
    j = tl.arange(0, W)
    valid = j < n_w
    keys = tl.load(sorted_ptr + row.to(tl.int64) * CAP + j, mask=valid, other=-9223372036854775807 - 1)
    s = tl.where(valid, tl_key_value(keys), float("-inf"))  # descending; ties by lowest index
    ids = tl_key_index(keys)
    tau = tl.full((), float("-inf"), tl.float32)
    exact = tl.full((), 1, tl.int32)
    if k_on:
        tau = tl.max(tl.where(valid & (j == k - 1), s, float("-inf")), axis=0)
        exact = (k <= n_w).to(tl.int32)  # then every top-k survivor is inside
    in_k = valid & (s >= tau)
    w = tl.where(in_k, tl.exp(s - smax), 0.0).to(tl.float64)
    if p_on:
        mass = tl.sum(w, axis=0)
        if k_on:
            z = mass
        else:
            exact = (mass >= p.to(tl.float64) * z).to(tl.int32)  # the nucleus ends inside the window
        excl = tl.cumsum(w, axis=0) - w
        n = tl.maximum(tl.sum((in_k & (excl < p.to(tl.float64) * z)).to(tl.int32), axis=0), 1)
        tau = tl.maximum(tau, tl.max(tl.where(valid & (j == n - 1), s, float("-inf")), axis=0))
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
def _decide_kernel(temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, rarg_ptr, rmax_ptr, cut_ptr, count_ptr,
                   sorted_ptr, pz_ptr, pbest_ptr, pidx_ptr, out_ptr, done_ptr, V, NCH, GREEDY_EPS: tl.constexpr,
                   FILTERED: tl.constexpr, BLOCK_C: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr,
                   MID: tl.constexpr):
    row = tl.program_id(0)
    tok = tl.load(rarg_ptr + row)  # greedy: the row's first argmax
    done = tl.full((), 1, tl.int32)
    cc = tl.arange(0, BLOCK_C)
    sampled, temp, k, p, k_on, p_on = row_params(temp_ptr, topk_ptr, topp_ptr, row, V, GREEDY_EPS)
    if sampled:
        if k_on | p_on:
            done = tl.full((), 0, tl.int32)
            if FILTERED:
                n_w = tl.load(count_ptr + row)
                if n_w <= CAP:
                    smax = tl.load(rmax_ptr + row) * tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
                    z = tl.zeros((), tl.float64)
                    if p_on & ~k_on:
                        z = tl.sum(tl.load(pz_ptr + row * NCH + cc, mask=cc < NCH, other=0.0), axis=0)
                    cut = tl.load(cut_ptr + row)
                    min_p = tl.load(minp_ptr + row)
                    seed = tl.load(seed_ptr + row)
                    pos = tl.load(pos_ptr + row)
                    if n_w <= SMALL:
                        tok, done = _decide(sorted_ptr, row, n_w, cut, smax, k, p, z, min_p, seed, pos, k_on, p_on,
                                            CAP, SMALL)
                    elif n_w <= MID:
                        tok, done = _decide(sorted_ptr, row, n_w, cut, smax, k, p, z, min_p, seed, pos, k_on, p_on,
                                            CAP, MID)
                    else:
                        tok, done = _decide(sorted_ptr, row, n_w, cut, smax, k, p, z, min_p, seed, pos, k_on, p_on,
                                            CAP, CAP)
        else:
            pb = tl.load(pbest_ptr + row * NCH + cc, mask=cc < NCH, other=float("-inf"))
            pi = tl.load(pidx_ptr + row * NCH + cc, mask=cc < NCH, other=2147483647)
            best = tl.max(pb, axis=0)
            tok = tl.where(best == float("-inf"), 0, tl.min(tl.where(pb == best, pi, 2147483647), axis=0))
    tl.store(out_ptr + row, tok.to(tl.int64))
    tl.store(done_ptr + row, done)


def finish_window(params, rarg, rmax, cut, count, win, pz, pbest, pidx, out, done, V: int, nch: int, capacity: int,
                  filtered: bool, rank: tuple[int, int]) -> None:
    """Launches 4 and 5 of :func:`kernels.sampling_select.sample_select` (its buffers; module docstring).

    ``rank``: keys per program and keys compared per step of the rank kernel (powers of two).
    """
    S = out.shape[0]
    ordered = win
    if filtered:
        ordered = torch.empty_like(win)
        rb = min(rank[0], capacity)
        _rank_kernel[(S, capacity // rb)](count, win, ordered, CAP=capacity, RB=rb, CB=min(rank[1], capacity),
                                          num_warps=8)
    _decide_kernel[(S,)](*params, rarg, rmax, cut, count, ordered, pz, pbest, pidx, out, done, V, nch,
                         GREEDY_EPS=GREEDY_EPS, FILTERED=filtered, BLOCK_C=triton.next_power_of_2(nch), CAP=capacity,
                         SMALL=min(_SMALL, capacity), MID=min(_MID, capacity), num_warps=8)
