"""Per-slot logit penalties on the device: two Triton launches, no host sync, graph-capturable.

Computes :func:`kernels.penalties_ref.apply_penalties_ref` (the rule and the tables are
documented there):

1. a dense pass, grid ``(rows, cdiv(V, BLOCK))``: repetition, frequency and presence from
   ``output_counts`` / ``prompt_mask``.  Rows whose slot has all three off read nothing but
   their parameters (in place) or copy their logits (out of place).
2. a sparse pass, grid ``(rows,)``: ``logit_bias`` (up to ``MAX_BIAS`` ids per slot, unique)
   and the ``min_tokens`` mask of the slot's stop ids.

Out of place (``out`` a different buffer) keeps the raw logits for logprobs; in place costs
one read and one write less and is what a step without logprobs should use.  A dense row
reads 4 + 4 + 1 bytes per vocab entry and writes 4: at S=64, V=128256 about 74 MB, ~25 us on
an H100 (estimate; ``scripts/bench_kernels.py sampling`` measures it).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .penalties_ref import (MAX_BIAS, MAX_STOP, PenaltyTables, apply_penalties_ref, mark_prompt,  # noqa: F401
                            reset_slots)
from .penalties_ref import count_sampled as count_sampled_ref

__all__ = ["apply_penalties", "PenaltyTables", "count_sampled", "mark_prompt", "reset_slots", "MAX_BIAS",
           "MAX_STOP", "apply_penalties_ref", "count_sampled_ref"]


@triton.jit
def _penalise(x, idx, m, slot, V, counts_ptr, mask_ptr, rep, freq, pres):
    c = tl.load(counts_ptr + slot * V + idx, mask=m, other=0)
    seen_out = c > 0
    seen = seen_out | (tl.load(mask_ptr + slot * V + idx, mask=m, other=0) != 0)
    pen = tl.where(x > 0, tl.math.div_rn(x, tl.zeros_like(x) + rep), x * rep)  # rep == 1: pen == x
    x = tl.where(seen, pen, x)
    return tl.where(seen_out, (x - freq * c.to(tl.float32)) - pres, x)


@triton.jit
def _dense_kernel(x_ptr, stride_x, out_ptr, stride_o, slot_ptr, counts_ptr, mask_ptr, rep_ptr, freq_ptr,
                  pres_ptr, V, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    slot = tl.load(slot_ptr + row).to(tl.int64)
    rep = tl.load(rep_ptr + slot)
    freq = tl.load(freq_ptr + slot)
    pres = tl.load(pres_ptr + slot)
    on = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    src = x_ptr + row.to(tl.int64) * stride_x + idx
    dst = out_ptr + row.to(tl.int64) * stride_o + idx
    if IN_PLACE:
        if on:  # rows without penalties read nothing more
            x = tl.load(src, mask=m, other=0.0).to(tl.float32)
            tl.store(dst, _penalise(x, idx, m, slot, V, counts_ptr, mask_ptr, rep, freq, pres), mask=m)
    else:
        x = tl.load(src, mask=m, other=0.0).to(tl.float32)
        if on:
            x = _penalise(x, idx, m, slot, V, counts_ptr, mask_ptr, rep, freq, pres)
        tl.store(dst, x, mask=m)


@triton.jit
def _sparse_kernel(out_ptr, stride_o, slot_ptr, bias_ids_ptr, bias_val_ptr, stop_ptr, gen_ptr, min_ptr,
                   NB, NS, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    base = out_ptr + row.to(tl.int64) * stride_o
    jb = tl.arange(0, BLOCK_B)
    ids = tl.load(bias_ids_ptr + slot * NB + jb, mask=jb < NB, other=-1)
    ok = ids >= 0
    bias = tl.load(bias_val_ptr + slot * NB + jb, mask=ok, other=0.0)
    cur = tl.load(base + ids, mask=ok, other=0.0)
    tl.store(base + ids, cur + bias, mask=ok)
    if tl.load(gen_ptr + slot) < tl.load(min_ptr + slot):
        js = tl.arange(0, BLOCK_S)
        stop = tl.load(stop_ptr + slot * NS + js, mask=js < NS, other=-1)
        tl.store(base + stop, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=stop >= 0)


@triton.jit
def _count_kernel(slot_ptr, tok_ptr, counts_ptr, gen_ptr, N, V, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    slot = tl.load(slot_ptr + i, mask=m, other=0).to(tl.int64)
    tok = tl.load(tok_ptr + i, mask=m, other=0).to(tl.int64)
    one = tl.full([BLOCK], 1, tl.int32)
    tl.atomic_add(counts_ptr + slot * V + tok, one, mask=m)  # atomics: a slot may repeat (resumed requests)
    tl.atomic_add(gen_ptr + slot, one, mask=m)


def count_sampled(t: PenaltyTables, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """:func:`kernels.penalties_ref.count_sampled` in one launch (``output_counts[slot, token] += 1``,
    ``generated[slot] += 1``; slots and tokens ``[N]`` any integer dtype, repeats allowed)."""
    n = slots.shape[0]
    assert tokens.shape == (n,) and slots.device == tokens.device == t.output_counts.device
    assert t.output_counts.dtype == torch.int32 and t.generated.dtype == torch.int32
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _count_kernel[(triton.cdiv(n, block),)](slots.contiguous(), tokens.contiguous(), t.output_counts,
                                                t.generated, n, t.vocab, BLOCK=block, num_warps=4)


def apply_penalties(logits: torch.Tensor, tables: PenaltyTables, slots: torch.Tensor, *,
                    out: Optional[torch.Tensor] = None, block: int = 4096) -> torch.Tensor:
    """Penalised float32 logits ``[S, V]`` for the rows' ``slots`` ``[S]`` (int32/int64).

    ``out``: a float32 ``[S, V]`` buffer (graph capture), or ``logits`` itself (float32)
    to work in place; default a new tensor.  Same result as ``apply_penalties_ref`` up to
    float contraction (``x - f * c`` may become one FMA on the GPU: 1 ulp).
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [S, V], last dim contiguous"
    S, V = logits.shape
    assert V == tables.vocab, (V, tables.vocab)
    assert slots.shape == (S,) and slots.device == logits.device
    if out is None:
        out = torch.empty(S, V, dtype=torch.float32, device=logits.device)
    assert out.shape == (S, V) and out.dtype == torch.float32 and out.stride(1) == 1
    if S == 0:
        return out
    in_place = out.data_ptr() == logits.data_ptr()
    block = min(block, triton.next_power_of_2(V))
    _dense_kernel[(S, triton.cdiv(V, block))](
        logits, logits.stride(0), out, out.stride(0), slots, tables.output_counts, tables.prompt_mask.view(torch.uint8),
        tables.repetition, tables.frequency, tables.presence, V, IN_PLACE=in_place, BLOCK=block, num_warps=8)
    nb, ns = tables.bias_ids.shape[1], tables.stop_ids.shape[1]
    _sparse_kernel[(S,)](
        out, out.stride(0), slots, tables.bias_ids, tables.bias_values, tables.stop_ids, tables.generated,
        tables.min_tokens, nb, ns, BLOCK_B=triton.next_power_of_2(nb), BLOCK_S=triton.next_power_of_2(ns),
        num_warps=4)
    return out
