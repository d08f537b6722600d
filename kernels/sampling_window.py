"""The fast path of :func:`kernels.sampling.sample`: rows split over many programs, and top-k /
top-p resolved on a sorted window of each row's largest logits.

Same function as :mod:`kernels.sampling_ref` (same keyed uniforms, same thresholds, same
first-index tie rules), in four launches, none reading a device value on the host:

1. ``_max_part_kernel``, grid ``(S, NCH)``: each chunk's max and first argmax.  Greedy rows
   are done after this (their token is the first argmax of the row).
2. ``_row_pass_kernel``, grid ``(S, NCH)``: for rows with neither top-k nor top-p
   (temperature / min-p only) the chunk's Gumbel-max winner (score, first index); for top-p
   rows without top-k the chunk's top-p mass ``sum exp(s - max)`` (float32 terms, float64
   sum).  Other rows exit at once.
3. the window: ``torch.topk(logits, C)`` sorted, or with ``chunk`` set
   :func:`kernels.sampling_topk.chunk_candidates` (the top ``C / chunks`` of every
   ``chunk``-wide piece of the row, a two-stage top-k) sorted, with ``bound``: every logit outside
   the window is ``<= bound``.  (``x -> x * (1/T)`` is monotone, so the same holds for ``s``.)
4. ``_finish_kernel``, grid ``(S,)``: per row, the reference's computation on the window
   (k-th largest, prefix masses by ``tl.cumsum``, min-p, Gumbel-max over survivors).  The
   result is exact when nothing outside the window can survive: the final threshold is
   above ``bound``, or min-p drops ``bound`` (so everything
   outside), or the window is the whole row.  Otherwise (top_k >= C, a nucleus wider than
   C tokens, ties across the window's edge) the row is marked not done and
   :func:`kernels.sampling.sample` finishes it with the one-program-per-row kernel.

So every token equals the reference's up to the same float caveat as before (top-p masses
summed in a different order: a top-p boundary within float64 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_hash import tl_row_key, tl_uniform
from .sampling_ref import GREEDY_EPS
from .sampling_topk import chunk_candidates, chunk_layout

__all__ = ["sample_window", "DEFAULT_CANDIDATES"]

DEFAULT_CANDIDATES = 1024
_BIG = 2147483647


@triton.jit
def _max_part_kernel(x_ptr, stride_x, pmax_ptr, parg_ptr, V, NCH, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, axis=0)
    tl.store(pmax_ptr + row * NCH + c, mx)
    tl.store(parg_ptr + row * NCH + c, tl.min(tl.where(x == mx, idx, 2147483647), axis=0))


@triton.jit
def _row_max(pmax_ptr, parg_ptr, row, NCH, BLOCK_C: tl.constexpr):
    """The row's max logit and its first index, from the chunk partials."""
    cc = tl.arange(0, BLOCK_C)
    pm = tl.load(pmax_ptr + row * NCH + cc, mask=cc < NCH, other=float("-inf"))
    pa = tl.load(parg_ptr + row * NCH + cc, mask=cc < NCH, other=2147483647)
    xmax = tl.max(pm, axis=0)
    amax = tl.min(tl.where(pm == xmax, pa, 2147483647), axis=0)
    return xmax, tl.where(xmax == float("-inf"), 0, amax)


@triton.jit
def _row_pass_kernel(x_ptr, stride_x, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, pmax_ptr,
                     parg_ptr, pz_ptr, pbest_ptr, pidx_ptr, V, NCH, GREEDY_EPS: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(topk_ptr + row).to(tl.int64)
    p = tl.load(topp_ptr + row).to(tl.float32)
    p_on = p < 1.0
    need_z = p_on & (k <= 0) | p_on & (k >= V)
    plain = ((k <= 0) | (k >= V)) & (p >= 1.0)
    if (temp >= GREEDY_EPS) & (need_z | plain):
        inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
        xmax, amax = _row_max(pmax_ptr, parg_ptr, row, NCH, BLOCK_C)
        smax = xmax * inv_t
        idx = c * BLOCK + tl.arange(0, BLOCK)
        m = idx < V
        s = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=m, other=0.0).to(tl.float32) * inv_t
        if need_z:
            tl.store(pz_ptr + row * NCH + c, tl.sum(tl.where(m, tl.exp(s - smax), 0.0).to(tl.float64), axis=0))
        if plain:
            min_p = tl.load(minp_ptr + row).to(tl.float32)
            log_mp = tl.where(min_p > 0, tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))
            key = tl_row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
            keep = m & ((s - smax) >= log_mp)
            score = tl.where(keep, s - tl.log(-tl.log(tl_uniform(idx, key))), float("-inf"))
            best = tl.max(score, axis=0)
            tl.store(pbest_ptr + row * NCH + c, best)
            tl.store(pidx_ptr + row * NCH + c, tl.min(tl.where(score == best, idx, 2147483647), axis=0))


