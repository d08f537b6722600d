"""The decode step's small kernels (kernels/decode_rows.py, kernels/argmax.py) against their torch statements.

Without CUDA they run in Triton's CPU interpreter (set before any kernel module is imported).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kernels import reference as R  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("block_size,max_blocks", [(16, 5), (1, 1100), (32, 3)])
def test_decode_rows(block_size, max_blocks):
    """One launch gives exactly the torch statements' rows: tokens, KV indices (-1 on the padding
    slot), int32 lengths and query starts, and whole block-table rows (longer than one copy chunk)."""
    from kernels.decode_rows import decode_rows

    g = torch.Generator().manual_seed(7)
    num_slots = 6
    table = torch.randint(0, 10_000, (num_slots + 1, max_blocks), generator=g, dtype=torch.int32).to(DEV)
    last = torch.randint(0, 50_000, (num_slots + 1,), generator=g).to(DEV)
    slots = torch.tensor([3, 0, num_slots, 5, num_slots], device=DEV)  # the padding slot twice
    positions = torch.randint(0, max_blocks * block_size, (5,), generator=g).to(DEV)
    positions[[2, 4]] = 0
    ctx = positions + 1
    got = decode_rows(slots, positions, ctx, last, table, num_slots, block_size)
    want = R.decode_rows_ref(slots, positions, ctx, last, table, num_slots, block_size)
    for name, a, b in zip(want._fields, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.kv_index[[2, 4]].tolist() == [-1, -1]


@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 2048), (32, 4099)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows(rows, vocab, dtype):
    """The two-launch argmax is torch.argmax: first index on ties (across chunks too), NaN the largest,
    a row of -inf gives 0."""
    from kernels.argmax import argmax_rows

    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    x[0, [vocab - 1, 7, 2100 % vocab]] = 50.0  # a tie: the first index wins
    if rows > 2:
        x[1] = float("-inf")
        x[2, [9, 3000 % vocab]] = float("nan")
    x = x.to(DEV)
    assert argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()
    last = torch.full((rows + 5,), -1, dtype=torch.int64, device=DEV)  # the decode step's feedback table
    slots = torch.randperm(rows + 5, generator=g)[:rows].to(DEV)
    tokens = argmax_rows(x, last, slots)
    want = torch.full_like(last, -1)
    want[slots] = torch.argmax(x, dim=-1)
    assert tokens.tolist() == torch.argmax(x, dim=-1).tolist() and last.tolist() == want.tolist()


@pytest.mark.parametrize("config,m", [(("row", 8, 512, 4, 4), 1), (("row", 4, 256, 4, 6), 3), (("rowk", 8, 256, 4, 4), 5),
                                      (("dot", 16, 256, 4, 4), 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_float_out_is_rounded_linear(config, m, dtype):
    """The LM head's one launch: float32 logits, the float32 sums unrounded (float32 x: the GEMV's output)."""
    from kernels.gemv import gemv

    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, 96, generator=g).to(dtype).to(DEV)
    w = torch.randn(300, 96, generator=g).to(dtype).to(DEV)
    out = torch.empty(m, 300, dtype=torch.float32, device=DEV)
    gemv(x, w, config=config, out=out)
    if dtype == torch.float32:
        assert torch.equal(out, gemv(x, w, config=config))
    else:  # within float32 summation error of the exact products, not bf16's rounding
        ref = x.double() @ w.double().T
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_matmul_float_out_is_rounded_linear(dtype):
    """The LM head at larger batches: float32 logits from the tiled matmul equal its model-dtype output, cast."""
    from kernels.matmul import MatmulConfig, invariant_matmul

    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 64, generator=g).to(dtype).to(DEV)
    w = torch.randn(200, 64, generator=g).to(dtype).to(DEV)
    cfg = MatmulConfig(64, 32, 4, 2, 1)
    out = torch.empty(12, 200, dtype=torch.float32, device=DEV)
    invariant_matmul(x, w, config=cfg, out=out)
    if dtype == torch.float32:
        assert torch.equal(out, invariant_matmul(x, w, config=cfg))
    else:
        ref = x.double() @ w.double().T
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
