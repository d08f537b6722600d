"""float32 to e4m3 (``float8_e4m3fn``) rounded once to nearest even, as torch's cast rounds; and a row's dynamic
scale (:func:`row_scale`, :func:`scaled_to_e4m3`: :func:`kernels.fp8.quantize_rows_ref`'s arithmetic, shared by
every kernel that quantizes activations: the values times the scale's reciprocal, as vLLM's quantization does).

Triton narrows float32 to e4m3 through float16 on Hopper, rounding twice: a value that float16 rounds onto the
midpoint of two e4m3 values then goes to the even one, about 0.3% of uniformly spread values off by one e4m3 step
from torch's cast.  Compiled, :func:`to_e4m3` first rounds to odd at float16's precision, after which both of
those roundings land where one would; in the interpreter, which rounds ties away from zero and flushes subnormals,
it rounds in float32 to e4m3's grid first (an add and a subtract of a constant whose last bit is that grid's step),
so that the narrowing that follows is exact.
"""

import triton
import triton.language as tl

from .fp8 import FP8_MAX, MIN_SCALE

_MAX = tl.constexpr(FP8_MAX)
_MIN = tl.constexpr(MIN_SCALE)


@triton.jit
def _to_e4m3_exact(x):
    """:func:`to_e4m3` by float32 arithmetic alone: exact wherever the final narrowing is (the interpreter's)."""
    biased = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # e4m3's step at |x|: 2^(e - 3) for an exponent e >= -6 (3 mantissa bits), 2^-9 below (subnormals)
    step = tl.maximum(biased - 127 - 3, -9)
    # 1.5 * 2^(step + 23): adding it leaves |x| rounded to a multiple of 2^step (float32's rounding, to even)
    magic = (((step + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic
    return tl.where(x < 0, -r, r).to(tl.float8e4nv)


@triton.jit
def _to_e4m3_odd(x):
    """:func:`to_e4m3` on a GPU: ``x`` rounded to odd at float16's precision (the 13 bits float16 lacks dropped, the
    last kept one set where any of them was), which float16 then holds exactly; from there the narrowing's roundings
    (float16's, e4m3's) land where one rounding to nearest even would, float16 keeping 7 bits more than e4m3.  Half
    the instructions of the float32 form: the FP8 SiLU-mul at [2048, 2 x 14336] on an H200 in 54 against 60 us."""
    bits = x.to(tl.uint32, bitcast=True)
    odd = ((bits >> 13) | ((bits & 0x1FFF) != 0).to(tl.uint32)) << 13
    return odd.to(tl.float32, bitcast=True).to(tl.float8e4nv)


# Whether these kernels run in Triton's interpreter (decided, as Triton decides it, when a function is decorated).
_INTERPRETED = tl.constexpr(not isinstance(_to_e4m3_exact, triton.runtime.JITFunction))


@triton.jit
def to_e4m3(x):
    """``x`` (float32, within e4m3's +-448) as e4m3, rounded to nearest even."""
    if _INTERPRETED:
        return _to_e4m3_exact(x)
    else:
        return _to_e4m3_odd(x)


@triton.jit
def row_scale(amax):
    """A row's scale from its largest magnitude (float32): ``max(amax / 448, MIN_SCALE)``."""
    return tl.maximum(tl.math.div_rn(amax, _MAX), _MIN)


@triton.jit
def scaled_to_e4m3(x, scale):
    """``x * (1 / scale)`` (float32; the reciprocal rounded once) clamped to e4m3's range, as e4m3.  A multiply
    where a division was: an IEEE division per value made the FP8 SiLU-mul compute-bound (81 us at
    [2048, 2 x 14336] on an H200, 60 with the multiply)."""
    inv = tl.math.div_rn(1.0, scale)
    return to_e4m3(tl.minimum(tl.maximum(x * inv, -_MAX), _MAX))


@triton.jit
def _pairs_to_f16_ops(words):
    lo = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = (words >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def _pairs_to_f16_asm(words):
    # two words a register: one byte permute gathers the two low bytes and the two high bytes, then one conversion
    # of each pair (instead of a mask, a shift and a narrowing per value: the FP8 decode loop 1,144 -> 697
    # instructions a warp)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 l, h; prmt.b32 t, $2, 0, 0x3120; mov.b32 {l, h}, t;"
        " cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
        "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def e4m3_pair_to_f16(words):
    """16-bit words of two e4m3 values each (little-endian: the first value in the low byte) as float16 (exact):
    (the low bytes' values, the high bytes' values)."""
    if _INTERPRETED:
        return _pairs_to_f16_ops(words)
    else:
        return _pairs_to_f16_asm(words)
