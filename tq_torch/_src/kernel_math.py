"""Small Triton device functions shared by the kernels (rounding, casts, tanh, dots).

Why these exist instead of plain ``x.to(dtype)`` / ``tl.dot``:

* The Triton interpreter (``TRITON_INTERPRET=1``, the CPU CI) truncates fp32 ->
  bfloat16 instead of rounding to nearest even, multiplies bfloat16 dot
  operands as raw uint16 bit patterns, and loses the carry in fp32 -> fp8
  casts (DESIGN.md section 7). Every helper takes an ``INTERPRET`` constexpr
  and, when set, computes the exact GPU result with integer bit arithmetic or
  an fp32 dot over operands already rounded to the compute dtype (products of
  16-bit floats are exact in fp32, so the result is the same).
* The fp8 encode is done in software on every backend: it is a handful of
  integer ops per element in a store kernel and yields exactly the reference's
  round-to-nearest-even, saturate-to-448, NaN-stays-NaN bytes everywhere.
* ``libdevice.tanh`` does not exist in the interpreter; `tanh_f32` is a
  portable, accurate replacement.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp8 e4m3fn: smallest normal 2**-6 (fp32 bit pattern), largest finite 448.
# (Globals read inside @triton.jit must be tl.constexpr on the GPU compiler.)
_FP32_BITS_2_POW_M6 = tl.constexpr(121 << 23)
_FP32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
_FP32_EXP_MASK = tl.constexpr(0x7F800000)


@triton.jit
def round_to_bf16_f32(x, INTERPRET: tl.constexpr):
    """fp32 -> fp32 holding the nearest bfloat16 (ties to even)."""
    if INTERPRET:
        u = x.to(tl.uint32, bitcast=True)
        is_nan = (u & _FP32_ABS_MASK) > _FP32_EXP_MASK
        r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        # A NaN keeps its top half (quieted), like the hardware conversion.
        r = tl.where(is_nan, (u & 0xFFFF0000) | 0x00400000, r)
        return r.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def to_dtype_rne(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` -> ``DTYPE`` (float16/bfloat16/float32), round to nearest even."""
    if DTYPE == tl.bfloat16:
        # After exact rounding the low 16 bits are zero, so the (truncating)
        # interpreter cast is exact.
        return round_to_bf16_f32(x, INTERPRET).to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def dot_operand(x, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 tile -> what `dot` multiplies: DOT_DTYPE on GPU, fp32 holding it in the interpreter."""
    if DOT_DTYPE == tl.float32:
        return x
    elif INTERPRET:
        if DOT_DTYPE == tl.bfloat16:
            return round_to_bf16_f32(x, INTERPRET)
        else:
            return x.to(DOT_DTYPE).to(tl.float32)
    else:
        return x.to(DOT_DTYPE)


@triton.jit
def dot(a, b, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` with fp32 accumulation over operands made by `dot_operand`.

    fp32 operands use IEEE fp32 products (never TF32): fp32 queries ask for
    fp32 accuracy, and the tolerance is derived from IEEE fp32 math.
    """
    if DOT_DTYPE == tl.float32 or INTERPRET:
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def table_lookup(table_ptr, index, INTERPRET: tl.constexpr):
    """``table_ptr[index]`` (fp32) for a small table read through the read-only cache.

    ``index``: int32, non-negative. On the GPU this is an inline load rather
    than `tl.load` so that Triton's software pipeliner does not stage the
    gathered tile through a bank-conflicted shared-memory ring (it pipelines
    every `tl.load` that feeds a dot); a 16-entry table stays in one L1 line
    instead. The address is one unsigned wide multiply-add in the same asm
    (``tl.load(ptr + index)`` sign-extends and shifts: three integer
    instructions per element).
    """
    if INTERPRET:
        return tl.load(table_ptr + index)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b64 a; mad.wide.u32 a, $1, 4, $2; ld.global.nc.f32 $0, [a]; }", "=r,r,l",
            [index, tl.broadcast_to(table_ptr, index.shape)],
            dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def biased_code_operand(codes, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Integer codes ``[BN, D]`` int32 in ``[0, 128)`` -> ``(codes + bias`` as a dot operand, ``bias)``.

    The 16-bit float with bit pattern ``0x4300 | c`` (bfloat16) or ``0x6400 | c``
    (float16) is exactly ``128 + c`` or ``1024 + c``: one OR per element
    instead of an int -> float conversion (I2F issues at a quarter of the
    integer rate). The caller takes ``bias * sum(P * scale)`` back out of
    ``(P * scale) @ (codes + bias)``. fp32 operands are the codes themselves.
    """
    if DOT_DTYPE == tl.bfloat16:
        x = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        bias = 128.0
    elif DOT_DTYPE == tl.float16:
        x = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        bias = 1024.0
    else:
        x = codes.to(tl.float32)
        bias = 0.0
    if INTERPRET:
        x = x.to(tl.float32)  # `dot` takes fp32 tiles holding DOT_DTYPE values there
    return x, bias


@triton.jit
def tanh_f32(x):
    """Accurate fp32 tanh (a few ulp) from exp, odd Taylor series near zero.

    ``1 - 2/(exp(2x)+1)`` cancels badly for small |x|, where the series is
    used instead; both branches are evaluated (elementwise select).
    """
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    # tanh x = x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835 - 1382x^11/155925 + 21844x^13/6081075
    p = 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = ax + ax * x2 * p
    r = tl.where(ax < 0.3, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def fp8_e4m3fn_encode(x):
    """fp32 -> uint8 fp8 e4m3fn bits: saturate to +-448, round to nearest even, NaN -> 0x7F|sign."""
    u = x.to(tl.uint32, bitcast=True)
    sign = ((u >> 31) & 1).to(tl.uint8) << 7
    a = u & _FP32_ABS_MASK
    is_nan = a > _FP32_EXP_MASK
    # Saturate (also +-inf) before rounding: 448 is the largest finite value.
    a = tl.minimum(a, 0x43E00000)  # bits of 448.0; compare as integers, NaN handled apart
    # Normal range: keep 3 mantissa bits, round half to even; the integer add
    # carries into the exponent exactly as the format needs.
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormal range (|x| < 2**-6): the code is |x| / 2**-9 rounded half to
    # even; 8 lands on the smallest normal, whose code is also 8.
    # floor/fraction are exact in fp32 here, so this is an exact rint.
    mag = a.to(tl.float32, bitcast=True) * 512.0
    fl = tl.floor(mag)
    frac = mag - fl
    sub = fl.to(tl.uint32)
    sub = sub + ((frac > 0.5) | ((frac == 0.5) & ((sub & 1) == 1))).to(tl.uint32)
    code = tl.where(a < _FP32_BITS_2_POW_M6, sub, normal)
    code = tl.where(is_nan, 0x7F, code)
    return code.to(tl.uint8) | sign
