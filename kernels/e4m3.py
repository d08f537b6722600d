"""float32 to e4m3 (``float8_e4m3fn``) rounded once to nearest even, as torch's cast rounds; and a row's dynamic
scale (:func:`row_scale`, :func:`scaled_to_e4m3`: :func:`kernels.fp8.quantize_rows_ref`'s arithmetic, shared by
every kernel that quantizes activations).

Triton narrows float32 to e4m3 through float16 on Hopper, rounding twice: a value that float16 rounds onto the
midpoint of two e4m3 values then goes to the even one, about 0.3% of uniformly spread values off by one e4m3 step
from torch's cast.  :func:`to_e4m3` rounds in float32 to e4m3's grid first (an add and a subtract of a constant
whose last bit is that grid's step), so the narrowing that follows is exact.  The interpreter, which rounds ties
away from zero and flushes subnormals, then also gives torch's values.
"""

import triton
import triton.language as tl

from .fp8 import FP8_MAX, MIN_SCALE

_MAX = tl.constexpr(FP8_MAX)
_MIN = tl.constexpr(MIN_SCALE)


@triton.jit
def to_e4m3(x):
    """``x`` (float32, within e4m3's +-448) as e4m3, rounded to nearest even."""
    biased = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # e4m3's step at |x|: 2^(e - 3) for an exponent e >= -6 (3 mantissa bits), 2^-9 below (subnormals)
    step = tl.maximum(biased - 127 - 3, -9)
    # 1.5 * 2^(step + 23): adding it leaves |x| rounded to a multiple of 2^step (float32's rounding, to even)
    magic = (((step + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic
    return tl.where(x < 0, -r, r).to(tl.float8e4nv)


@triton.jit
def row_scale(amax):
    """A row's scale from its largest magnitude (float32): ``max(amax / 448, MIN_SCALE)``."""
    return tl.maximum(tl.math.div_rn(amax, _MAX), _MIN)


@triton.jit
def scaled_to_e4m3(x, scale):
    """``x / scale`` (float32) clamped to e4m3's range, as e4m3."""
    return to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_MAX), _MAX))
