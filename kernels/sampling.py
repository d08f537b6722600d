"""Sampling on the device: no host sync, capturable in a CUDA graph.

Computes exactly the function documented in :mod:`kernels.sampling_ref` (greedy /
temperature / top-k / top-p / min-p, Gumbel-max with the counter-based lowbias32
hash).  :func:`sample` runs the fast path of :mod:`kernels.sampling_select` (rows split
over many programs; top-k/top-p thresholds from a histogram cut and a compacted window, ordered by ranks,
of each row's candidates; no ``torch.topk``), then the one-program-per-row kernel below, which
does real work only for the rows the window could not finish exactly (top_k or a nucleus wider
than the window's ``capacity``).  ``method="window"`` is the previous fast path
(:mod:`kernels.sampling_window`, a ``torch.topk`` window: slower at every measured shape);
``method="rows"`` runs the row kernel alone.  The caller's host-side flags pick the cheapest
path: ``greedy_only`` (argmax), ``filtered=False`` (no histogram or window).

The row kernel streams the row's logits in ``BLOCK``-wide chunks:

1. pass A: max/min and first-index argmax of the raw logits.  Greedy rows
   stop here.  ``s = x * div_rn(1, T)`` is the same float32 as the reference's.
2. top-k (if on): the threshold is the ``k``-th largest ``s``, found as the largest
   order-preserving integer key ``t`` (float bits, negative ones flipped) with
   ``count(key >= t) >= k``; an ``NC``-ary search over the key range
   ``[key(min), key(max)]``, ``NC - 1`` candidate keys per pass over the row, so
   ``ceil(32 / log2(NC))`` passes at most and fewer when the range is narrow.
3. top-p (if on): one pass for ``Z`` = the top-k survivors' mass
   ``sum exp(s - max)`` (float32 terms, float64 sums), then the same search for
   the largest key ``t`` with ``mass(key >= t) >= top_p * Z``.  Keeping
   ``key >= t`` is the reference's rule "mass strictly above < top_p * Z".
4. final pass: Gumbel-max over ``key >= threshold`` and the min-p cut, with
   first-index tie breaking (scores compared with a strict ``>`` across chunks).

Ties: tied logits are kept or dropped together at both thresholds, like the
reference (``-0.0`` and ``+0.0`` count as tied).  The random numbers are bit-identical to
the reference's; the token can differ only when a top-p boundary mass or two Gumbel
scores agree to within float rounding (different summation orders / libm
``exp``/``log``), which the tests' random logits never hit.

Cost of the row kernel alone (H100, S=64, V=128256, docs/kernels.md): greedy 33 us,
temperature/min-p ~100 us, top-k ~1.0 ms, top-p ~1.6 ms, both ~2.1 ms: one program per
row uses at most S of the SMs, and every search pass re-reads the row.
``scripts/bench_kernels.py sampling`` compares it with the default path.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .sampling_hash import hash_uniform_triton, tl_okey, tl_row_key, tl_uniform
from .sampling_ref import GREEDY_EPS, hash_uniform, sample as sample_ref  # noqa: F401
from .sampling_select import DEFAULT_CAPACITY, sample_select
from .sampling_window import DEFAULT_CANDIDATES, sample_window

__all__ = ["sample", "hash_uniform_triton", "sample_ref", "hash_uniform"]


@triton.jit
def _search(base, V, inv_t, smax, lo, hi, target,
            SBLOCK: tl.constexpr, NC: tl.constexpr, MASS: tl.constexpr):
    """Largest key t in [lo, hi] with F(key >= t) >= target (F = count or exp-mass).

    Invariant: F(key >= lo) >= target and F(key >= hi + 1) < target.  Each pass
    accumulates per lane ([SBLOCK, NC] registers) and reduces once at its end.
    """
    offs = tl.arange(0, SBLOCK)
    jj = tl.arange(0, NC).to(tl.int64)
    while lo < hi:
        step = (hi - lo + NC) // NC  # cdiv(width, NC), width = hi - lo + 1
        cand64 = lo + jj * step
        valid = cand64 <= hi
        cand = tl.minimum(cand64, hi).to(tl.int32)
        if MASS:
            acc = tl.zeros([SBLOCK, NC], tl.float64)
        else:
            acc = tl.zeros([SBLOCK, NC], tl.int32)
        for start in range(0, V, SBLOCK):
            idx = start + offs
            m = idx < V
            x = tl.load(base + idx, mask=m, other=0.0).to(tl.float32)
            s = x * inv_t
            hit = (tl_okey(s)[:, None] >= cand[None, :]) & m[:, None]
            if MASS:
                w = tl.exp(s - smax).to(tl.float64)
                acc += tl.where(hit, w[:, None], 0.0)
            else:
                acc += hit.to(tl.int32)
        tot = tl.sum(acc, axis=0).to(tl.float64)
        ok = (tot >= target) & valid
        jb = tl.max(tl.where(ok, jj, 0), axis=0)
        new_lo = lo + jb * step
        hi = tl.minimum(new_lo + step - 1, hi)
        lo = new_lo
    return lo


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, out_ptr, done_ptr, V,
    GREEDY_EPS: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr, NC: tl.constexpr, HAS_DONE: tl.constexpr,
):
    row = tl.program_id(0)
    if HAS_DONE:  # rows the window pass finished exactly cost one load here
        todo = tl.load(done_ptr + row) == 0
    else:
        todo = tl.full((), 1, tl.int1)
    if todo:
        _sample_row(row, logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr,
                    out_ptr, V, GREEDY_EPS, BLOCK, SBLOCK, NC)


@triton.jit
def _sample_row(row, logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, out_ptr, V,
                GREEDY_EPS: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr, NC: tl.constexpr):
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    greedy = temp < GREEDY_EPS
    inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.where(greedy, 1.0, temp))

    # pass A: max, min, first argmax of the raw logits (per lane, reduced at the end;
    # each lane sees increasing indices and keeps its first maximum)
    vmax = tl.full([BLOCK], float("-inf"), tl.float32)
    vmin = tl.full([BLOCK], float("inf"), tl.float32)
    vidx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        m = idx < V
        x = tl.load(base + idx, mask=m, other=float("-inf")).to(tl.float32)
        upd = x > vmax
        vidx = tl.where(upd, idx, vidx)
        vmax = tl.where(upd, x, vmax)
        vmin = tl.minimum(vmin, tl.where(m, x, float("inf")))
    xmax = tl.max(vmax, axis=0)
    xmin = tl.min(vmin, axis=0)
    amax = tl.min(tl.where(vmax == xmax, vidx, 2147483647), axis=0)
    amax = tl.where(xmax == float("-inf"), 0, amax)

    if greedy:
        tl.store(out_ptr + row, amax.to(tl.int64))
    else:
        smax = xmax * inv_t  # == max(s): x -> x * c (c > 0, round-to-nearest) is monotone
        smin = xmin * inv_t
        kmax = tl_okey(smax).to(tl.int64)
        thr = tl_okey(smin).to(tl.int64)
        top_k = tl.load(topk_ptr + row).to(tl.int64)
        top_p = tl.load(topp_ptr + row).to(tl.float32)
        min_p = tl.load(minp_ptr + row).to(tl.float32)
        if (top_k > 0) & (top_k < V):
            thr = _search(base, V, inv_t, smax, thr, kmax, top_k.to(tl.float64), SBLOCK, NC, False)
        if top_p < 1.0:
            zacc = tl.zeros([BLOCK], tl.float64)
            for start in range(0, V, BLOCK):
                idx = start + offs
                m = idx < V
                s = tl.load(base + idx, mask=m, other=0.0).to(tl.float32) * inv_t
                w = tl.where(m & (tl_okey(s) >= thr), tl.exp(s - smax), 0.0)
                zacc += w.to(tl.float64)
            z = tl.sum(zacc, axis=0)
            thr = _search(base, V, inv_t, smax, thr, kmax, top_p.to(tl.float64) * z, SBLOCK, NC, True)
        log_mp = tl.where(min_p > 0, tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))

        k = tl_row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
        vbest = tl.full([BLOCK], float("-inf"), tl.float32)
        vbi = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            m = idx < V
            s = tl.load(base + idx, mask=m, other=0.0).to(tl.float32) * inv_t
            keep = m & (tl_okey(s) >= thr) & ((s - smax) >= log_mp)
            u = tl_uniform(idx, k)
            sc = tl.where(keep, s - tl.log(-tl.log(u)), float("-inf"))
            upd = sc > vbest
            vbi = tl.where(upd, idx, vbi)
            vbest = tl.where(upd, sc, vbest)
        best = tl.max(vbest, axis=0)
        besti = tl.min(tl.where(vbest == best, vbi, 2147483647), axis=0)
        besti = tl.where(best == float("-inf"), 0, besti)
        tl.store(out_ptr + row, besti.to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, *,
           out: Optional[torch.Tensor] = None, method: str = "select", candidates: int = DEFAULT_CANDIDATES,
           capacity: int = DEFAULT_CAPACITY,
           filtered: bool = True, greedy_only: bool = False, chunk: Optional[int] = None,
           block: Optional[int] = None, sblock: Optional[int] = None,
           nc: int = 8, num_warps: Optional[int] = None, num_stages: int = 3) -> torch.Tensor:
    """Tokens ``[S]`` int64; same arguments and result as :func:`kernels.sampling_ref.sample`.

    logits ``[S, V]`` float32/bf16/fp16 (last dim contiguous), temperature/top_p/min_p
    ``[S]`` float32, top_k ``[S]`` int32/int64 (0 = off), seed/position ``[S]`` int64, all
    on one device.  ``out`` may be preallocated (graph capture).

    ``method="select"`` (default): :mod:`kernels.sampling_select` (histogram cut, compacted window
    of at most ``capacity`` logits per row, ordered by ranks), then
    the one-program-per-row kernel only for the rows it could not finish exactly.
    ``method="window"``: :mod:`kernels.sampling_window` (a window of the ``candidates`` largest
    logits by ``torch.topk``; ``chunk`` splits that top-k in two stages).
    ``filtered=False`` is a host-side promise that no row uses top-k/top-p (skips the histogram /
    window: temperature / min-p rows then cost two passes over the logits).  ``greedy_only=True``
    promises every row is greedy: one ``torch.argmax`` (first index on ties, like the reference).
    ``method="rows"``: the one-program-per-row kernel alone (the previous sampler).
    ``block`` is the chunk width of its streaming passes, ``sblock``/``nc`` the chunk width
    and candidates per pass of its threshold searches (tuning knobs; the result does not
    depend on any knob).
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [S, V], last dim contiguous"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert method in ("select", "window", "rows"), method
    S, V = logits.shape
    assert 0 < V < 2**31
    for name, t, dts in (("temperature", temperature, (torch.float32,)), ("top_p", top_p, (torch.float32,)),
                         ("min_p", min_p, (torch.float32,)), ("top_k", top_k, (torch.int32, torch.int64)),
                         ("seed", seed, (torch.int64,)), ("position", position, (torch.int64,))):
        assert t.shape == (S,) and t.dtype in dts and t.device == logits.device, (name, t.shape, t.dtype)
        assert t.is_contiguous(), name
    assert nc >= 2 and nc & (nc - 1) == 0 and candidates >= 1
    if out is None:
        out = torch.empty(S, dtype=torch.int64, device=logits.device)
    assert out.shape == (S,) and out.dtype == torch.int64
    if S == 0:
        return out
    if greedy_only:
        return torch.argmax(logits, dim=-1, out=out)
    done = out  # not read when HAS_DONE is off
    if method == "select":
        done = torch.empty(S, dtype=torch.int32, device=logits.device)
        sample_select(logits, temperature, top_k, top_p, min_p, seed, position, out, done,
                      capacity=capacity, filtered=filtered)
    elif method == "window":
        done = torch.empty(S, dtype=torch.int32, device=logits.device)
        sample_window(logits, temperature, top_k, top_p, min_p, seed, position, out, done,
                      candidates=candidates, filtered=filtered, chunk=chunk)
    block = block or min(4096, triton.next_power_of_2(V))
    sblock = sblock or min(2048 if nc <= 8 else 512, triton.next_power_of_2(V))  # H100 sweep
    _sample_kernel[(S,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seed, position, out, done, V,
        GREEDY_EPS=GREEDY_EPS, BLOCK=block, SBLOCK=sblock, NC=nc, HAS_DONE=method != "rows",
        num_warps=num_warps or 8, num_stages=num_stages,
    )
    return out