@triton.jit
def _window_row(row, wv_ptr, wi_ptr, bound_ptr, pz_ptr, xmax, temp, k, p, min_p, seed, pos, k_on, p_on, C, NCH,
                WHOLE_ROW: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    """(token, exact) for a top-k / top-p row from its sorted window of C logits."""
    j = tl.arange(0, BLOCK_W)
    wm = j < C
    wbase = wv_ptr + row.to(tl.int64) * C
    inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temp)
    s = tl.load(wbase + j, mask=wm, other=float("-inf")).to(tl.float32) * inv_t
    ids = tl.load(wi_ptr + row.to(tl.int64) * C + j, mask=wm, other=0)
    smax = xmax * inv_t
    s_last = tl.load(bound_ptr + row) * inv_t  # every logit outside the window is <= this
    tau = tl.full((), float("-inf"), tl.float32)
    exact = tl.full((), 1, tl.int32)
    if k_on:
        tau = tl.load(wbase + tl.minimum(k, C) - 1).to(tl.float32) * inv_t
        # all top-k survivors (ties included) inside the window, so Z below is complete
        exact = ((k <= C) & (tau > s_last)).to(tl.int32)
    in_k = wm & (s >= tau)
    w = tl.where(in_k, tl.exp(s - smax), 0.0).to(tl.float64)
    if p_on:
        if k_on:
            z = tl.sum(w, axis=0)
        else:
            cc = tl.arange(0, BLOCK_C)
            z = tl.sum(tl.load(pz_ptr + row * NCH + cc, mask=cc < NCH, other=0.0), axis=0)
        excl = tl.cumsum(w, axis=0) - w
        n = tl.maximum(tl.sum((in_k & (excl < p.to(tl.float64) * z)).to(tl.int32), axis=0), 1)
        tau = tl.maximum(tau, tl.load(wbase + n - 1).to(tl.float32) * inv_t)
    log_mp = tl.where(min_p > 0, tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))
    # nothing outside the window (all <= s_last) survives
    exact = exact & ((tau > s_last) | ((s_last - smax) < log_mp)).to(tl.int32)
    if WHOLE_ROW:
        exact = tl.full((), 1, tl.int32)
    survive = wm & (s >= tau) & ((s - smax) >= log_mp)
    u = tl_uniform(ids, tl_row_key(seed, pos))
    score = tl.where(survive, s - tl.log(-tl.log(u)), float("-inf"))
    best = tl.max(score, axis=0)
    tok = tl.min(tl.where(score == best, ids, 2147483647), axis=0).to(tl.int32)
    return tl.where(best == float("-inf"), 0, tok), exact


