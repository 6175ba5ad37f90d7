"""Gluon store for mse-key TurboQuant caches on sm_90: warps encode their rows independently, no barrier in the loop.

Both frameworks' store kernel where `ineligible_shape` and their launchers allow it (tq_torch:
`tq_torch._src.gluon_store`, tq_jax: `tq_jax._src.gluon_store`): ``turboquant_4bit_nc``, ``turboquant_k3v4_nc`` and
``turboquant_3bit_nc`` slots (3- or 4-bit mse keys, 3- or 4-bit uniform values) at D = 128, bfloat16 K/V, the
preset's default rotation and codebook; other calls keep the frameworks' own store kernels. Same bytes as those
and the reference, but for key codes at bucket boundaries (fp32 dot sums in another order), as the contract
allows.

Why (steps.md, forty-second session): the Triton store runs one 16-warp program per SM whose tile passes
through shared memory between its loads, the rotation's warpgroup dot, the search and the packing, with 14
barriers per tile. Here a program of 4 warps loops over tiles of 64 rows, row ``r`` = (token ``r // Hkv``,
kv head ``r % Hkv``), and each warp works on its 16 rows alone:

- Lane ``(g, t) = (lane // 4, lane % 4)`` of warp ``w`` loads rows ``8w + g`` and ``8w + 32 + g`` of the tile,
  dims ``16j + 4t .. 16j + 4t + 3`` (8-byte loads, j = 0..7), of the keys and of 4-bit values (3-bit values:
  dims ``32t + 4j ..``).
- The rotation runs on mma.sync (m16n8k16) as ``Y^T = S' @ K^T``: the keys, as loaded, are the B operand (a dot
  may take its K index in any order: ``k = 16j + 8j1 + 2t + e`` is dim ``16j + 4t + 2j1 + e``), and ``S'``, the
  signs with their columns permuted to match and their rows to the rotated dims each lane should get
  (`_sign_operand`), is the A operand, 32 KiB of bf16 in shared memory, loaded once per program and read by
  ldmatrix in four chunks of 32 rotated dims.
- A lane then holds 4 codes per chunk of each of the 4 rows of its columns (rows ``32nt + 8w + 2t + e``): 4-bit
  codes ``32c + 4g ..``, one int16 word per row and chunk, the 8 lanes of a row writing 16 contiguous bytes;
  3-bit codes ``16g ..``, a 48-bit run. The row scales reach those lanes by two shuffles (`_ROW_PAIR_SHFL`).
- Values: min / max over the lane's dims, then across the row's 4 lanes; the codes packed per lane as words.

Arithmetic as the Triton kernel's: ``y = (K @ S^T) * RN(c / (n + 1e-8))``, the binary search over the symmetric
midpoints (`store.bucketize`, MID_MODE 0), NaN-propagating min / max, the correctly rounded value quotient
(`store.div_by_row`); but ``n = ||k||`` is summed in float64, where it is exact, so the stored norm is always
the reference's.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

import tq_spec

from .decode import _axis, _cta_barrier, _query_dims

HEAD_DIM = 128
NW = gl.constexpr(4)  # warps per program
ROWS_PER_TILE = 16 * NW.value
PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
# Resident programs per SM (the grid; each loops over tiles) and the register cap that lets them fit. H200, T = 32k,
# Hkv 8, one call (us; 4bit_nc / k3v4_nc / 3bit_nc): 3 at 168 registers 131.0 / 108.1 / 111.3, 4 at 128 138.8 /
# 116.2 / 123.9, 2 uncapped (186-200 registers) 138.6 / 117.0 / 123.7. At 168 the 4-bit build spills a few registers
# (6 local loads and stores in Triton 3.6's sm_90a code).
PROGRAMS_PER_SM = 3
MAXNREG = 168
# Process switch (``TQ_GLUON_STORE=0``): stores then always run the Triton (tq_torch) or Pallas (tq_jax) kernels.
ENABLED = os.environ.get("TQ_GLUON_STORE", "1") != "0"

_NORM_EPS = gl.constexpr(1e-8)
_SCALE_MIN = gl.constexpr(1e-8)
_F32_MAX = gl.constexpr(3.4028234663852886e38)


@gluon.jit
def _min_nan(a, b):
    return gl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _max_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# A float of each of this lane's two column rows (lane (g, t) = 4g + t: rows 2t and 2t + 1 of the dot's 8), from
# the lanes 8t and 8t + 4 that hold those rows as their g: $2 -> $0, $1.
_ROW_PAIR_SHFL = gl.constexpr("{ .reg .u32 l; mov.u32 l, %laneid; and.b32 l, l, 3; shl.b32 l, l, 3; "
                              "shfl.sync.idx.b32 $0, $2, l, 0x1f, 0xffffffff; add.u32 l, l, 4; "
                              "shfl.sync.idx.b32 $1, $2, l, 0x1f, 0xffffffff; }")


@gluon.jit
def _row_slots(r, slot_ptr, n_rows, num_slots, stride_cn_w, stride_cp_w, stride_ch_w, HKV: gl.constexpr,
               PAGE_SIZE: gl.constexpr):
    """Rows ``r`` (any shape and layout) = (token ``r // HKV``, kv head): token and head (int64), whether the row
    is written, and the cache word index of its slot. Past-the-end rows read the last row and write nothing; a
    slot outside ``[0, num_slots)`` (-1 = padding, or bad metadata) is not written."""
    in_range = r < n_rows
    r = gl.minimum(r, n_rows - 1)
    tok = r // HKV
    head = r - tok * HKV
    slot = gl.load(slot_ptr + tok)
    ok = in_range & (slot >= 0) & (slot < num_slots)
    slot = gl.where(ok, slot, 0).to(gl.int32)  # in range, a slot fits in int32 (the launcher checks)
    blk = slot // PAGE_SIZE
    in_blk = (slot - blk * PAGE_SIZE) * stride_cp_w + head * stride_ch_w
    return tok.to(gl.int64), head.to(gl.int64), ok, blk.to(gl.int64) * stride_cn_w + in_blk.to(gl.int64)


@gluon.jit
def _upper_midpoints(mid_ptr, BITS: gl.constexpr):
    """The upper half's midpoints ``mid[H .. 2H - 2]`` (``H = 2**(BITS - 1)``) as 7 scalars (3 bits: 3, then 0.0)."""
    m = mid_ptr + (1 << (BITS - 1))
    if BITS == 4:
        return (gl.load(m), gl.load(m + 1), gl.load(m + 2), gl.load(m + 3), gl.load(m + 4), gl.load(m + 5),
                gl.load(m + 6))
    else:
        gl.static_assert(BITS == 3, "3- or 4-bit keys")
        return gl.load(m), gl.load(m + 1), gl.load(m + 2), 0.0, 0.0, 0.0, 0.0


@gluon.jit
def _search(y, mids, BITS: gl.constexpr):
    """`store.bucketize` with MID_MODE 0: ``#{j : y >= mid[j]}`` over symmetric ascending midpoints, by a
    binary search of ``|y|`` over the upper half (``mids``: `_upper_midpoints`); NaN gets code 0."""
    H: gl.constexpr = 1 << (BITS - 1)
    m0, m1, m2, m3, m4, m5, m6 = mids
    neg = y < 0.0
    nonneg = y >= 0.0
    # |y| > m is pred(|y|) >= m for y < 0 (the next float down: bit pattern - 1), so one search counts both signs.
    mag = ((y.to(gl.int32, bitcast=True) & 0x7FFFFFFF) - neg.to(gl.int32)).to(gl.float32, bitcast=True)
    if BITS == 4:
        b2 = mag >= m3
        b1 = mag >= gl.where(b2, m5, m1)
        t0 = gl.where(b2, gl.where(b1, m6, m4), gl.where(b1, m2, m0))
        cnt = (b2.to(gl.int32) << 2) | (b1.to(gl.int32) << 1) | (mag >= t0).to(gl.int32)
    else:
        b1 = mag >= m1
        cnt = (b1.to(gl.int32) << 1) | (mag >= gl.where(b1, m2, m0)).to(gl.int32)
    return gl.where(nonneg, H + cnt, gl.where(neg, H - 1 - cnt, 0))


@gluon.jit
def _pick(x, idx, i: gl.constexpr, axis: gl.constexpr):
    """``x`` at index ``i`` of ``axis`` (``idx``: that axis's arange, broadcastable), the axis kept at size 1.
    The axis is a thread's registers: the select is a constant per register, folded away."""
    return gl.sum(gl.where(idx == i, x, 0), axis=axis, keep_dims=True)


@gluon.jit
def _store_words(cache_ptr, word, ok, x):
    """int16 words: the low 16 bits of ``x`` at word index ``word`` where ``ok``."""
    gl.store(cache_ptr + word, x.to(gl.int16), mask=ok)


@gluon.jit
def _store_run48(cache_ptr, word, ok, p0, p1, p2, p3):
    """Four groups of four 3-bit codes (12 bits each, LSB first) as the three int16 words from ``word``."""
    d0 = p0 | (p1 << 12) | (p2 << 24)
    _store_words(cache_ptr, word, ok, d0)
    _store_words(cache_ptr, word + 1, ok, d0 >> 16)
    _store_words(cache_ptr, word + 2, ok, ((p2 >> 8) & 0xF) | (p3 << 4))


@gluon.jit
def _key_chunk(sop, c: gl.constexpr, kb, y_scale, mids, key_shift, BITS: gl.constexpr, MMA: gl.constexpr,
               A_L: gl.constexpr, L7: gl.constexpr):
    """Rotated dims of output chunk ``c`` (32 rows of the operand) of the tile's 64 rows: the dot on the tensor
    cores, scaled per row, searched, and each lane's 4 codes of each of its rows packed (``[g, nt, w, t, e]``,
    ``4 * BITS`` bits; `_sign_operand` says which dims)."""
    y = mma_v2(sop.slice(32 * c, 32, dim=0).load(A_L), kb, gl.zeros([32, 16 * NW], gl.float32, MMA))
    codes = _search(y * y_scale[None, :], mids, BITS)
    # [(mt, h, g), (nt, w, t, e)] -> [mt, h, g, nt, w, t, e]
    codes = gl.convert_layout(gl.reshape(codes, [2, 2, 8, 2, NW, 4, 2]), L7, assert_trivial=True)
    return gl.sum(gl.sum(codes << key_shift, axis=1), axis=0)


@gluon.jit
def gluon_store_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, rot_ptr, mid_ptr, stride_kt, stride_kh, stride_vt,
                       stride_vh, stride_cn_w, stride_cp_w, stride_ch_w, n_rows, num_slots, n_tiles, rot_scale,
                       KEY_BITS: gl.constexpr, KEY_NORM_OFF: gl.constexpr, VALUE_BITS: gl.constexpr,
                       VALUE_OFF: gl.constexpr, VALUE_SCALE_OFF: gl.constexpr, VALUE_ZERO_OFF: gl.constexpr,
                       HKV: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Encodes rows ``[n_rows]`` = (token, kv head) of ``key_ptr`` / ``value_ptr`` (bf16 ``[T, Hkv, 128]``, unit
    stride along D) into their slots of ``cache_ptr`` (the cache as int16 words; strides in words).

    ``rot_ptr``: the signs operand ``[128, 128]`` bf16 (`_sign_operand`) of ``Pi = rot_scale * S``;
    ``mid_ptr``: the fp32 key midpoints (symmetric, ascending); ``slot_ptr``: int32 or int64 ``[T]``.
    Programs loop over tiles of ``16 * NW`` rows; ``*_OFF`` are the slot's byte offsets of its fields.
    """
    # Loaded rows [w, h, g, j, t, q]: row 8w + 32h + g (warp w's columns of the dot), dim 16j + 4t + q (3-bit
    # values: 32t + 4j + q, lane t's 32 codes a run of 6 words).
    L6: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 8, 1, 4], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1], order=[5, 3, 1, 4, 2, 0])
    R3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, L6)))  # [w, h, g]
    # Y^T [rotated dims, rows] = S' @ K^T: the keys are the B operand as loaded (k = 16j + 8j1 + 2t + e <- dim
    # 16j + 4t + 2j1 + e), the signs the A operand from shared memory.
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # A chunk's codes [mt, h, g, nt, w, t, e]: row 32nt + 8w + 2t + e, operand row 16mt + 8h + g of the chunk.
    L7: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 2, 1, 2, 1, 1, 2], threads_per_warp=[1, 1, 8, 1, 1, 4, 1],
                                        warps_per_cta=[1, 1, 1, 1, NW, 1, 1], order=[6, 1, 3, 0, 5, 2, 4])
    KR: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L7))  # [g, nt, w, t, e]
    RL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[NW, 1],
                                        order=[1, 0])

    # The rotation operand, once per program (256-byte rows, swizzled in 16-byte vectors for ldmatrix).
    sop = gl.allocate_shared_memory(gl.bfloat16, [128, 128],
                                    gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    rm = gl.arange(0, 128, layout=gl.SliceLayout(1, RL))
    rk = gl.arange(0, 128, layout=gl.SliceLayout(0, RL))
    sop.store(gl.load(rot_ptr + rm[:, None] * 128 + rk[None, :]))
    _cta_barrier()

    rows3 = (8 * gl.arange(0, NW, layout=_axis(R3, 0, 3))[:, None, None]
             + 32 * gl.arange(0, 2, layout=_axis(R3, 1, 3))[None, :, None]
             + gl.arange(0, 8, layout=_axis(R3, 2, 3))[None, None, :])  # [w, h, g]: 8w + 32h + g
    j6 = gl.arange(0, 8, layout=_axis(L6, 3, 6))[None, None, None, :, None, None]
    t6 = gl.arange(0, 4, layout=_axis(L6, 4, 6))[None, None, None, None, :, None]
    q6 = gl.arange(0, 4, layout=_axis(L6, 5, 6))[None, None, None, None, None, :]
    key_dims = 16 * j6 + 4 * t6 + q6
    if VALUE_BITS == 4:
        value_dims = key_dims
    else:
        value_dims = 32 * t6 + 4 * j6 + q6
    mt7 = gl.arange(0, 2, layout=_axis(L7, 0, 7))[:, None, None, None, None, None, None]
    h7 = gl.arange(0, 2, layout=_axis(L7, 1, 7))[None, :, None, None, None, None, None]
    key_shift = KEY_BITS * (2 * mt7 + h7)
    kg = gl.arange(0, 8, layout=_axis(KR, 0, 5))[:, None, None, None, None]
    knt = gl.arange(0, 2, layout=_axis(KR, 1, 5))[None, :, None, None, None]
    kw = gl.arange(0, NW, layout=_axis(KR, 2, 5))[None, None, :, None, None]
    kt = gl.arange(0, 4, layout=_axis(KR, 3, 5))[None, None, None, :, None]
    ke = gl.arange(0, 2, layout=_axis(KR, 4, 5))[None, None, None, None, :]
    VW: gl.constexpr = gl.SliceLayout(5, L6)  # [w, h, g, j, t]
    vj = gl.arange(0, 8, layout=_axis(VW, 3, 5))[None, None, None, :, None]
    vt = gl.arange(0, 4, layout=_axis(VW, 4, 5))[None, None, None, None, :]
    V_LEVELS: gl.constexpr = (1 << VALUE_BITS) - 1
    mids = _upper_midpoints(mid_ptr, KEY_BITS)

    pid = gl.program_id(0)
    for tile in range(pid, n_tiles, gl.num_programs(0)):
        r0 = tile * (16 * NW)
        tok, head, ok, row_word = _row_slots(r0 + rows3, slot_ptr, n_rows, num_slots, stride_cn_w, stride_cp_w,
                                             stride_ch_w, HKV, PAGE_SIZE)  # [w, h, g]
        k = gl.load(key_ptr + ((tok * stride_kt + head * stride_kh)[:, :, :, None, None, None] + key_dims))
        v = gl.load(value_ptr + ((tok * stride_vt + head * stride_vh)[:, :, :, None, None, None] + value_dims))

        # ---- keys: norm, rotation on the tensor cores, search, packed codes
        # ||k|| in float64: the squares of bf16 keys and their sum are exact there, so the norm is the reference's,
        # rounded to fp32 and then to fp16 as the contract stores it (an fp32 sum, in any order, is off by an ulp
        # of fp16 now and then). The thread's own dims first, then across the row's 4 lanes.
        kd = k.to(gl.float64)
        sq_part = gl.sum(gl.sum(kd * kd, axis=5), axis=3)  # [w, h, g, t]
        norm = gl.sqrt(gl.sum(sq_part, axis=3)).to(gl.float32)  # [w, h, g] (sqrt.rn.f64: IEEE in float64)
        gl.store(cache_ptr + (row_word + KEY_NORM_OFF // 2),
                 gl.convert_layout(norm, R3, assert_trivial=True).to(gl.float16).to(gl.int16, bitcast=True),
                 mask=ok)
        row_scale = gl.div_rn(gl.zeros_like(norm) + rot_scale, norm + _NORM_EPS)
        # The scales of the dot's columns (lane (g, t): rows 8w + 32nt + 2t + e), shuffled from the lanes that hold
        # those rows (`_ROW_PAIR_SHFL`): every g lane gets the same values, so max over g drops that axis.
        pair = gl.inline_asm_elementwise(_ROW_PAIR_SHFL, "=r,=r,r",
                                         [gl.broadcast(gl.expand_dims(row_scale, 3), sq_part)[0]],
                                         dtype=(gl.float32, gl.float32), is_pure=True, pack=1)
        y_scale = gl.max(gl.join(pair[0], pair[1]), axis=2)  # [w, nt, t, e]
        y_scale = gl.convert_layout(gl.reshape(gl.permute(y_scale, [1, 0, 2, 3]), [16 * NW]),
                                    gl.SliceLayout(0, MMA), assert_trivial=True)
        # [w, h, g, j, t, (j1, e)] -> K^T [(j, j1, t, e), (h, w, g)]
        kb = gl.permute(gl.reshape(k, [NW, 2, 8, 8, 4, 2, 2]), [3, 5, 4, 6, 1, 0, 2])
        kb = gl.convert_layout(gl.reshape(kb, [128, 16 * NW]), B_L, assert_trivial=True)
        # The codes' rows in the dot's column layout: their slots are read again there (L1 hits), since moving
        # `row_word` across lanes would take shared memory and a barrier.
        _, _, k_ok, k_word = _row_slots(r0 + 32 * knt + 8 * kw + 2 * kt + ke, slot_ptr, n_rows, num_slots,
                                        stride_cn_w, stride_cp_w, stride_ch_w, HKV, PAGE_SIZE)
        k_ok = k_ok & (kg >= 0)
        p0 = _key_chunk(sop, 0, kb, y_scale, mids, key_shift, KEY_BITS, MMA, A_L, L7)
        p1 = _key_chunk(sop, 1, kb, y_scale, mids, key_shift, KEY_BITS, MMA, A_L, L7)
        p2 = _key_chunk(sop, 2, kb, y_scale, mids, key_shift, KEY_BITS, MMA, A_L, L7)
        p3 = _key_chunk(sop, 3, kb, y_scale, mids, key_shift, KEY_BITS, MMA, A_L, L7)
        if KEY_BITS == 4:  # lane g's codes 32c + 4g .. 32c + 4g + 3: word 8c + g, coalesced across the 8 lanes
            _store_words(cache_ptr, k_word + kg, k_ok, p0)
            _store_words(cache_ptr, k_word + (kg + 8), k_ok, p1)
            _store_words(cache_ptr, k_word + (kg + 16), k_ok, p2)
            _store_words(cache_ptr, k_word + (kg + 24), k_ok, p3)
        else:  # lane g's codes 16g .. 16g + 15: words 3g .. 3g + 2
            _store_run48(cache_ptr, k_word + 3 * kg, k_ok, p0, p1, p2, p3)

        # ---- values: lo / hi per row (NaN-propagating), codes, packed
        vf = v.to(gl.float32)
        lo = gl.convert_layout(gl.reduce(gl.reduce(gl.reduce(vf, 5, _min_nan), 3, _min_nan), 3, _min_nan), R3,
                               assert_trivial=True)
        hi = gl.convert_layout(gl.reduce(gl.reduce(gl.reduce(vf, 5, _max_nan), 3, _max_nan), 3, _max_nan), R3,
                               assert_trivial=True)
        scale = gl.maximum(gl.div_rn(hi - lo, gl.zeros_like(lo) + V_LEVELS * 1.0), _SCALE_MIN,
                           propagate_nan=tl.PropagateNan.ALL)
        inv_scale = gl.div_rn(gl.zeros_like(scale) + 1.0, scale)
        gl.store(cache_ptr + (row_word + VALUE_SCALE_OFF // 2), scale.to(gl.float16).to(gl.int16, bitcast=True),
                 mask=ok)
        gl.store(cache_ptr + (row_word + VALUE_ZERO_OFF // 2), lo.to(gl.float16).to(gl.int16, bitcast=True),
                 mask=ok)
        # Correctly rounded (v - lo) / scale: two FMA corrections of (v - lo) * RN(1 / scale) (`store.div_by_row`).
        x = vf - lo[:, :, :, None, None, None]
        neg_s = (0.0 - gl.minimum(scale, _F32_MAX))[:, :, :, None, None, None]
        r = inv_scale[:, :, :, None, None, None]
        qt = gl.fma(x, r, 0.0)
        qt = gl.fma(gl.fma(qt, neg_s, x), r, qt)
        qt = gl.fma(gl.fma(qt, neg_s, x), r, qt)
        vcodes = gl.minimum(gl.floor(qt + 0.5).to(gl.int32), V_LEVELS)
        vw = gl.sum(vcodes << (VALUE_BITS * q6), axis=5)  # [w, h, g, j, t]: 4 codes each
        v_word = (row_word + VALUE_OFF // 2)[:, :, :, None, None]
        if VALUE_BITS == 4:  # codes 16j + 4t .. 16j + 4t + 3: word 4j + t
            _store_words(cache_ptr, v_word + (4 * vj + vt), ok[:, :, :, None, None] & (vj >= 0) & (vt >= 0), vw)
        else:  # lane t's codes 32t .. 32t + 31 in groups j of 4: words 6t .. 6t + 5
            vok = ok[:, :, :, None, None] & (vt >= 0)
            vword = v_word + 6 * vt
            _store_run48(cache_ptr, vword, vok, _pick(vw, vj, 0, 3), _pick(vw, vj, 1, 3), _pick(vw, vj, 2, 3),
                         _pick(vw, vj, 3, 3))
            _store_run48(cache_ptr, vword + 3, vok, _pick(vw, vj, 4, 3), _pick(vw, vj, 5, 3), _pick(vw, vj, 6, 3),
                         _pick(vw, vj, 7, 3))


def _lane_dims() -> np.ndarray:
    """The key dim that the dot's K index ``k = 16j + 8j1 + 2t + e`` stands for: ``16j + 4t + 2j1 + e`` (lane t's
    8-byte loads): the Gluon decode's map of its 4-bit query dims (`gluon_decode._query_dims`), run on the host."""
    return _query_dims.fn(np.arange(HEAD_DIM), 0, 4, False, HEAD_DIM)


