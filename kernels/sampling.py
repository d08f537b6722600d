"""Sampling on the device: one Triton launch, no host sync, capturable in a CUDA graph.

Computes exactly the function documented in :mod:`kernels.sampling_ref` (greedy /
temperature / top-k / top-p / min-p, Gumbel-max with the counter-based lowbias32
hash), without sorting.  One program per row streams the row's logits in
``BLOCK``-wide chunks:

1. pass A: max/min and first-index argmax of the raw logits.  Greedy rows stop
   here.  ``s = x * div_rn(1, T)`` is the same float32 as the reference's.
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
reference (``-0.0`` and ``+0.0`` count as tied).  The random numbers are bit-identical to the reference's; the token
can differ only when a top-p boundary mass or two Gumbel scores agree to within
float rounding (different summation orders / libm ``exp``/``log``), which the
tests' random logits never hit.

Cost (H100, S=64, V=128256, docs/kernels.md): greedy 33 us, temperature/min-p
~100 us, top-k ~1.0 ms, top-p ~1.6 ms, both ~2.1 ms (torch sort-based reference:
2.7 ms).  One program per row uses at most S of the SMs, and every search pass
re-reads the row; splitting rows over several programs (one launch per pass, or
compacting the few candidates left after the first pass and sorting them with
``tl.sort``) is the known next step.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _compat  # noqa: F401  (interpreter fixes)
from .sampling_ref import GREEDY_EPS, hash_uniform, sample as sample_ref  # noqa: F401

__all__ = ["sample", "hash_uniform_triton", "sample_ref", "hash_uniform"]


@triton.jit
def _mix32(x):
    # lowbias32 on uint32 (wrapping multiplies); see sampling_ref.mix32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _row_key(seed, pos):
    k = _mix32(seed.to(tl.uint32) ^ 0x243F6A88)
    k = _mix32(k ^ (seed >> 32).to(tl.uint32))
    k = _mix32(k ^ pos.to(tl.uint32))
    k = _mix32(k ^ (pos >> 32).to(tl.uint32))
    return k


@triton.jit
def _uniform(idx, k):
    h = _mix32(_mix32(idx.to(tl.uint32) ^ 0x6A09E667) ^ k)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


@triton.jit
def _okey(s):
    # float32 -> int32 whose signed order is the float order (-0.0 folded into +0.0,
    # so that key order and float comparison agree on ties)
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


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
            hit = (_okey(s)[:, None] >= cand[None, :]) & m[:, None]
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
    logits_ptr, stride_row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, out_ptr, V,
    GREEDY_EPS: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr, NC: tl.constexpr,
):
    row = tl.program_id(0)
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
        kmax = _okey(smax).to(tl.int64)
        thr = _okey(smin).to(tl.int64)
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
                w = tl.where(m & (_okey(s) >= thr), tl.exp(s - smax), 0.0)
                zacc += w.to(tl.float64)
            z = tl.sum(zacc, axis=0)
            thr = _search(base, V, inv_t, smax, thr, kmax, top_p.to(tl.float64) * z, SBLOCK, NC, True)
        log_mp = tl.where(min_p > 0, tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))

        k = _row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
        vbest = tl.full([BLOCK], float("-inf"), tl.float32)
        vbi = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            m = idx < V
            s = tl.load(base + idx, mask=m, other=0.0).to(tl.float32) * inv_t
            keep = m & (_okey(s) >= thr) & ((s - smax) >= log_mp)
            u = _uniform(idx, k)
            sc = tl.where(keep, s - tl.log(-tl.log(u)), float("-inf"))
            upd = sc > vbest
            vbi = tl.where(upd, idx, vbi)
            vbest = tl.where(upd, sc, vbest)
        best = tl.max(vbest, axis=0)
        besti = tl.min(tl.where(vbest == best, vbi, 2147483647), axis=0)
        besti = tl.where(best == float("-inf"), 0, besti)
        tl.store(out_ptr + row, besti.to(tl.int64))


@triton.jit
def _hash_kernel(seed_ptr, pos_ptr, out_ptr, V, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k = _row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    tl.store(out_ptr + row.to(tl.int64) * stride_o + idx, _uniform(idx, k), mask=idx < V)


def hash_uniform_triton(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's uniforms ``[S, V]`` (for tests: must equal :func:`hash_uniform` bit for bit)."""
    S = seed.shape[0]
    out = torch.empty(S, vocab, dtype=torch.float32, device=seed.device)
    block = min(1024, triton.next_power_of_2(vocab))
    if S:
        _hash_kernel[(S, triton.cdiv(vocab, block))](seed, position, out, vocab, out.stride(0), BLOCK=block)
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, *,
           out: Optional[torch.Tensor] = None, block: Optional[int] = None, sblock: Optional[int] = None,
           nc: int = 8, num_warps: Optional[int] = None, num_stages: int = 3) -> torch.Tensor:
    """Tokens ``[S]`` int64; same arguments and result as :func:`kernels.sampling_ref.sample`.

    logits ``[S, V]`` float32/bf16/fp16 (last dim contiguous), temperature/top_p/min_p
    ``[S]`` float32, top_k ``[S]`` int32/int64 (0 = off), seed/position ``[S]`` int64, all
    on one device.  ``out`` may be preallocated (graph capture).  ``block`` is the chunk
    width of the streaming passes, ``sblock``/``nc`` the chunk width and candidates per
    pass of the threshold searches (tuning knobs; the result does not depend on them).
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [S, V], last dim contiguous"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    S, V = logits.shape
    assert 0 < V < 2**31
    for name, t, dts in (("temperature", temperature, (torch.float32,)), ("top_p", top_p, (torch.float32,)),
                         ("min_p", min_p, (torch.float32,)), ("top_k", top_k, (torch.int32, torch.int64)),
                         ("seed", seed, (torch.int64,)), ("position", position, (torch.int64,))):
        assert t.shape == (S,) and t.dtype in dts and t.device == logits.device, (name, t.shape, t.dtype)
        assert t.is_contiguous(), name
    assert nc >= 2 and nc & (nc - 1) == 0
    if out is None:
        out = torch.empty(S, dtype=torch.int64, device=logits.device)
    assert out.shape == (S,) and out.dtype == torch.int64
    if S == 0:
        return out
    block = block or min(4096, triton.next_power_of_2(V))
    sblock = sblock or min(2048 if nc <= 8 else 512, triton.next_power_of_2(V))  # H100 sweep
    _sample_kernel[(S,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seed, position, out, V,
        GREEDY_EPS=GREEDY_EPS, BLOCK=block, SBLOCK=sblock, NC=nc, num_warps=num_warps or 8,
        num_stages=num_stages,
    )
    return out