@triton.jit
def _finish_kernel(temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, pmax_ptr, parg_ptr, pz_ptr,
                   pbest_ptr, pidx_ptr, wv_ptr, wi_ptr, bound_ptr, out_ptr, done_ptr, V, NCH, C,
                   HAS_WINDOW: tl.constexpr, WHOLE_ROW: tl.constexpr, GREEDY_EPS: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    xmax, tok = _row_max(pmax_ptr, parg_ptr, row, NCH, BLOCK_C)
    done = tl.full((), 1, tl.int32)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp >= GREEDY_EPS:
        k = tl.load(topk_ptr + row).to(tl.int64)
        p = tl.load(topp_ptr + row).to(tl.float32)
        k_on = (k > 0) & (k < V)
        p_on = p < 1.0
        if ((k <= 0) | (k >= V)) & (p >= 1.0):
            cc = tl.arange(0, BLOCK_C)
            pb = tl.load(pbest_ptr + row * NCH + cc, mask=cc < NCH, other=float("-inf"))
            pi = tl.load(pidx_ptr + row * NCH + cc, mask=cc < NCH, other=2147483647)
            best = tl.max(pb, axis=0)
            tok = tl.where(best == float("-inf"), 0, tl.min(tl.where(pb == best, pi, 2147483647), axis=0))
        else:
            done = tl.full((), 0, tl.int32)
            if HAS_WINDOW:
                t, exact = _window_row(row, wv_ptr, wi_ptr, bound_ptr, pz_ptr, xmax, temp, k, p, tl.load(minp_ptr + row),
                                       tl.load(seed_ptr + row), tl.load(pos_ptr + row), k_on, p_on, C, NCH,
                                       WHOLE_ROW, BLOCK_W, BLOCK_C)
                tok = t
                done = exact
    tl.store(out_ptr + row, tok.to(tl.int64))
    tl.store(done_ptr + row, done)


def sample_window(logits, temperature, top_k, top_p, min_p, seed, position, out: torch.Tensor,
                  done: torch.Tensor, *, candidates: int = DEFAULT_CANDIDATES, filtered: bool = True,
                  chunk: int | None = None, block: int = 4096) -> None:
    """Write tokens into ``out`` ``[S]`` int64 and ``done`` ``[S]`` int32 (0: the row still needs
    the one-program-per-row kernel).  Arguments as :func:`kernels.sampling.sample` (checked there).

    ``filtered=False`` promises no row has top-k / top-p (skips the window; such rows would
    just come back not done).  The window is about ``candidates`` logits: the top
    ``cdiv(candidates, chunks)`` of every ``chunk``-wide piece of the row, sorted; ``chunk=None``
    (default): one ``torch.topk`` over the whole row.  On an H100 at 64 x 128256 the chunked
    form (``torch.topk`` per chunk) measured no faster: 200-222 us against 192 us for the
    whole-row ``torch.topk(k=1024)``; torch's top-k itself is the cost (k=20 alone: 159 us).
    """
    S, V = logits.shape
    dev = logits.device
    block = min(block, triton.next_power_of_2(V))
    nch = triton.cdiv(V, block)
    pmax = torch.empty(S, nch, dtype=torch.float32, device=dev)
    parg = torch.empty(S, nch, dtype=torch.int32, device=dev)
    pz = torch.empty(S, nch, dtype=torch.float64, device=dev)
    pbest = torch.empty(S, nch, dtype=torch.float32, device=dev)
    pidx = torch.empty(S, nch, dtype=torch.int32, device=dev)
    block_c = triton.next_power_of_2(nch)
    _max_part_kernel[(S, nch)](logits, logits.stride(0), pmax, parg, V, nch, BLOCK=block, num_warps=8)
    _row_pass_kernel[(S, nch)](logits, logits.stride(0), temperature, top_k, top_p, min_p, seed, position, pmax,
                               parg, pz, pbest, pidx, V, nch, GREEDY_EPS=GREEDY_EPS, BLOCK=block,
                               BLOCK_C=block_c, num_warps=8)
    if filtered:
        if chunk is None or chunk >= V:  # one torch.topk over the row (the faster on an H100, see below)
            wv, wi = torch.topk(logits, min(candidates, V), dim=-1, sorted=True)
            bound = wv[:, -1].float().contiguous() if candidates < V else torch.full((S,), float("-inf"), device=dev)
        else:
            pieces, ln = chunk_layout(V, chunk)
            pieces += V > pieces * ln
            cv, ci, bound = chunk_candidates(logits, triton.cdiv(min(candidates, V), pieces), chunk)
            wv, order = torch.sort(cv, dim=-1, descending=True)
            wi = ci.gather(1, order)
    else:
        wv, wi, bound = pmax, parg, pmax  # never read
    C = wv.shape[1] if filtered else 1
    _finish_kernel[(S,)](temperature, top_k, top_p, min_p, seed, position, pmax, parg, pz, pbest, pidx, wv, wi,
                         bound, out, done, V, nch, C, HAS_WINDOW=filtered, WHOLE_ROW=C == V, GREEDY_EPS=GREEDY_EPS,
                         BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(C), num_warps=4)