def _rotated_dims(key_bits: int) -> np.ndarray:
    """The rotated dim of operand row ``m = 32c + 16mt + 8h + g`` (chunk c): lane g's codes are ``32c + 4g + 2mt + h``
    (4 bits: word ``8c + g``), or ``16g + 4c + 2mt + h`` (3 bits: lane g's 48-bit run)."""
    m = np.arange(HEAD_DIM)
    c, mt, h, g = m // 32, (m // 16) % 2, (m // 8) % 2, m % 8
    return (32 * c + 4 * g if key_bits == 4 else 16 * g + 4 * c) + 2 * mt + h


def _sign_operand(signs_t: np.ndarray, key_bits: int) -> np.ndarray:
    """``S^T [128 in, 128 out]`` (+-1) -> the kernel's A operand ``[128 rotated, 128 k]``: row m is rotated dim
    `_rotated_dims` ``[m]``, column k is key dim `_lane_dims` ``[k]``."""
    return np.ascontiguousarray(signs_t[_lane_dims()][:, _rotated_dims(key_bits)].T)


# --------------------------------------------------------------------------- launch facts


def ineligible_shape(preset_name: str, *, head_dim: int) -> Optional[str]:
    """None where the kernel writes this preset's slots, else why not. The frameworks add their own facts: an
    sm_90 device, bfloat16 keys and values, the preset's default rotation and codebook."""
    if not ENABLED:
        return "switched off (TQ_GLUON_STORE=0)"
    if preset_name not in PRESETS or head_dim != HEAD_DIM:
        return f"writes the {', '.join(PRESETS)} slots at D={HEAD_DIM} only"
    return None


