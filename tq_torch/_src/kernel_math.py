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

from tq_gluon.decode import LANE_ENTRY_SQUARES_PTX

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
def dot(a, b, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, acc=None):
    """``acc + a @ b`` (``acc`` None: ``a @ b``) with fp32 accumulation over operands made by `dot_operand`.

    fp32 operands use IEEE fp32 products (never TF32): fp32 queries ask for
    fp32 accuracy, and the tolerance is derived from IEEE fp32 math. An
    ``acc [M, N]`` fp32 is the tensor cores' accumulator input: no separate add.
    """
    if DOT_DTYPE == tl.float32 or INTERPRET:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


# `_lane_entry`'s PTX: $1 table pointer, $2 lane mask (SIZE - 1), $3 square scale.
_LANE_ENTRY_F32 = tl.constexpr(
    "{ .reg .u32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, $2; mad.wide.u32 a, l, 4, $1; "
    "ld.global.nc.f32 $0, [a]; }")
_LANE_ENTRY_BF16_SQUARES = tl.constexpr(LANE_ENTRY_SQUARES_PTX.replace("CVT", "cvt.rn.bf16.f32"))
_LANE_ENTRY_F16_SQUARES = tl.constexpr(LANE_ENTRY_SQUARES_PTX.replace("CVT", "cvt.rn.f16.f32"))
# `table_lookup_with_squares`' PTX for a pack of two elements: $2, $3 indices, $4, $5 entries.
_SHUFFLE_PAIRS = tl.constexpr(
    "{ .reg .b32 e0, e1; shfl.sync.idx.b32 e0, $4, $2, 0x1f, 0xffffffff; "
    "shfl.sync.idx.b32 e1, $5, $3, 0x1f, 0xffffffff; prmt.b32 $0, e0, e1, 0x5410; prmt.b32 $1, e0, e1, 0x7632; }")


