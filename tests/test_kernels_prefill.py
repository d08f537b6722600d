"""Paged prefill attention (kernels/prefill_attention.py) against ``prefill_attention_ref``.

GQA packing (one program per query block and KV head, its score rows the block's
(token, head) pairs), the unmasked off-band / masked diagonal split and the work-tile
form, at small shapes: without CUDA in Triton's CPU interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kernels import reference as R  # noqa: E402
from tests.test_kernels import DEV, ON_GPU, make_paged, poison, rel_err, tol  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: padded lanes


def make_case(rows, H, Hkv, D, dtype, block_size, seed):
    """Cache, tables, q and index tensors for rows of ``(cached prefix, new tokens)``."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in rows]
    kc, vc, bt = make_paged(lens, block_size, Hkv, D, dtype, gen=g)
    qlens = [n for _, n in rows]
    starts = [0] + torch.tensor(qlens).cumsum(0).tolist()
    q = torch.randn(starts[-1], H, D, generator=g).to(dtype).to(DEV)
    qs = torch.tensor(starts, dtype=torch.int32, device=DEV)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q, kc, vc, bt, qs, cl, qlens, starts


# (cached prefix, new tokens): prefixes off the BLOCK_N grid, qlen 1, several blocks, an empty row
ROWS = [(0, 20), (37, 5), (10, 1), (0, 1), (3, 0), (1, 33), (70, 9)]

CASES = [
    # dtype, block_size, H, Hkv, D, block_m (None: the kernel's choice), block_n
    (torch.float32, 16, 4, 4, 32, None, None),  # G=1
    (torch.float32, 16, 6, 2, 48, 8, 16),  # G=3 (padding score rows), D not a power of two
    (torch.float32, 32, 8, 2, 64, 8, None),  # G=4, several query blocks per row
    (torch.float32, 16, 8, 2, 128, None, None),
    (torch.bfloat16, 16, 9, 3, 64, None, None),  # SmolLM2's G=3: 42 tokens per block
    (torch.bfloat16, 1, 8, 2, 32, 4, 16),
]


@pytest.mark.parametrize("dtype,block_size,H,Hkv,D,block_m,block_n", CASES)
def test_prefill_attention(dtype, block_size, H, Hkv, D, block_m, block_n):
    from kernels.prefill_attention import prefill_attention

    q, kc, vc, bt, qs, cl, qlens, _ = make_case(ROWS, H, Hkv, D, dtype, block_size, seed=D + H)
    out = poison(torch.empty_like(q))
    prefill_attention(q, kc, vc, bt, qs, cl, max(qlens), D ** -0.5, out=out, block_m=block_m, block_n=block_n)
    assert rel_err(out, R.prefill_attention_ref(q, kc, vc, bt, qs, cl, D ** -0.5)) < tol(dtype)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (8, 2)])
def test_prefill_attention_short_rows(H, Hkv):
    """Decode-like rows (qlen 1..16) with the kernel's own (short) tile."""
    from kernels.prefill_attention import prefill_attention

    rows = [(5, 1), (0, 16), (40, 3), (17, 1), (0, 2)]
    q, kc, vc, bt, qs, cl, qlens, _ = make_case(rows, H, Hkv, 32, torch.float32, 16, seed=H)
    out = poison(torch.empty_like(q))
    prefill_attention(q, kc, vc, bt, qs, cl, max(qlens), 32 ** -0.5, out=out)
    assert rel_err(out, R.prefill_attention_ref(q, kc, vc, bt, qs, cl, 32 ** -0.5)) < 2e-5


@pytest.mark.parametrize("dtype,num_programs,H,Hkv", [(torch.float32, 1, 4, 2), (torch.float32, 3, 6, 2),
                                                      (torch.bfloat16, 8, 8, 2)])
def test_prefill_attention_work_tiles(dtype, num_programs, H, Hkv):
    """The work-tile form computes exactly the listed (row, query block) pairs, whatever the grid."""
    from kernels.prefill_attention import prefill_attention

    D, bm = 32, 8
    rows = [(9, 1), (0, 20), (4, 1), (37, 5), (0, 19), (2, 0), (6, 0)]  # (cached prefix, new tokens)
    listed = [1, 3, 4, 6]  # rows 0, 2: a mixed step's decode rows; 5: padding; 6: empty but listed
    q, kc, vc, bt, qs, cl, qlens, starts = make_case(rows, H, Hkv, D, dtype, 16, seed=num_programs)
    pairs = [(r, b) for r in listed for b in range(max(1, -(-qlens[r] // bm)))]
    pairs.sort(key=lambda p: -(rows[p[0]][0] + (p[1] + 1) * bm))  # longest first, as the planner lists them
    tiles = torch.tensor([len(pairs)] + [x for pair in pairs for x in pair] + [-1] * 6, dtype=torch.int32, device=DEV)
    out = poison(torch.empty_like(q))
    prefill_attention(q, kc, vc, bt, qs, cl, 0, D ** -0.5, out=out, block_m=bm, tiles=tiles,
                      num_programs=num_programs)
    ref = R.prefill_attention_ref(q, kc, vc, bt, qs, cl, D ** -0.5)
    for r in range(len(rows)):
        part = slice(starts[r], starts[r + 1])
        if r in listed:
            assert rel_err(out[part], ref[part]) < tol(dtype), r
        else:
            assert torch.isnan(out[part].float()).all(), r  # never written


def test_tile_tokens():
    """128 score rows for long work, whatever the group (3 leaves 2 padding rows); fewer for short rows."""
    from kernels.prefill_attention import block_rows, tile_tokens

    assert [tile_tokens(g, 2048) for g in (1, 3, 4, 8)] == [128, 42, 32, 16]
    assert tile_tokens(4, 16) == 16 and tile_tokens(4, 1) == 4 and tile_tokens(1, 1) == 16
    assert tile_tokens(3, 5) == 5 and tile_tokens(256, 64) == 1
    assert block_rows(3, 42) == 128 and block_rows(4, 4) == 16 and block_rows(256, 1) == 256


@pytest.mark.skipif(not ON_GPU, reason="large shapes on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_attention_large(dtype):
    from kernels.prefill_attention import prefill_attention

    rows = [(0, 700), (1500, 256), (90, 1), (0, 1), (2048, 33), (13, 129)]
    for H, Hkv, D in ((32, 8, 128), (32, 8, 64), (9, 3, 64)):
        q, kc, vc, bt, qs, cl, qlens, _ = make_case(rows, H, Hkv, D, dtype, 16, seed=D)
        out = poison(torch.empty_like(q))
        prefill_attention(q, kc, vc, bt, qs, cl, max(qlens), D ** -0.5, out=out)
        ref = R.prefill_attention_ref(q, kc, vc, bt, qs, cl, D ** -0.5)
        assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-4), (H, Hkv, D)
