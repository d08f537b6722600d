"""The interpreter's ``tl.dot`` sums in one fixed order, whatever the host's BLAS.

Under TRITON_INTERPRET=1 Triton's own ``tl.dot`` is ``np.matmul``, and OpenBLAS chooses its kernels (so its
summation order) by CPU, shape and stride: the bit-exact checks of the kernel tests held on one CPU and failed on
another.  :mod:`kernels.interpreter_patch` replaces it with :func:`fixed_order_matmul`; these tests pin that
order down and show that it is still an order (a check that compares bits notices when it changes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.interpreter_patch import fixed_order_matmul

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(CUDA, reason="the interpreter's tl.dot: CPU only")


def operands(m: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_a_row_depends_on_its_own_operands_only(k):
    """The same bits for a row alone, in a batch, beside other data, from a transposed copy; close to float64."""
    a, b = operands(16, k, 24)
    full = fixed_order_matmul(a, b, np.float32)
    other = a.copy()
    other[1:] = np.random.default_rng(1).standard_normal((15, k))
    bt = np.ascontiguousarray(b.T).T  # the same values, column-major
    for got in (fixed_order_matmul(a[:1], b, np.float32)[0], fixed_order_matmul(other, b, np.float32)[0],
                fixed_order_matmul(a, bt, np.float32)[0], fixed_order_matmul(a[None], b[None], np.float32)[0, 0]):
        assert np.array_equal(got, full[0])
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(full - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("k", [64, 300])
def test_the_order_is_an_order(k):
    """Summing the same products in another order changes some bits: the bit-exact tests can fail."""
    a, b = operands(16, k, 24)
    assert not np.array_equal(fixed_order_matmul(a, b, np.float32),
                              fixed_order_matmul(a, b, np.float32, sequential=True))


def test_interpreted_dot_is_the_fixed_order():
    """A kernel's ``tl.dot`` (plus its accumulator) gives exactly :func:`fixed_order_matmul`'s bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        acc = tl.load(c_ptr + rm[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b, acc))

    a, b = operands(16, 64, 32)
    acc = np.random.default_rng(2).standard_normal((16, 32)).astype(np.float32)
    c = torch.from_numpy(acc.copy())
    dot_kernel[(1,)](torch.from_numpy(a), torch.from_numpy(b), c, 16, 64, 32)
    assert np.array_equal(c.numpy(), fixed_order_matmul(a, b, np.float32) + acc)