def kernel_constexprs(preset_name: str, *, num_kv_heads: int, page_size: int) -> dict:
    """The kernel's constexprs and launch options (num_warps, maxnreg) for a cache of this preset's slots."""
    lay = tq_spec.layout(preset_name, HEAD_DIM)
    return dict(KEY_BITS=lay.preset.key_bits, KEY_NORM_OFF=lay.key_norm_offset, VALUE_BITS=lay.preset.value_bits,
                VALUE_OFF=lay.value_offset, VALUE_SCALE_OFF=lay.value_scale_offset,
                VALUE_ZERO_OFF=lay.value_zero_offset, HKV=num_kv_heads, PAGE_SIZE=page_size, num_warps=NW.value,
                maxnreg=MAXNREG)


# `gluon_store_kernel`'s runtime parameters in order: its pointers (the cache, written in place, third), then its
# scalars, as Triton signature types.
KERNEL_POINTERS = ("key_ptr", "value_ptr", "cache_ptr", "slot_ptr", "rot_ptr", "mid_ptr")
KERNEL_SCALARS = ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cn_w", "stride_cp_w", "stride_ch_w",
                  "n_rows", "num_slots", "n_tiles", "rot_scale")


def kernel_signature(slot_dtype: str = "*i32") -> dict:
    """`gluon_store_kernel`'s runtime parameters as Triton signature types (integers as ``i32``), for a compile
    without a launch; ``slot_dtype``: the slot mapping's (``*i32`` or ``*i64``)."""
    pointers = dict(key_ptr="*bf16", value_ptr="*bf16", cache_ptr="*i16", slot_ptr=slot_dtype, rot_ptr="*bf16",
                    mid_ptr="*fp32")
    return dict(pointers, **{n: "fp32" if n == "rot_scale" else "i32" for n in KERNEL_SCALARS})
