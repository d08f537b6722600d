"""The grouped MoE form's pairs grouped by expert, in one launch.

:func:`kernels.moe_ref.align_by_expert_ref` in torch is about fifteen launches (a scatter-add histogram, two
cumulative sums, a stable radix sort, gathers, a scatter and a search): 68 us a layer of Qwen3-30B-A3B's 64-row
decode step on an H200, a fifth of the layer beside experts read at 4 TB/s.  Here one program holds every pair
(``T * k``, at most ``CHUNK_TOKENS * k``) in registers:

1. the histogram of the pairs' experts, each expert's group padded to a multiple of ``BLOCK_M``, and for each
   expert the padding slots of the groups before it (an exclusive cumulative sum);
2. the pairs sorted by (expert, pair index): the i-th of them goes to slot i plus its expert's padding before
   it, so within a group the pairs keep their order (the reference's stable sort);
3. a group's block starts at a slot that holds a pair, whose expert is the block's.

Every slot is first written as padding and every block as past the last group (expert ``num_experts``), then
the pairs over them: one program, so a block-wide barrier orders the two.  An id of ``num_experts`` (a pair
whose expert another rank holds) sorts last and is written nowhere, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_ref import align_blocks, align_by_expert_ref
from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["align_by_expert", "MAX_EXPERTS", "MAX_PAIRS"]

MAX_EXPERTS = 1024
# Above this many pairs the torch form is faster (the one program's sort grows as n log^2 n): on an H200 with
# 128 experts, 3.7 / 6.2 / 20.6 / 78 / 184 us at 512 / 1,024 / 2,048 / 4,096 / 8,192 pairs, torch's 74-129 us.
MAX_PAIRS = 4096
FILL = tl.constexpr(1024)  # slots written per step of the padding fill


@triton.jit
def _align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, shift_ptr, n, E, num_blocks, BLOCK_M: tl.constexpr,
                  E_PAD: tl.constexpr, N_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # the routing before it wrote the ids (and nothing is stored before it)
    fill = tl.arange(0, FILL)
    for s0 in range(0, num_blocks * BLOCK_M, FILL):
        tl.store(pairs_ptr + s0 + fill, tl.full([FILL], 0, tl.int32) + n, mask=s0 + fill < num_blocks * BLOCK_M)
    for b0 in range(0, num_blocks, FILL):
        tl.store(block_expert_ptr + b0 + fill, tl.full([FILL], 0, tl.int32) + E, mask=b0 + fill < num_blocks)
    p = tl.arange(0, N_PAD)
    e = tl.load(ids_ptr + p, mask=p < n, other=E).to(tl.int32)
    e = tl.minimum(e, E)  # E: held elsewhere (and the padding of N_PAD); E < E_PAD
    pdl_launch(USE_PDL)
    experts = tl.arange(0, E_PAD)
    counts = tl.where(experts < E, tl.histogram(e, E_PAD), 0)
    spare = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M - counts
    tl.store(shift_ptr + experts, tl.cumsum(spare, axis=0) - spare)
    keys = tl.sort(e * N_PAD + p)
    sorted_e, sorted_p = keys // N_PAD, keys % N_PAD
    tl.debug_barrier()  # the padding and the shifts written
    here = sorted_e < E
    slot = p + tl.load(shift_ptr + sorted_e, mask=here, other=0)
    tl.store(pairs_ptr + slot, sorted_p, mask=here)
    tl.store(block_expert_ptr + slot // BLOCK_M, sorted_e, mask=here & (slot % BLOCK_M == 0))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``p = t * k + j`` of ``ids [T, k]`` grouped by expert, each group padded to ``block_m``:
    ``(pairs [num_blocks * block_m] int32, pair index or T * k for padding; block_expert [num_blocks] int32,
    each block's expert or num_experts past the last group)``.  Within a group, pairs keep their order.

    ``num_blocks`` covers the worst case (every used expert's group one short of a block), from the shapes
    alone; one launch, no host read (above ``MAX_PAIRS`` pairs or ``MAX_EXPERTS`` experts, the torch form's
    launches).  An id of ``num_experts`` (a pair whose expert another rank holds) joins no group.
    """
    flat = ids.reshape(-1)
    n = flat.numel()
    if n > MAX_PAIRS or num_experts > MAX_EXPERTS:
        return align_by_expert_ref(ids, num_experts, block_m)
    num_blocks = align_blocks(n, num_experts, block_m)
    pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    if n:
        e_pad = triton.next_power_of_2(num_experts + 1)
        shift = torch.empty(e_pad, dtype=torch.int32, device=ids.device)
        _align_kernel[(1,)](flat, pairs, block_expert, shift, n, num_experts, num_blocks, BLOCK_M=block_m,
                            E_PAD=e_pad, N_PAD=triton.next_power_of_2(n), num_warps=8, **pdl_args(flat))
    return pairs, block_expert
