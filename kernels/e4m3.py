"""float32 to e4m3 (``float8_e4m3fn``) rounded once to nearest even, as torch's cast rounds.

Triton narrows float32 to e4m3 through float16 on Hopper, rounding twice: a value that float16 rounds onto the
midpoint of two e4m3 values then goes to the even one, about 0.3% of uniformly spread values off by one e4m3 step
from torch's cast.  :func:`to_e4m3` rounds in float32 to e4m3's grid first (an add and a subtract of a constant
whose last bit is that grid's step), so the narrowing that follows is exact.  The interpreter, which rounds ties
away from zero and flushes subnormals, then also gives torch's values.
"""

import triton
import triton.language as tl


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