@triton.jit
def _lane_entry(table_ptr, square_scale, shape, SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                SQUARES: tl.constexpr):
    """This lane's entry of a ``SIZE``-entry fp32 table (lane ``l`` holds entry ``l % SIZE``), as ``shape``.

    ``SQUARES`` False: the bits of the fp32 entry ``c``. True: one 32-bit word with ``DOT_DTYPE(c)``
    in the low and fp16 ``(square_scale * c)**2`` in the high half (the products
    rounded in fp32 first, as `kv_tiles.decode_key_tile` computes them). Every
    element holds the same value from the same operands, so the compiler keeps
    one register and hoists it out of loops.
    """
    ptrs = tl.broadcast_to(table_ptr, shape)
    lane_mask = tl.full(shape, SIZE - 1, tl.int32)
    if not SQUARES:
        entry = tl.inline_asm_elementwise(_LANE_ENTRY_F32, "=r,l,r", [ptrs, lane_mask],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        # As bits: Triton 3.6 will not pass a float operand next to a pointer.
        scale_bits = tl.full(shape, square_scale, tl.float32).to(tl.int32, bitcast=True)
        if DOT_DTYPE == tl.bfloat16:
            entry = tl.inline_asm_elementwise(_LANE_ENTRY_BF16_SQUARES, "=r,l,r,r", [ptrs, lane_mask, scale_bits],
                                              dtype=tl.int32, is_pure=True, pack=1)
        else:
            entry = tl.inline_asm_elementwise(_LANE_ENTRY_F16_SQUARES, "=r,l,r,r", [ptrs, lane_mask, scale_bits],
                                              dtype=tl.int32, is_pure=True, pack=1)
    return entry


@triton.jit
def table_lookup(table_ptr, index, SIZE: tl.constexpr, INTERPRET: tl.constexpr):
    """``table_ptr[index]`` (fp32) for a table of ``SIZE`` <= 32 entries (a power of two).

    ``index``: int32 in ``[0, SIZE)``; on the GPU only its low ``log2(SIZE)`` bits are
    read, so higher bits may hold anything (`kv_tiles.decode_field` with ``CLEAN``
    False). On the GPU each lane holds one table
    entry in a register and an element is one warp shuffle from the lane its
    index names: no address math and no memory access per element. (Earlier a
    per-element load through the read-only cache cost a 64-bit address, two
    instructions, plus the load; a `tl.load` gather is also what Triton's
    pipeliner staged through a bank-conflicted shared-memory ring.)
    """
    if INTERPRET:
        return tl.load(table_ptr + index)
    else:
        entry = _lane_entry(table_ptr, 1.0, index.shape, SIZE, tl.float32, False)
        return tl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $2, $1, 0x1f, 0xffffffff;", "=r,r,r", [index, entry],
            dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def table_lookup_with_squares(table_ptr, index, square_scale, SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                              INTERPRET: tl.constexpr):
    """`table_lookup` as two 16-bit dot operands: ``(DOT_DTYPE(c), fp16((square_scale * c)**2))``.

    ``c = table_ptr[index]``; ``DOT_DTYPE`` bfloat16 or float16 (held in fp32 in
    the interpreter, like `dot_operand`). On the GPU both halves come from one
    shuffle of a packed per-lane entry and one byte permute per pair of elements,
    bit for bit what rounding the gathered fp32 ``c`` and its square would give.
    """
    if INTERPRET:
        c = tl.load(table_ptr + index)
        cs = c * square_scale
        return dot_operand(c, DOT_DTYPE, INTERPRET), dot_operand(cs * cs, tl.float16, INTERPRET)
    else:
        entry = _lane_entry(table_ptr, square_scale, index.shape, SIZE, DOT_DTYPE, True)
        # Elements i, i+1 of a pack share a 32-bit output register: the low halves
        # of the two shuffled words make the operand pair, the high halves the squares.
        if DOT_DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(_SHUFFLE_PAIRS, "=r,=r,r,r,r,r", [index, entry],
                                             dtype=(tl.bfloat16, tl.float16), is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_SHUFFLE_PAIRS, "=r,=r,r,r,r,r", [index, entry],
                                             dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


# 16-bit float bit patterns ``BITS | c`` that are exactly ``BIAS + c`` for every 7-bit code ``c``
# (`biased_code_operand`, `biased_nibble_operand`).
_BF16_BIAS_BITS = tl.constexpr(0x4300)  # 128 + c
_F16_BIAS_BITS = tl.constexpr(0x6400)  # 1024 + c


@triton.jit
def _code_bias(DOT_DTYPE: tl.constexpr):
    """The bias of `biased_code_operand`'s operands: 128 (bfloat16), 1024 (float16), 0 (float32)."""
    if DOT_DTYPE == tl.bfloat16:
        return 128.0
    elif DOT_DTYPE == tl.float16:
        return 1024.0
    else:
        return 0.0


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
        x = (codes | _BF16_BIAS_BITS).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DOT_DTYPE == tl.float16:
        x = (codes | _F16_BIAS_BITS).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        x = codes.to(tl.float32)
    if INTERPRET:
        x = x.to(tl.float32)  # `dot` takes fp32 tiles holding DOT_DTYPE values there
    return x, _code_bias(DOT_DTYPE)


# `biased_nibble_operand`'s PTX for one 16-bit word w = c0 | c1 << 4 | c2 << 8 | c3 << 12 (zero-extended,
# in $2..$5): $0 = 16-bit floats (BIAS + c0, BIAS + c1), $1 = (BIAS + c2, BIAS + c3).
_NIBBLE_PAIRS = (
    "{ .reg .b32 t; shl.b32 t, $2, 12; or.b32 t, t, $2; and.b32 t, t, 0x000F000F; or.b32 $0, t, BIAS; "
    "shr.b32 t, $2, 8; shl.b32 $1, $2, 4; or.b32 t, t, $1; and.b32 t, t, 0x000F000F; or.b32 $1, t, BIAS; }")
_NIBBLE_PAIRS_BF16 = tl.constexpr(_NIBBLE_PAIRS.replace("BIAS", hex(_BF16_BIAS_BITS.value * 0x10001)))
_NIBBLE_PAIRS_F16 = tl.constexpr(_NIBBLE_PAIRS.replace("BIAS", hex(_F16_BIAS_BITS.value * 0x10001)))


@triton.jit
def biased_nibble_operand(words, DOT_DTYPE: tl.constexpr):
    """GPU only. 16-bit words ``[BN, W]`` of 4-bit codes -> (``[BN, 4W]`` ``codes + bias`` in ``DOT_DTYPE``, bias).

    What `biased_code_operand` gives for the codes `kv_tiles.decode_field` unpacks from
    ``words`` (``DOT_DTYPE`` bfloat16 or float16), but two elements at a time: each
    16-bit pair is the word's two nibbles moved into place with one shift, masked
    and ORed with the bias bits, about 1.25 integer instructions per element.
    """
    w = words.to(tl.uint16, bitcast=True).to(tl.int32)
    # Four copies of each word as the four consecutive elements of one asm pack
    # (`tl.join` adds the new axis inside a thread's registers: no data moves).
    BN: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    w2 = tl.reshape(tl.join(w, w), (BN, 2 * W))
    w4 = tl.reshape(tl.join(w2, w2), (BN, 4 * W))
    if DOT_DTYPE == tl.bfloat16:
        x = tl.inline_asm_elementwise(_NIBBLE_PAIRS_BF16, "=r,=r,r,r,r,r", [w4], dtype=tl.bfloat16,
                                      is_pure=True, pack=4)
    else:
        x = tl.inline_asm_elementwise(_NIBBLE_PAIRS_F16, "=r,=r,r,r,r,r", [w4], dtype=tl.float16,
                                      is_pure=True, pack=4)
    return x, _code_bias(DOT_DTYPE)


# `mma_operand`'s PTX: a 32-bit copy, which ptxas folds away.
_COPY_B32 = tl.constexpr("mov.b32 $0, $1;")


@triton.jit
def mma_operand(x, INTERPRET: tl.constexpr):
    """``x``, a dot operand decoded from packed codes, unchanged; on the GPU with 16-bit elements
    behind an asm copy that Triton's layout passes cannot see through.

    For an mma.sync dot Triton sizes both operands' per-thread runs along k (``kWidth``) from
    the narrowest load behind either of them, halved again when a `tl.join` is on the way:
    a tile decoded from 16-bit words through joins gets runs of 4 elements. HMMA reads each
    fragment as a pair of 32-bit registers that those 8-byte runs do not form, so ptxas
    copied registers around every MMA (Triton 3.9 sm_90a build of the 4bit_nc decode loop:
    192 of 1195 instructions were such copies, and shared loads were 8-byte ``LDS.64`` in
    place of ``ldmatrix``). A side-effecting asm ends Triton's backward walk here, so the
    operand keeps its own width: runs of 2, read by ``ldmatrix`` (1007 instructions).
    Only for tiles decoded in registers: a raw tile that Triton's pipeliner copies into
    shared memory must not take a round trip through registers.
    """
    if INTERPRET or x.dtype == tl.float32:
        return x
    else:
        return tl.inline_asm_elementwise(_COPY_B32, "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


# Predicated so that a masked key (block id -1) asks for nothing: its address may lie outside the cache.
_PREFETCH_L2 = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")


@triton.jit
def prefetch_l2(ptrs, wanted, INTERPRET: tl.constexpr):
    """Ask L2 for the lines at ``ptrs`` where ``wanted`` (same shape, int1) holds; no-op in the interpreter.

    ``prefetch.global.L2`` holds no register and waits for nothing, so a key loop can ask
    for a later tile's lines without the registers a prefetch into registers costs.
    """
    if not INTERPRET:
        tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l,r", [ptrs, wanted.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


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
def fp8_e4m3fn_encode(x, HARDWARE: tl.constexpr):
    """fp32 -> uint8 fp8 e4m3fn bits: saturate to +-448, round to nearest even, NaN -> 0x7F|sign.

    HARDWARE (GPU, sm_89+): an fp8e4nv cast of the input clamped to +-448, which Triton emits
    as the round-to-nearest-even ``cvt.rn.satfinite.e4m3x2.f32`` (one instruction per two
    elements), NaN set apart. Else an exact integer recipe (about twenty instructions per
    element). The interpreter runs the recipe: its own fp8 down-cast loses the rounding carry
    (DESIGN.md section 8).
    """
    u = x.to(tl.uint32, bitcast=True)
    sign = ((u >> 31) & 1).to(tl.uint8) << 7
    a = u & _FP32_ABS_MASK
    is_nan = a > _FP32_EXP_MASK
    if HARDWARE:
        # Clamped first: saturation does not rest on the convert's overflow rule.
        code = tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(is_nan, 0x7F | sign, code)
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
