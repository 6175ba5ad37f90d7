"""Gluon decode for TurboQuant caches on sm_90+: no shared memory and no barrier in the key loop.

Both frameworks' decode-path kernel where `ineligible_shape` and their launchers allow it (tq_torch:
`tq_torch._src.gluon_decode`, tq_jax: `tq_jax._src.gluon_decode`): ``turboquant_4bit_nc``
(4-bit mse keys), ``turboquant_k3v4_nc`` (3-bit mse keys), ``turboquant_3bit_nc`` (3-bit keys and
values) and ``turboquant_k8v4`` (fp8 keys) slots at D = 128, and decode steps of the same slots at
D = 256 (the same loads and dots over twice the dims, 16-bit loads only, one page per trip); page size
16, a GQA group of at most 8, a bfloat16 query and output, an sm_90 device, sinks; no sliding window
or soft cap (those calls keep the frameworks' own kernels). Decode steps (``T <= B``) run one program per
query row, the GQA group as 8 columns; batches with several query tokens per sequence (speculative
verification, ``T > B``) run tiles of the decode path's ``16 // G`` tokens x ``G`` heads (`tile_shape`)
as 16 columns, each key decoded once for the whole tile, causal per column. Same function, partials and merge as
the decode path's own kernels; the same metadata guards (`_token_owner`, `_find_tile`, `_page_base`, clamped lengths).

Why (steps.md, thirty-third and thirty-fourth sessions): the Triton decode kernel is bound by
L1/TEX, and 84 % of that traffic is the decoded K/V tiles' trips through shared memory on their
way to the tensor cores. Here each warp is an independent stream of 16-key pages, and every
thread loads exactly the slot bytes its mma.sync fragments hold:

- ``S^T = K @ Q^T`` (m16n8k16: the warp's 16 keys as rows, the tile's query rows as 8 or 16 columns):
  thread ``(g, t) = (lane // 4, lane % 4)`` holds keys ``g`` and ``g + 8`` and dims ``2t + e (+ 8) + 16i``
  of the A fragment. The dims of a dot may be taken in any order, so the query's dims are permuted
  once (``k = 16 i + 8 j1 + 2 t + e`` <- ``16 i + 4 t + 2 j1 + e``): the thread's 32 dims of a key are
  its code words ``t + 4 i``, and the 4 lanes of a key read 8 contiguous bytes per load.
- ``O^T = V^T @ P^T`` (dims as the 128 rows): S^T's accumulator fragments, transposed across the
  warp by ``movmatrix``, are P^T's B fragments; the running max, sum and rescale live on the same
  columns as O^T's. A thread's 16 value dims ``32 i + 8 j + g`` are the nibbles ``j`` of value words
  ``g + 8 i`` of its 4 keys (the 8 lanes of a key read 16 contiguous bytes per load).
- fp8 keys: lane ``t`` reads the int32 words ``t + 4 i`` of a key (four e4m3 bytes each, the same dims
  as a 16-bit word of 4-bit codes), converted by `_FP8_ASM`; the query and the cache need no rotation
  or norms.
- 3-bit keys: lane ``t`` reads int16 words ``6t .. 6t + 5`` of a key (its 48 code bytes split in four:
  96 bits, codes ``32t .. 32t + 31`` of the LSB-first stream), cut into eight 12-bit fields of four codes
  (`_K3_FIELDS_ASM`); field ``i`` stands where 4-bit word ``t + 4i`` does, so the query's dims are
  permuted to ``32 t + 4 i + 2 j1 + e`` instead.
- 3-bit values: lane ``g`` reads int16 words ``3g .. 3g + 2`` of each of its keys (codes ``16g .. 16g + 15``),
  cut into four fields (`_V3_FIELDS_ASM`) that stand where 4-bit words ``g + 8i`` do; the output's rows
  are permuted back on the store.
- Centroids come from a warp shuffle (lane ``l`` holds entry ``l % 2**bits`` with its fp16 square, read
  from the codebook in the kernel as `kernel_math.table_lookup_with_squares` does); ``||c||^2`` from a
  ones dot of the squares.
- Wide loads (``WIDE``, where `WIDE_SLOTS` measured a win and the strides allow, `wide_loads`): each 16-bit
  load above serves 8 keys, so L1 looks up about 8 lines per load (an H200 profile of the 4bit_nc decode:
  the L1 data pipe 73-78 % busy, long-scoreboard waits the first stall). Instead a lane reads the bytes it
  holds of a key (16 for 4-bit keys, 8 for 4-bit values) as 8-byte loads at aligned addresses, rotated by
  the slots' offset mod 8, lane 0 taking the bytes past the rotation from one more load
  (`_wide_key_indices`); the query's dims and the output's rows follow the rotation.
- Tiles of several query tokens rotate an mse query themselves (``ROTATE``, `_rotated_query`: the signs of
  ``Pi`` on the tensor cores, after the first page's loads are issued) instead of a launch of
  `rotation.rotate_query` before them; decode steps take the query rotated (they measured slower).
- The next page's words are loaded before the current page is used (distance 1, in registers), and
  the block ids one page further ahead.
- The four warps merge once at the end. A decode step with at most `FUSED_MERGE_MAX_SPLITS` splits
  (4bit_nc, 3bit_nc and k8v4 slots) is one launch: the split that finishes last, by an atomic ticket
  per (row, kv head), merges every split's partials (`_merge_splits`). Otherwise the partials go to the
  framework's merge (tq_torch's `decode._decode_merge_kernel`, tq_jax's `decode.merge_partials`).

Every layout change between the loads and the dots is checked trivial at compile time
(``convert_layout(assert_trivial=True)``).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

import tq_spec

LOG2E = gl.constexpr(1.4426950408889634)  # jit code may only read constexpr globals
# This lane's codebook entry (lane ``l``: entry ``l & $2`` of the fp32 table at $1) as one 32-bit word: ``CVT`` of
# the entry in the low half, fp16 ``($3 * c)**2`` in the high half (the products rounded in fp32 first). Also
# tq_torch's `kernel_math` table lookups (with ``CVT`` for their dot dtype).
LANE_ENTRY_SQUARES_PTX = (
    "{ .reg .u32 l; .reg .b64 a; .reg .f32 c, s; .reg .b16 lo, hi; mov.u32 l, %laneid; and.b32 l, l, $2; "
    "mad.wide.u32 a, l, 4, $1; ld.global.nc.f32 c, [a]; CVT lo, c; mul.rn.f32 s, c, $3; mul.rn.f32 s, s, s; "
    "cvt.rn.f16.f32 hi, s; mov.b32 $0, {lo, hi}; }")
_LANE_ENTRY_BF16_SQUARES = gl.constexpr(LANE_ENTRY_SQUARES_PTX.replace("CVT", "cvt.rn.bf16.f32"))

PAGE_SIZE = 16
HEAD_DIM = 128
MAX_GROUP = 8
# Register cap, for 3 programs of 4 warps per SM. H200, B=32 x 8k, 3 splits, with 16-row scores (182
# registers uncapped): 235 us at 168, 260 us at 152, 423 us at 128, 249 us uncapped. With 8-column
# S^T (154 registers): 219 us at 168, 262 us at 128.
MAXNREG = 168
PROGRAMS_PER_SM = 3  # resident programs per SM at MAXNREG
WAVES = 2
# Tiles of several query tokens (16 columns): no register cap (247-254 registers for the mse keys, no spill;
# 2 programs per SM), one wave. H200, CUDA-graph replays, B=32 x 8k, q_len 4, GQA 4, 4bit_nc (us): cap 200
# 333, 232 270, none 258-262; then 1 split (one wave) 246, 2 splits 262, 3 splits 287.
MULTI_MAXNREG = None
MULTI_PROGRAMS_PER_SM = 2
MULTI_WAVES = 1
# D = 256 (decode steps): no register cap (Triton 3.6 sm_90a, 4bit_nc: 246 registers, no spill; capped at 232 the
# key loop spills 11 local loads and stores, at 200 47), so 2 programs per SM, one wave, one page per trip. H200,
# CUDA-graph replays, B=32 x 8k, Hq 16 / Hkv 4 (us), splits 2 / 3 / 4 / 6 / 8: 4bit_nc one page per trip 166 / 202 /
# 178 / 185 / 197, two 167 / 225 / 188 / 213 / 221; k8v4 one 136 / 179 / 148 / 156 / 167, two 152 / 196 / 168 /
# 178 / 188.
D256_MAXNREG = None
D256_PROGRAMS_PER_SM = 2
D256_WAVES = 1
MIN_SPLIT_PAGES = 16


def _key_lookup_asm(bits: int) -> str:
    """One 32-bit word holding four ``bits``-bit key codes from bit 0 (any bits above; 4 copies in
    $4..$7) and this lane's table entry ($8..$11, `_LANE_ENTRY`) -> $0, $1: bf16 centroid pairs of
    codes (0, 1), (2, 3); $2, $3: their fp16 squares. A shuffle reads only the low 5 bits of its lane
    index and entries repeat every ``2**bits`` lanes, so the bits above a code never matter."""
    return ("{ .reg .b32 c1, c2, c3, e0, e1, e2, e3; "
            f"shr.b32 c1, $4, {bits}; shr.b32 c2, $4, {2 * bits}; shr.b32 c3, $4, {3 * bits}; "
            "shfl.sync.idx.b32 e0, $8, $4, 0x1f, 0xffffffff; shfl.sync.idx.b32 e1, $8, c1, 0x1f, 0xffffffff; "
            "shfl.sync.idx.b32 e2, $8, c2, 0x1f, 0xffffffff; shfl.sync.idx.b32 e3, $8, c3, 0x1f, 0xffffffff; "
            "prmt.b32 $0, e0, e1, 0x5410; prmt.b32 $1, e2, e3, 0x5410; "
            "prmt.b32 $2, e0, e1, 0x7632; prmt.b32 $3, e2, e3, 0x7632; }")


def _fields_of_48_bits(words: tuple, fields: tuple) -> str:
    """PTX cutting the 48 bits of three zero-extended int16 words (operands ``words``) of 3-bit codes
    into four 12-bit fields of four codes (operands ``fields``; at bits 0, 12, 24 and 36, the bits
    above a field left as they fall). Uses the scratch register ``y``."""
    a, b, c = words
    f0, f1, f2, f3 = fields
    return (f"prmt.b32 {f0}, {a}, {b}, 0x5410; shr.b32 {f1}, {f0}, 12; prmt.b32 y, {b}, {c}, 0x5410; "
            f"shr.b32 {f2}, y, 8; shr.b32 {f3}, y, 20; ")


_K4_ASM = gl.constexpr(_key_lookup_asm(4))
_K3_ASM = gl.constexpr(_key_lookup_asm(3))
# A lane's 96 bits of 3-bit key codes, int16 words 0..3 and 2..5 ($8..$15) -> its eight fields ($0..$7):
# fields 4i..4i+3 are the 48 bits of words 3i..3i+2.
_K3_FIELDS_ASM = gl.constexpr(
    "{ .reg .b32 y; " + _fields_of_48_bits(("$8", "$9", "$10"), ("$0", "$1", "$2", "$3"))
    + _fields_of_48_bits(("$11", "$14", "$15"), ("$4", "$5", "$6", "$7")) + "}")
# Operands of the two field cutters: eight fields out, eight words in.
_FIELDS_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))
# D = 256: a lane's 192 bits of 3-bit key codes as four runs of three int16 words, each read with the next run's
# first word ($4..$7, the last unused) -> its four fields ($0..$3).
_K3_RUN_FIELDS_ASM = gl.constexpr("{ .reg .b32 y; " + _fields_of_48_bits(("$4", "$5", "$6"), ("$0", "$1", "$2", "$3"))
                                  + "}")


def _value_codes_asm(bits: int) -> str:
    """Words holding four ``bits``-bit value codes from bit 0 in their low 16 bits, of two keys ($4, $5;
    8 inputs, the rest copies) -> four bf16 pairs (128 + code_j of the first key, 128 + code_j of the
    second), j = 0..3 (`kernel_math.biased_code_operand`)."""
    mask = f"0x000{(1 << bits) - 1:X}000{(1 << bits) - 1:X}"
    return ("{ .reg .b32 t, u; prmt.b32 t, $4, $5, 0x5410; "
            f"and.b32 u, t, {mask}; or.b32 $0, u, 0x43004300; "
            + "".join(f"shr.b32 u, t, {j * bits}; and.b32 u, u, {mask}; or.b32 ${j}, u, 0x43004300; "
                      for j in (1, 2, 3)) + "}")


_V4_ASM = gl.constexpr(_value_codes_asm(4))


def _key_lookup8_asm() -> str:
    """`_key_lookup_asm` for a 32-bit word of eight 4-bit key codes ($8; 8 copies in $8..$15) and this lane's
    entry ($16..$23) -> $0..$3: bf16 centroid pairs of codes (0, 1) .. (6, 7); $4..$7: their fp16 squares."""
    return ("{ .reg .b32 c1, c2, c3, c4, c5, c6, c7, e0, e1, e2, e3, e4, e5, e6, e7; "
            + "".join(f"shr.b32 c{k}, $8, {4 * k}; " for k in range(1, 8))
            + "shfl.sync.idx.b32 e0, $16, $8, 0x1f, 0xffffffff; "
            + "".join(f"shfl.sync.idx.b32 e{k}, $16, c{k}, 0x1f, 0xffffffff; " for k in range(1, 8))
            + "".join(f"prmt.b32 ${p}, e{2 * p}, e{2 * p + 1}, 0x5410; " for p in range(4))
            + "".join(f"prmt.b32 ${4 + p}, e{2 * p}, e{2 * p + 1}, 0x7632; " for p in range(4)) + "}")


def _value_words8_asm() -> str:
    """`_value_codes_asm` (4 bits) for two keys' 32-bit words of eight value codes ($8, $9; 16 inputs, the
    rest copies) -> eight bf16 pairs (128 + code k of the first key, of the second), k = 0..7."""
    body = ""
    for half, sel in ((0, "0x5410"), (1, "0x7632")):
        body += f"prmt.b32 t, $8, $9, {sel}; and.b32 u, t, 0x000F000F; or.b32 ${4 * half}, u, 0x43004300; "
        body += "".join(f"shr.b32 u, t, {4 * j}; and.b32 u, u, 0x000F000F; or.b32 ${4 * half + j}, u, 0x43004300; "
                        for j in (1, 2, 3))
    return "{ .reg .b32 t, u; " + body + "}"


_K4_WIDE_ASM = gl.constexpr(_key_lookup8_asm())
_V4_WIDE_ASM = gl.constexpr(_value_words8_asm())
_WIDE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 16))
# Wide loads of a lane's rotated window (`_wide_key_indices`): 8-byte loads at 8-byte aligned addresses, and
# where the first selector $8 takes any byte from them (lane 0, slots not 8-byte aligned) the 8 bytes 64
# bytes further, whose first bytes replace the window's by `prmt` with the selectors $8.. (`_selectors`).
# Keys: one lane's 16 bytes of a key from $4 -> $0..$3 ($5..$7: copies). Values: two keys' 8 bytes each,
# $4 -> $0, $2 and $5 -> $1, $3 ($6, $7: copies).
_LOAD_KEY_WINDOW = gl.constexpr(
    "{ .reg .pred p; .reg .b32 x0, x1; setp.ne.b32 p, $8, 0x3210; ld.global.v2.b32 {$0, $1}, [$4]; "
    "ld.global.v2.b32 {$2, $3}, [$4+8]; @p ld.global.v2.b32 {x0, x1}, [$4+64]; "
    "prmt.b32 $0, $0, x0, $8; prmt.b32 $1, $1, x1, $9; }")
_LOAD_VALUE_WINDOWS = gl.constexpr(
    "{ .reg .pred p; .reg .b32 x0, x1, x2, x3; setp.ne.b32 p, $8, 0x3210; ld.global.v2.b32 {$0, $2}, [$4]; "
    "ld.global.v2.b32 {$1, $3}, [$5]; @p ld.global.v2.b32 {x0, x2}, [$4+64]; @p ld.global.v2.b32 {x1, x3}, [$5+64]; "
    "prmt.b32 $0, $0, x0, $8; prmt.b32 $1, $1, x1, $9; prmt.b32 $2, $2, x2, $10; prmt.b32 $3, $3, x3, $11; }")
_WINDOW_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["l"] * 4 + ["r"] * 4))
_V3_ASM = gl.constexpr(_value_codes_asm(3))
# Two keys' 48 bits of 3-bit value codes (int16 words 0, 1, 2, 2 of each, key-interleaved in $8..$15)
# -> their four fields each, key-interleaved ($0..$7).
_V3_FIELDS_ASM = gl.constexpr(
    "{ .reg .b32 y; " + _fields_of_48_bits(("$8", "$10", "$12"), ("$0", "$2", "$4", "$6"))
    + _fields_of_48_bits(("$9", "$11", "$13"), ("$1", "$3", "$5", "$7")) + "}")
# One 32-bit word of four fp8 e4m3 key bytes ($2; 4 copies in $2..$5) -> two bf16 pairs (bytes 0, 1 and 2, 3).
# e4m3 -> f16 is exact (as is f16 -> f32 -> bf16), and NaN stays NaN, as the Triton kernels' fp8 cast.
_FP8_ASM = gl.constexpr(
    "{ .reg .b16 lo, hi, a0, a1, a2, a3; .reg .b32 h0, h1; .reg .f32 f0, f1, f2, f3; mov.b32 {lo, hi}, $2; "
    "cvt.rn.f16x2.e4m3x2 h0, lo; cvt.rn.f16x2.e4m3x2 h1, hi; mov.b32 {a0, a1}, h0; mov.b32 {a2, a3}, h1; "
    "cvt.f32.f16 f0, a0; cvt.f32.f16 f1, a1; cvt.f32.f16 f2, a2; cvt.f32.f16 f3, a3; "
    "cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }")
# One int16 word loaded into a 32-bit register, zero-extended. (A `gl.load` of int16 widened in the kernel
# costs a PRMT (sign) or LOP3 (zero) per word after the load: 32 per page in the 4-bit loop.)
_LOAD_U16 = gl.constexpr("ld.global.u16 $0, [$1];")
# One 8 x 8 bf16 fragment transposed across the warp (a pair of elements per thread).
_TRANSPOSE_8X8 = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
# A fence at GPU scope by each thread (the value passes through): the split's partial stores before
# the ticket, the other splits' partials after it (`_merge_splits`).
_FENCE_GPU = gl.constexpr("fence.acq_rel.gpu; mov.b32 $0, $1;")
# The CTA barrier: `thread_barrier` in Triton 3.6, `barrier` from 3.7 on.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# TMA-staged pages (``STAGES`` > 0): each warp streams its pages through ``STAGES`` shared-memory stages of its own.
# One lane per warp fills a stage with two TMA tensor boxes of the page (the cache viewed as ``[N * 16 rows, row
# bytes]``): the key box (80 bytes of each row) and the value box (112 bytes, 64 further), both starting at the
# 16-byte boundary at or before the kv head's slot, since a box must start 16-byte aligned in its row (a box at the
# slot's own byte traps: steps.md, forty-seventh session). So slot byte b sits at box byte ``rot + b`` (key box) or
# ``rot + b - 64`` (value box), ``rot = (slot's offset in the row) mod 16``. One mbarrier per stage; the lanes read
# their mma fragments with `ldmatrix` (keys in the wide-load layout, values in the narrow one) and splice the bytes
# that the rotation moved past the 64 code bytes back in. The stages live at fixed byte offsets from
# ``global_smem``, addressed by inline asm, which Triton's barrier pass does not see: the kernel reserves that
# shared memory and puts a CTA barrier before the first and after the last use. The two tensor maps are built in
# the kernel, once per program, into its `MAP_WORDS` fp32 words (256 bytes) of ``tma_ws_ptr``.
MAP_WORDS = 64
KEY_BOX = 80  # key box row (bytes): codes, norm
VALUE_BOX = 112  # value box row: codes, scale, zero
VALUE_BOX_X = 64  # the value box's start past the key box's
STAGE_BYTES = 16 * (KEY_BOX + VALUE_BOX)  # bytes per stage (a page): the key box, then the value box
STAGE0 = 1024  # mbarriers (bytes 0 ..), tensor-map templates (512 .., 768 ..), keep-alive (512 ..)
_MAP_WORDS = gl.constexpr(MAP_WORDS)
_KBOX = gl.constexpr(KEY_BOX)
_VBOX = gl.constexpr(VALUE_BOX)
_VBOX_X = gl.constexpr(VALUE_BOX_X)
_STAGE_BYTES = gl.constexpr(STAGE_BYTES)
_STAGE0 = gl.constexpr(STAGE0)
_STAGE_KEEP = gl.constexpr(128)  # int32 offset of the keep-alive words (the templates are dead by then)
# The shared address of ``global_smem`` (where the kernel's shared memory starts).
_SMEM_BASE = gl.constexpr("mov.u32 $0, global_smem;")
# mbarrier at shared address $1 initialised for one arrival, where $2 != 0.
_MBAR_INIT = gl.constexpr(
    "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p mbarrier.init.shared::cta.b64 [$1], 1; mov.b32 $0, 0; }")
# The mbarriers' initialisation made visible to the copies (the async proxy) before the first is issued.
_MBAR_INIT_FENCE = gl.constexpr(
    "fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta; bar.warp.sync -1; mov.b32 $0, 0;")
# mbarrier at shared address $1 invalidated, where $2 != 0: before its bytes serve anything else (the warps' merge,
# the next program on the SM), as the PTX ISA requires of an mbarrier's memory.
_MBAR_INVAL = gl.constexpr(
    "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p mbarrier.inval.shared::cta.b64 [$1]; mov.b32 $0, 0; }")
# A warp's shared reads (generic proxy) ordered before the copies it issues next (async proxy).
_STAGE_FENCE = gl.constexpr("fence.proxy.async.shared::cta; bar.warp.sync -1; mov.b32 $0, 0;")


def _tensor_map_ptx(tmpl: str, ws: str, box: str) -> str:
    """PTX building one 2-D uint8 tiled tensor map (box ``box`` x 16 rows) from the zeroed 128-byte shared template
    at ``tmpl`` (64-bit register) by thread 0 (predicate ``l0``); global address $3, dims $4 (row bytes) x $5 (rows),
    row stride $6 (bytes); then warp 0 (``w0``) copies it to global ``ws`` with the tensormap-proxy release."""
    f = "@l0 tensormap.replace.tile.{}.shared::cta.b1024.b{} [" + tmpl + "], {};"
    return " ".join([
        f.format("global_address", 64, "$3"), f.format("rank", 32, "1"), f.format("box_dim", 32, "0, " + box),
        f.format("box_dim", 32, "1, 16"), f.format("global_dim", 32, "0, $4"), f.format("global_dim", 32, "1, $5"),
        f.format("global_stride", 64, "0, $6"), f.format("element_stride", 32, "0, 1"),
        f.format("element_stride", 32, "1, 1"), f.format("elemtype", 32, "0"), f.format("interleave_layout", 32, "0"),
        f.format("swizzle_mode", 32, "0"), f.format("fill_mode", 32, "0"),
        "@w0 tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [" + ws + "], ["
        + tmpl + "], 128;"])


# Every thread: warp 0 zeroes the two templates at shared $1 (256 bytes), thread 0 fills them (key box, value box),
# warp 0 copies them to global $2 and $2 + 128.
_MAKE_TENSOR_MAPS = gl.constexpr(
    "{ .reg .pred w0, l0; .reg .u32 t, a, z; .reg .b64 k, v, gk, gv; mov.u32 t, %tid.x; setp.lt.u32 w0, t, 32; "
    "setp.eq.u32 l0, t, 0; shl.b32 a, t, 3; add.u32 a, a, $1; mov.b32 z, 0; @w0 st.shared.v2.b32 [a], {z, z}; "
    "bar.warp.sync -1; "
    "cvt.u64.u32 k, $1; add.u64 v, k, 128; mov.b64 gk, $2; add.u64 gv, gk, 128; "
    + _tensor_map_ptx("k", "gk", str(KEY_BOX)) + " " + _tensor_map_ptx("v", "gv", str(VALUE_BOX))
    + " mov.b32 $0, 0; }")
# After a CTA barrier (warp 0 wrote the maps): each thread's tensormap-proxy acquire of both maps at $1.
_ACQUIRE_TENSOR_MAPS = gl.constexpr(
    "{ .reg .b64 v; add.u64 v, $1, 128; fence.proxy.tensormap::generic.acquire.gpu [$1], 128; "
    "fence.proxy.tensormap::generic.acquire.gpu [v], 128; mov.b32 $0, 0; }")
# Where $5 != 0 (the warp's lane 0, a live page): expect the page's bytes on mbarrier $2 and copy its key box at
# (x $3, row $4) of tensor map $6 to shared $1 and its value box at (x $3 + `VALUE_BOX_X`) of map $7 after the key
# box's 16 rows.
_TMA_ISSUE = gl.constexpr(
    "{ .reg .pred p; .reg .b64 st; .reg .u32 xv, dv; setp.ne.u32 p, $5, 0; "
    f"add.u32 xv, $3, {VALUE_BOX_X}; add.u32 dv, $1, {16 * KEY_BOX}; "
    f"@p mbarrier.arrive.expect_tx.shared::cta.b64 st, [$2], {STAGE_BYTES}; "
    "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$6, {$3, $4}], [$2]; "
    "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [dv], [$7, {xv, $4}], [$2]; "
    "mov.b32 $0, 0; }")
# Unless $3 (a dead page): wait until mbarrier $1 completes the phase of parity $2.
_STAGE_WAIT = gl.constexpr(
    "{ .reg .pred p, q; setp.ne.u32 q, $3, 0; @q bra.uni DONE; "
    "WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; @!p bra WAIT; DONE: mov.b32 $0, 0; }")
# Key words of one key row block (keys 8h .. 8h + 7 and their + 8 partners by lane): ldmatrix.x4 of the key box's
# chunks 0..3 (lane addresses $4), and of chunk 4 (.x1, lanes 0-7's addresses $8), whose bytes replace word 0's
# first bytes by `prmt` with selector $12 (the bytes the slot's rotation pushed past the 64 code bytes).
_LDSM_KEYS = gl.constexpr(
    "{ .reg .b32 x; ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4]; "
    "ldmatrix.sync.aligned.m8n8.x1.shared.b16 {x}, [$8]; prmt.b32 $0, $0, x, $12; }")
_LDSM_KEYS_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 12))
_LDSM_VALUES_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 24))
# Value words of one key row block: ldmatrix.x4.trans of the value box's chunks c0 .. c0 + 3 (lane addresses $8): lane
# (g, t) gets word g of keys 2t (low half) and 2t + 1 (high half) of each chunk; lanes with $24 != 0 take chunk 0's
# from chunk c0 + 4 (.x1.trans, lanes 0-7's addresses $16). Out: the 8 words zero-extended, key fastest.
_LDSM_VALUES = gl.constexpr(
    "{ .reg .b32 r0, r1, r2, r3, x; .reg .pred p; ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {r0, r1, r2, r3}, "
    "[$8]; ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {x}, [$16]; setp.ne.u32 p, $24, 0; @p mov.b32 r0, x; "
    "and.b32 $0, r0, 0xFFFF; shr.u32 $1, r0, 16; and.b32 $2, r1, 0xFFFF; shr.u32 $3, r1, 16; "
    "and.b32 $4, r2, 0xFFFF; shr.u32 $5, r2, 16; and.b32 $6, r3, 0xFFFF; shr.u32 $7, r3, 16; }")
# One int16 word at shared address $1, zero-extended.
_LDS_U16 = gl.constexpr("ld.shared.u16 $0, [$1];")


@gluon.constexpr_function
def _axis(layout, dim, rank):
    """``layout`` (of rank ``rank``) sliced down to its axis ``dim``: the layout of an arange along it."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.constexpr_function
def _stage_reserve_words(nw, stages):
    """int32 words of shared memory the stages take (`_STAGE0` and ``nw * stages`` stages), as a power of two."""
    need = (STAGE0 + nw * stages * STAGE_BYTES) // 4
    return 1 << (need - 1).bit_length()


@gluon.jit
def _block_ids(bt_row_ptr, page, page_hi):
    """Block ids of pages ``page`` (any shape and layout); -1 for pages at or past ``page_hi``."""
    return gl.load(bt_row_ptr + page, mask=page < page_hi, other=-1)


@gluon.jit
def _page_base(blk, num_blocks, stride_cn, head_off):
    """Word offset of the kv head's slot 0 in block ``blk`` (`_block_ids`), and whether the page is
    live (a block id in ``[0, num_blocks)``). Dead pages read block 0."""
    ok = (blk >= 0) & (blk < num_blocks)
    return gl.where(ok, blk, 0).to(gl.int64) * stride_cn + head_off, ok


@gluon.jit
def _page_blocks(bt_row, page0, page_hi, k_w, v_w, sk_w):
    """Block ids of page ``page0 + w`` in the layouts of `_load_page`'s three loads."""
    return (_block_ids(bt_row, page0 + k_w, page_hi), _block_ids(bt_row, page0 + v_w, page_hi),
            _block_ids(bt_row, page0 + sk_w[:, None], page_hi))


@gluon.jit
def _selectors(a, p0, lane0):
    """`prmt` selectors of the wide loads (`_LOAD_KEY_WINDOW`): in ``lane0`` lanes the register bytes at window
    positions ``p0 .. p0 + 3`` below ``a`` come from the extra bytes, every other byte from the window."""
    n_e = _clamp(a - p0, 0, 4)
    return gl.where(lane0, 0x3210 + (0x4444 & ((1 << (4 * n_e)) - 1)), 0x3210)


@gluon.jit
def _load_windows(ASM: gl.constexpr, ptrs, sel):
    """`_LOAD_KEY_WINDOW` or `_LOAD_VALUE_WINDOWS` at ``ptrs`` broadcast to the selectors' shape (the words'
    shape, 4 per thread in the asm's order)."""
    return gl.inline_asm_elementwise(ASM, _WINDOW_CONSTRAINTS, [gl.broadcast(ptrs, sel)[0], sel],
                                     dtype=gl.int32, is_pure=True, pack=4)


@gluon.jit
def _load_code_words(ptrs):
    """int16 code words at ``ptrs``, zero-extended to int32 by the load itself (`_LOAD_U16`)."""
    return gl.inline_asm_elementwise(_LOAD_U16, "=r,l", [ptrs], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _side_effect(ASM: gl.constexpr, CONSTRAINTS: gl.constexpr, args):
    return gl.inline_asm_elementwise(ASM, CONSTRAINTS, args, dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _lds_u16(addr):
    """int16 words at shared addresses ``addr`` (int32), zero-extended; never moved across the stage's wait."""
    return gl.inline_asm_elementwise(_LDS_U16, "=r,r", [addr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stage_setup(cache_ptr, tma_ws_ptr, ws_slot, row_bytes, num_rows, kv_head, stride_ch, NW: gl.constexpr,
                STAGES: gl.constexpr):
    """Per thread ``[32 NW]`` (a warp's lanes): the shared base, this warp's index, its stage 0, its mbarrier 0,
    whether the lane issues (lane 0), the two tensor maps' addresses and the boxes' x (the slots' row offset rounded
    down to 16 bytes). Builds the tensor maps (program slot ``ws_slot`` of ``tma_ws_ptr``) and the mbarriers."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    i = gl.arange(0, 32 * NW, layout=L)
    lane = i % 32
    w = i // 32
    smem = gl.inline_asm_elementwise(_SMEM_BASE, "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    bar0 = smem + w * (STAGES * 8)
    maps = tma_ws_ptr + (ws_slot.to(gl.int64) * _MAP_WORDS + i * 0)
    _side_effect(_MAKE_TENSOR_MAPS, "=r,r,l,l,r,r,l",
                 [smem + 512 + i * 0, maps, cache_ptr + i * 0, row_bytes + i * 0, num_rows + i * 0,
                  row_bytes.to(gl.int64) + i * 0])
    _side_effect(_MBAR_INIT, "=r,r,r", [bar0 + 8 * lane, (lane < STAGES).to(gl.int32)])
    _side_effect(_MBAR_INIT_FENCE, "=r", [])
    _cta_barrier()  # (warp 0 wrote the maps)
    _side_effect(_ACQUIRE_TENSOR_MAPS, "=r,l", [maps])
    stage0 = smem + _STAGE0 + w * (STAGES * _STAGE_BYTES)
    x = (2 * (kv_head * stride_ch) + i * 0) & -16
    return smem, w, stage0, bar0, (lane == 0).to(gl.int32), maps, maps + _MAP_WORDS // 2, x


@gluon.jit
def _stage_issue(blk, page, page_hi, copy, s, num_blocks):
    """Warp ``w``'s copies of page ``page + w`` (block ids ``blk`` ``[32 NW]``) into its stage ``s`` (lane 0); a page
    at or past ``page_hi`` copies nothing (a bad block id reads block 0, whose keys the page's ``ok`` masks)."""
    _, w, stage0, bar0, lane0, kmap, vmap, x = copy
    live = (page + w < page_hi).to(gl.int32)
    row = gl.where((blk >= 0) & (blk < num_blocks), blk, 0) * 16
    _side_effect(_TMA_ISSUE, "=r,r,r,r,r,r,l,l",
                 [stage0 + s * _STAGE_BYTES, bar0 + s * 8, x, row, lane0 * live, kmap, vmap])


@gluon.jit
def _staged_page(blocks, page0, seq_len, num_blocks, kidx, vidx, sk_w, sk_n, staged, KEY_NORM_WORD: gl.constexpr,
                 SCALE_WORD: gl.constexpr, ZERO_WORD: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr):
    """`_load_page`'s words from the stages: wait for page ``page0 + w``'s stage, read its words (``kidx``,
    ``vidx``: the `ldmatrix` operands in stage 0, `_staged_indices`; ``staged``: ``(page_lo, page_hi, per-key
    addresses of their slot byte 0 in each box, copy setup)``), then refill the stage with the warp's page
    ``STAGES`` trips ahead."""
    page_lo, page_hi, s_addr, copy = staged
    issue_blk, sblk = blocks
    j = (page0 - page_lo) // NW  # the warp's page index (uniform)
    s = j % STAGES
    w = copy[1]
    _side_effect(_STAGE_WAIT, "=r,r,r,r",
                 [copy[3] + s * 8, w * 0 + (j // STAGES) % 2, (page0 + w >= page_hi).to(gl.int32)])
    at = s * _STAGE_BYTES
    k4, k1, ksel = kidx
    kwords = gl.inline_asm_elementwise(_LDSM_KEYS, _LDSM_KEYS_CONSTRAINTS, [k4 + at, k1 + at, ksel],
                                       dtype=gl.int32, is_pure=False, pack=4)
    v4, v1, vsel = vidx
    vwords = gl.inline_asm_elementwise(_LDSM_VALUES, _LDSM_VALUES_CONSTRAINTS, [v4 + at, v1 + at, vsel],
                                       dtype=gl.int32, is_pure=False, pack=8)
    k_at, v_at = s_addr
    knorm = _lds_u16(k_at + (at + 2 * KEY_NORM_WORD)).to(gl.int16)
    vscale = _lds_u16(v_at + (at + 2 * SCALE_WORD - _VBOX_X)).to(gl.int16)
    vzero = _lds_u16(v_at + (at + 2 * ZERO_WORD - _VBOX_X)).to(gl.int16)
    _side_effect(_STAGE_FENCE, "=r", [])
    _stage_issue(issue_blk, page0 + STAGES * NW, page_hi, copy, s, num_blocks)
    _, ok = _page_base(sblk, num_blocks, 0, 0)
    ok = ok & ((page0 + sk_w[:, None]) * 16 + sk_n[None, :] < seq_len)
    return kwords, vwords, knorm, vscale, vzero, ok


@gluon.jit
def _staged_indices(copy, rot, KR: gl.constexpr, VW: gl.constexpr, VALUE_WORD: gl.constexpr, NW: gl.constexpr,
                    STAGES: gl.constexpr):
    """The `ldmatrix` operands of `_staged_page`, in stage 0 of each warp: keys ``[w, h, g, t, b, c]`` (``KR``): the
    .x4 row address of lane ``4g + t`` (key row ``8h + l % 8``, chunk ``l // 8``), the .x1 one (chunk 4), the `prmt`
    selector of word 0 (bytes below ``rot`` from chunk 4); values ``[w, h, t, e, g, i]`` (``VW``): the .x4.trans
    address (key row ``8h + l % 8``, chunk ``c0 + l // 8``), the .x1.trans one (chunk ``c0 + 4``), and whether lane
    ``g`` takes chunk 0's word from there (``g`` below the value words' shift)."""
    smem = copy[0]
    w, h, g, t, b, c = _grid6(KR, NW, 2, 8, 4, 2, 2)
    ln = 4 * g + t
    krow = 8 * h + ln % 8
    kst = smem + _STAGE0 + w * (STAGES * _STAGE_BYTES)
    k4 = kst + krow * _KBOX + 16 * (ln // 8) + 0 * (b + c)
    k1 = kst + krow * _KBOX + 64 + 0 * (b + c)
    ksel = _selectors(rot, 4 * t, True) + 0 * (b + c + h)
    vpos = rot + 2 * VALUE_WORD - _VBOX_X  # the value codes' first byte in the value box
    c0 = vpos // 16
    shift = (vpos % 16) // 2  # value words
    vw_, vh, vt, ve, vg, vi = _grid6(VW, NW, 2, 4, 2, 8, 4)
    vln = 4 * vg + vt
    vrow = 8 * vh + vln % 8
    vst = smem + _STAGE0 + vw_ * (STAGES * _STAGE_BYTES) + 16 * _KBOX
    v4 = vst + vrow * _VBOX + 16 * (c0 + vln // 8) + 0 * (ve + vi)
    v1 = vst + vrow * _VBOX + 16 * (c0 + 4) + 0 * (ve + vi)
    vsel = (vg < shift).to(gl.int32) + 0 * (ve + vi + vt)
    return (k4, k1, ksel), (v4, v1, vsel), shift


@gluon.jit
def _staged_blocks(bt_row, page0, page_hi, sk_w, copy_w, NW: gl.constexpr, STAGES: gl.constexpr):
    """The block ids `_staged_page` takes for page ``page0 + w``: those of the page ``STAGES`` trips ahead (the
    copies it issues, ``[32 NW]``: ``copy_w`` is each thread's warp) and of the page itself (per key)."""
    return (_block_ids(bt_row, page0 + STAGES * NW + copy_w, page_hi),
            _block_ids(bt_row, page0 + sk_w[:, None], page_hi))


@gluon.jit
def _load_page(cache_ptr, kcache_ptr, blocks, page0, seq_len, num_blocks, stride_cn, stride_cp, head_off,
               k_stride_cn, k_head_off, kidx, vidx, sk_w, sk_n, KEY_FP8: gl.constexpr,
               KEY_NORM_WORD: gl.constexpr, SCALE_WORD: gl.constexpr, ZERO_WORD: gl.constexpr,
               WIDE_K: gl.constexpr, WIDE_V: gl.constexpr):
    """Raw words of page ``page0 + w`` for warp ``w``, whose `_page_blocks` are ``blocks``: key words
    (``kidx``'s shape: int16 code words zero-extended to int32, or int32 words of four fp8 keys, from
    ``kcache_ptr``; with ``WIDE_K`` a lane's 16-byte window and 8 extra bytes, `_wide_key_indices`), V code
    words ``[w, h, t, e, g, i]`` (zero-extended; with ``WIDE_V`` window and extra bytes ``[w, h, t, e, g, c]``),
    and per key ``[w, 16]`` the norm (mse keys; the scale bits stand in for fp8 keys, never read), scale and
    zero bits and the key's validity (live page and key < ``seq_len``). (TMA-staged pages: `_staged_page`.)"""
    kblk, vblk, sblk = blocks
    if WIDE_K:
        k_slot, k_word, k_sel = kidx
        kbase, _ = _page_base(kblk, num_blocks, stride_cn, head_off)
        kwords = _load_windows(_LOAD_KEY_WINDOW, cache_ptr + (kbase + k_slot + k_word), k_sel)
    else:
        k_slot5, k_word5 = kidx
        kbase, _ = _page_base(kblk, num_blocks, k_stride_cn, k_head_off)
        if KEY_FP8:
            kwords = gl.load(kcache_ptr + (kbase + k_slot5 + k_word5))
        else:
            kwords = _load_code_words(kcache_ptr + (kbase + k_slot5 + k_word5))
    vbase, _ = _page_base(vblk, num_blocks, stride_cn, head_off)
    if WIDE_V:
        v_slot, v_word, v_sel = vidx
        vwords = _load_windows(_LOAD_VALUE_WINDOWS, cache_ptr + (vbase + v_slot + v_word), v_sel)
    else:
        v_slot6, v_word6 = vidx
        vwords = _load_code_words(cache_ptr + (vbase + v_slot6 + v_word6))
    sbase, ok = _page_base(sblk, num_blocks, stride_cn, head_off)
    ok = ok & ((page0 + sk_w[:, None]) * 16 + sk_n[None, :] < seq_len)
    sptr = cache_ptr + (sbase + sk_n[None, :] * stride_cp)
    vscale = gl.load(sptr + SCALE_WORD)
    if KEY_FP8:
        knorm = vscale  # (fp8 keys have no norm; never read)
    else:
        knorm = gl.load(sptr + KEY_NORM_WORD)
    return kwords, vwords, knorm, vscale, gl.load(sptr + ZERO_WORD), ok


@gluon.jit
def _lane_entries(cb_ptr, scale_bits, SHAPE: gl.constexpr, L: gl.constexpr, ENTRIES: gl.constexpr):
    """This lane's codebook entry with its scaled fp16 square (`_LANE_ENTRY_BF16_SQUARES`), as an int32 tensor of
    ``SHAPE`` in layout ``L`` (the key words' broadcast shape)."""
    return gl.inline_asm_elementwise(
        _LANE_ENTRY_BF16_SQUARES, "=r,l,r,r",
        [cb_ptr + gl.zeros(SHAPE, gl.int32, L), gl.full(SHAPE, ENTRIES - 1, gl.int32, L),
         gl.zeros(SHAPE, gl.int32, L) + scale_bits], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _key_words(KW: gl.constexpr, NW: gl.constexpr, k_cp, D: gl.constexpr):
    """Index tensors of the key words ``[w, h, g, t, i]`` (layout ``KW``; ``i < D // 16``): warp, slot offset of
    key ``8h + g`` (``k_cp`` words per slot) and word ``t + 4i`` of its codes."""
    kw_w = gl.arange(0, NW, layout=_axis(KW, 0, 5))
    kw_h = gl.arange(0, 2, layout=_axis(KW, 1, 5))
    kw_g = gl.arange(0, 8, layout=_axis(KW, 2, 5))
    kw_t = gl.arange(0, 4, layout=_axis(KW, 3, 5))
    kw_i = gl.arange(0, D // 16, layout=_axis(KW, 4, 5))
    return (kw_w[:, None, None, None, None],
            (8 * kw_h[None, :, None, None, None] + kw_g[None, None, :, None, None]) * k_cp,
            kw_t[None, None, None, :, None] + 4 * kw_i[None, None, None, None, :])


@gluon.jit
def _grid6(L: gl.constexpr, N0: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr, N3: gl.constexpr,
           N4: gl.constexpr, N5: gl.constexpr):
    """The six index tensors of an ``[N0, .., N5]`` grid in layout ``L``, each of rank 6 (size 1 off its axis)."""
    return (gl.arange(0, N0, layout=_axis(L, 0, 6))[:, None, None, None, None, None],
            gl.arange(0, N1, layout=_axis(L, 1, 6))[None, :, None, None, None, None],
            gl.arange(0, N2, layout=_axis(L, 2, 6))[None, None, :, None, None, None],
            gl.arange(0, N3, layout=_axis(L, 3, 6))[None, None, None, :, None, None],
            gl.arange(0, N4, layout=_axis(L, 4, 6))[None, None, None, None, :, None],
            gl.arange(0, N5, layout=_axis(L, 5, 6))[None, None, None, None, None, :])


@gluon.jit
def _key_words_3bit(KW: gl.constexpr, NW: gl.constexpr, k_cp, D: gl.constexpr):
    """`_key_words` for 3-bit codes, ``[w, h, g, t, half, c]``: word ``6t + 2 half + c`` of key ``8h + g``; at D = 256
    ``[w, h, g, t, run, c]``: word ``12t + 3 run + c`` (lane t's codes ``64t ..``, four runs of three words)."""
    if D == 128:
        w, h, g, t, half, c = _grid6(KW, NW, 2, 8, 4, 2, 4)
        return w, (8 * h + g) * k_cp, 6 * t + 2 * half + c
    else:
        w, h, g, t, run, c = _grid6(KW, NW, 2, 8, 4, 4, 4)
        return w, (8 * h + g) * k_cp, 12 * t + 3 * run + c


@gluon.jit
def _wide_key_indices(KR: gl.constexpr, NW: gl.constexpr, stride_cp, a):
    """Wide loads of 4-bit key codes, for slots starting ``a`` bytes (0, 2, 4 or 6) past an 8-byte boundary.

    Lane ``t`` reads the 16 bytes at key byte ``16t - a`` (8-byte aligned: two 8-byte loads), and lane 0 also
    the 8 bytes at ``64 - a``, whose first ``a`` bytes replace its window's first ``a`` (`_selectors`): position
    ``p`` of lane ``t``'s window then holds code byte ``(16t + p - a) mod 64``. A lane still holds 32 codes of
    each of its keys; the query's dims follow the rotation. Against one 16-bit load per 4 codes (8 keys per
    load either way) this is 3 loads per lane and key instead of 8. A window may start up to 6 bytes before
    its slot (for the cache's first slot, before the cache): every read stays inside the 8-byte aligned words
    that hold the slot's bytes, and bytes outside the codes are never used.

    Returns the warp index of the words ``[w, h, g, t, b, c]`` (``KR``: word ``2b + c`` of key ``8h + g``) and
    ``(slot, window start (int16 words), selectors)``."""
    w, h, g, t, b, c = _grid6(KR, NW, 2, 8, 4, 2, 2)
    return w, ((8 * h + g) * stride_cp, 8 * t - a // 2, _selectors(a, 4 * (2 * b + c), (t == 0) & (b == 0)))


@gluon.jit
def _wide_value_indices(VR: gl.constexpr, NW: gl.constexpr, stride_cp, a, VALUE_WORD: gl.constexpr):
    """`_wide_key_indices` for 4-bit value codes starting ``a`` bytes past an 8-byte boundary: lane ``g`` reads the
    8 bytes at value byte ``8g - a`` of each of its keys and lane 0 also those at ``64 - a``, so position ``p``
    of lane ``g``'s window holds byte ``(8g + p - a) mod 64``. Returns the warp index of ``[w, h, t, e, g, c]``
    (``VR``: word ``c`` of key ``8h + 2t + e``) and ``(slot, window start, selectors)``."""
    w, h, t, e, g, c = _grid6(VR, NW, 2, 4, 2, 8, 2)
    return w, ((8 * h + 2 * t + e) * stride_cp, VALUE_WORD + 4 * g - a // 2, _selectors(a, 4 * c, g == 0))


@gluon.jit
def _clamp(x, lo, hi):
    return gl.minimum(gl.maximum(x, lo), hi)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _row_counts(qsl_ptr, idx, num_seqs, num_tokens):
    """Whether sequences ``idx`` exist, and their query row counts as the metadata guards lay rows out:
    ``max(c[b+1] - c[b], 0)`` with ``c = clamp(query_start_loc, 0, T)`` (0 past ``num_seqs``)."""
    live = idx < num_seqs
    lo = _clamp(gl.load(qsl_ptr + idx, mask=live, other=0), 0, num_tokens)
    hi = _clamp(gl.load(qsl_ptr + idx + 1, mask=live, other=0), 0, num_tokens)
    return live, gl.where(live, gl.maximum(hi - lo, 0), 0)


@gluon.jit
def _token_owner(qsl_ptr, tok, num_seqs, num_tokens, NW: gl.constexpr):
    """Sequence, first row and row count of the sequence owning row ``tok``, and whether one does.

    Rows are laid out as `attention_kernel._find_sequence` lays them out, whatever
    ``query_start_loc`` holds: with ``c = clamp(qsl, 0, T)``, sequence ``b`` owns
    ``[s[b], s[b+1])``, ``s[0] = c[0]``, ``s[b+1] = min(T, s[b] + max(c[b+1] - c[b], 0))``, so every
    row has at most one owner (for valid metadata ``s == qsl``). The owner is the number of
    sequences ending at or before ``tok``; sequences are scanned 32 * NW at a time.
    """
    CHUNK: gl.constexpr = 32 * NW
    L: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[NW], order=[0])
    j = gl.arange(0, CHUNK, layout=L)
    first = _clamp(gl.load(qsl_ptr), 0, num_tokens)
    base = first  # s at the chunk's first sequence
    owner = tok * 0
    start = first  # s[owner]: the largest end <= tok
    end = tok * 0 + num_tokens  # s[owner + 1]: the smallest end > tok
    for chunk in range(0, num_seqs, CHUNK):
        live, grow = _row_counts(qsl_ptr, chunk + j, num_seqs, num_tokens)
        ends = gl.minimum(base + gl.associative_scan(grow, 0, _add), num_tokens)
        before = live & (ends <= tok)
        owner += gl.sum(before.to(gl.int32), axis=0)
        start = gl.maximum(start, gl.max(gl.where(before, ends, 0), axis=0))
        end = gl.minimum(end, gl.min(gl.where(live & (ends > tok), ends, num_tokens), axis=0))
        base = gl.minimum(base + gl.sum(grow, axis=0), num_tokens)
    owned = (owner < num_seqs) & (tok >= first)
    return gl.where(owned, owner, 0), start, end - start, owned


@gluon.jit
def _find_tile(qsl_ptr, pid, num_seqs, num_tokens, BLOCK_Q: gl.constexpr, NW: gl.constexpr):
    """Sequence, first row and row count of tile id ``pid`` (``BLOCK_Q`` rows per tile), as
    `attention_kernel._find_sequence` finds them: rows laid out as `_token_owner` lays them out, sequence
    ``b``'s tiles numbered from ``s[b] // BLOCK_Q + b``, and tile ``pid`` taken by the last sequence whose
    first tile id is ``<= pid`` (the caller checks that the tile's first row is inside it)."""
    CHUNK: gl.constexpr = 32 * NW
    L: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[NW], order=[0])
    j = gl.arange(0, CHUNK, layout=L)
    base = _clamp(gl.load(qsl_ptr), 0, num_tokens)
    q_start = base
    count = pid * 0
    for chunk in range(0, num_seqs, CHUNK):
        idx = chunk + j
        live, grow = _row_counts(qsl_ptr, idx, num_seqs, num_tokens)
        starts = gl.minimum(base + gl.associative_scan(grow, 0, _add) - grow, num_tokens)
        take = live & (starts // BLOCK_Q + idx <= pid)
        count += gl.sum(take.to(gl.int32), axis=0)
        q_start = gl.maximum(q_start, gl.max(gl.where(take, starts, 0), axis=0))
        base = gl.minimum(base + gl.sum(grow, axis=0), num_tokens)
    seq = gl.maximum(count - 1, 0)
    grow_b = gl.maximum(_clamp(gl.load(qsl_ptr + seq + 1), 0, num_tokens)
                        - _clamp(gl.load(qsl_ptr + seq), 0, num_tokens), 0)
    return seq, q_start, gl.minimum(q_start + grow_b, num_tokens) - q_start


@gluon.jit
def _tile_rows(r, q_start, q_len, tok0, live, seq_len, G: gl.constexpr, BLOCK_Q: gl.constexpr):
    """Of a tile's columns ``r`` (any shape and layout): the query row (int64), the query head within the
    GQA group, whether the column's partials are written, and the end of the keys it sees."""
    tok = tok0 + r // G
    if BLOCK_Q == 1:
        written = r < G
    else:
        written = (r < BLOCK_Q * G) & live & (tok < q_len)
    return (q_start + tok).to(gl.int64), r % G, written, seq_len - q_len + tok + 1


@gluon.jit
def _query_dims(k, a_k, KEY_BITS: gl.constexpr, WIDE_K: gl.constexpr, D: gl.constexpr):
    """The query dim that the score dot's K index ``k`` (any layout) stands for: the dims permuted to the codes a
    lane holds, ``k = 16i + 8j1 + 2t + e`` <- ``16i + 4t + 2j1 + e`` (word ``t + 4i``, code ``2j1 + e``), for 3 bits
    ``(D / 4) t + 4i + 2j1 + e`` (lane t's codes); wide 4-bit loads: code ``e`` of byte ``(16t + 2i + j1 - a_k) mod 64``
    (`_wide_key_indices`)."""
    if WIDE_K:
        return 2 * ((16 * ((k // 2) % 4) + 2 * (k // 16) + (k // 8) % 2 - a_k + 64) % 64) + k % 2
    elif KEY_BITS == 3:
        return (D // 4) * ((k // 2) % 4) + 4 * (k // 16) + 2 * ((k // 8) % 2) + k % 2
    else:
        return 16 * (k // 16) + 4 * ((k // 2) % 4) + 2 * ((k // 8) % 2) + k % 2


@gluon.jit
def _query_dims_ldsm(k, rot):
    """`_query_dims` for key words read by `ldmatrix` from TMA boxes (`_staged_page`): lane ``t``'s window position
    ``p = 2i + j1`` is row byte ``16 (p // 4) + 4t + p % 4`` of the key box, code byte ``(that - rot) mod 64``."""
    p = 2 * (k // 16) + (k // 8) % 2
    return 2 * ((16 * (p // 4) + 4 * ((k // 2) % 4) + p % 4 - rot + 64) % 64) + k % 2


@gluon.jit(noinline=True)
def _rotated_query(q_ptr, rot_ptr, rot_scale, stride_qt, stride_qh, kv_head, q_start, q_len, tok0, live, seq_len, a_k,
                   G: gl.constexpr, BLOCK_Q: gl.constexpr, NR: gl.constexpr, NW: gl.constexpr, KEY_BITS: gl.constexpr,
                   WIDE_K: gl.constexpr, B_L: gl.constexpr):
    """The tile's query rotated for mse keys, ``Pi @ q`` with ``Pi = rot_scale * S`` (``rot_ptr``: the bf16 signs
    ``S [128, 128]``, row-major), as the score dot's B operand ``[NW, 128, NR]`` bf16 (dims as `_query_dims`).

    As `rotation.rotate_query` computes it: exact products of the bf16 query with +-1, fp32 sums on the tensor
    cores, one multiply by ``rot_scale``, rounded to bf16 once. The four warps take 32 rotated dims each (8 KiB
    of ``S``), then every warp gets all 128 through shared memory, outside the key loop. (Before: a separate
    launch per call, ahead of this one.)"""
    R2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    RA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=R2, k_width=2)
    RB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=R2, k_width=2)
    dims = _query_dims(gl.arange(0, 128, layout=gl.SliceLayout(1, RA)), a_k, KEY_BITS, WIDE_K, 128)
    ka = gl.arange(0, 16, layout=gl.SliceLayout(0, RA))
    kb = gl.arange(0, 16, layout=gl.SliceLayout(1, RB))
    q_row, q_head, q_written, _ = _tile_rows(gl.arange(0, NR, layout=gl.SliceLayout(0, RB)), q_start, q_len, tok0,
                                             live, seq_len, G, BLOCK_Q)
    q_col = gl.expand_dims(q_row * stride_qt + (kv_head * G + q_head).to(gl.int64) * stride_qh, 0)
    acc = gl.zeros([128, NR], gl.float32, R2)
    for c in gl.static_range(8):
        s = gl.load(rot_ptr + gl.expand_dims(dims * 128, 1) + gl.expand_dims(16 * c + ka, 0))
        qc = gl.load(q_ptr + q_col + gl.expand_dims(16 * c + kb, 1),
                     mask=gl.expand_dims(q_written, 0) & gl.expand_dims(kb >= 0, 1), other=0.0)
        acc = mma_v2(s, qc, acc)
    q = gl.convert_layout((acc * rot_scale).to(gl.bfloat16), gl.SliceLayout(0, B_L))
    return gl.broadcast(gl.expand_dims(q, 0), gl.full([NW, 128, NR], 0.0, gl.bfloat16, B_L))[0]


@gluon.jit
def _attend_page(words, acc, m_i, l_i, z_i, q, ones, entry, vzeros, zero_s, square_scale, qk_scale, key_pos,
                 row_end, NW: gl.constexpr, NR: gl.constexpr, BLOCK_Q: gl.constexpr, KEY_BITS: gl.constexpr,
                 VALUE_BITS: gl.constexpr, PK: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr,
                 WIDE_K: gl.constexpr, WIDE_V: gl.constexpr, D: gl.constexpr):
    """One page per warp (`_load_page`'s ``words``) into the running state: ``acc`` (O^T ``[w, D, NR]``),
    the running max ``m_i`` ``[w, NR]``, and per key and column the sums of the weights ``l_i`` and of the
    value zero points' terms ``z_i`` (``[w, 16, NR]`` as the scores with 16 columns, else ``[w, NR]``); returns
    the new state. ``entry``: this lane's codebook entry (`_LANE_ENTRY`; for fp8 keys any int32 tensor of
    its shape). With ``BLOCK_Q > 1`` (columns of several tokens), column ``r`` sees the keys at positions
    ``key_pos [w, 16]`` below ``row_end [1, 1, NR]`` (causal); otherwise every column sees the page's valid
    keys. With ``WIDE_K`` / ``WIDE_V`` the code words come from wide loads (`_wide_key_indices`), ``entry`` /
    ``vzeros`` then in the layouts of their 8-code words."""
    KEY_FP8: gl.constexpr = KEY_BITS == 8
    kwords, vwords, knorm, vscale, vzero, ok = words
    if WIDE_K:  # a lane's 16 bytes of each of its keys as 4 words of 8 codes [w, h, g, t, b, c]
        kx = gl.broadcast(gl.expand_dims(gl.expand_dims(kwords, 6), 7), entry)[0]
        kc, ksq = gl.inline_asm_elementwise(_K4_WIDE_ASM, _WIDE_CONSTRAINTS, [kx, entry],
                                            dtype=(gl.bfloat16, gl.float16), is_pure=True, pack=8)
        # [w, h, g, t, (b, c, half), (j1, e)] -> K [w, (h, g), (i, j1, t, e)], i = 4b + 2c + half
        kc = gl.reshape(gl.permute(gl.reshape(kc, [NW, 2, 8, 4, 8, 2, 2]), [0, 1, 2, 4, 5, 3, 6]), [NW, 16, 128])
        ksq = gl.reshape(gl.permute(gl.reshape(ksq, [NW, 2, 8, 4, 8, 2, 2]), [0, 1, 2, 4, 5, 3, 6]),
                         [NW, 16, 128])
        kc = gl.convert_layout(kc, A_L, assert_trivial=True)
        ksq = gl.convert_layout(ksq, A_L, assert_trivial=True)
    elif KEY_FP8:
        kx = gl.broadcast(gl.expand_dims(kwords, 5), entry)[0]
        kc = gl.inline_asm_elementwise(_FP8_ASM, "=r,=r,r,r,r,r", [kx], dtype=gl.bfloat16, is_pure=True,
                                       pack=4)
        kc = gl.reshape(gl.permute(gl.reshape(kc, [NW, 2, 8, 4, D // 16, 2, 2]), [0, 1, 2, 4, 5, 3, 6]),
                        [NW, 16, D])
        kc = gl.convert_layout(kc, A_L, assert_trivial=True)
    else:
        if KEY_BITS == 3:  # the fields of four codes stand where 4-bit code words do
            if D == 128:
                kwords = gl.inline_asm_elementwise(_K3_FIELDS_ASM, _FIELDS_CONSTRAINTS, [kwords], dtype=gl.int32,
                                                   is_pure=True, pack=8)
            else:
                kwords = gl.inline_asm_elementwise(_K3_RUN_FIELDS_ASM, "=r,=r,=r,=r,r,r,r,r", [kwords],
                                                   dtype=gl.int32, is_pure=True, pack=4)
            kwords = gl.convert_layout(gl.reshape(kwords, [NW, 2, 8, 4, D // 16]), gl.SliceLayout(5, PK),
                                       assert_trivial=True)
        kx = gl.broadcast(gl.expand_dims(kwords, 5), entry)[0]
        kc, ksq = gl.inline_asm_elementwise(_K3_ASM if KEY_BITS == 3 else _K4_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                            [kx, entry], dtype=(gl.bfloat16, gl.float16), is_pure=True, pack=4)
        # [w, h, g, t, i, j1, e] -> K [w, (h, g), (i, j1, t, e)]
        kc = gl.reshape(gl.permute(gl.reshape(kc, [NW, 2, 8, 4, D // 16, 2, 2]), [0, 1, 2, 4, 5, 3, 6]),
                        [NW, 16, D])
        ksq = gl.reshape(gl.permute(gl.reshape(ksq, [NW, 2, 8, 4, D // 16, 2, 2]), [0, 1, 2, 4, 5, 3, 6]),
                         [NW, 16, D])
        kc = gl.convert_layout(kc, A_L, assert_trivial=True)
        ksq = gl.convert_layout(ksq, A_L, assert_trivial=True)
    if WIDE_V:  # a lane's 8 bytes of each of its keys as 2 words of 8 codes [w, h, t, e, g, c]
        vx = gl.broadcast(gl.expand_dims(gl.expand_dims(vwords, 6), 7), vzeros)[0]
        vc = gl.inline_asm_elementwise(_V4_WIDE_ASM, _WIDE_CONSTRAINTS, [vx], dtype=gl.bfloat16, is_pure=True,
                                       pack=16)
        vc = gl.reshape(vc, [NW, 2, 4, 2, 8, 4, 4])  # word i = 2c + half
    else:
        if VALUE_BITS == 3:  # likewise for values
            vwords = gl.inline_asm_elementwise(_V3_FIELDS_ASM, _FIELDS_CONSTRAINTS, [vwords], dtype=gl.int32,
                                               is_pure=True, pack=8)
        vx = gl.broadcast(gl.expand_dims(vwords, 6), vzeros)[0]
        vc = gl.inline_asm_elementwise(_V3_ASM if VALUE_BITS == 3 else _V4_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                       [vx], dtype=gl.bfloat16, is_pure=True, pack=8)
    # [w, h, t, e, g, i, j] -> V^T [w, (i, j, g), (h, t, e)]
    vc = gl.reshape(gl.permute(vc, [0, 5, 6, 4, 1, 2, 3]), [NW, D, 16])
    vc = gl.convert_layout(vc, A_L, assert_trivial=True)
    vscale = gl.where(ok, vscale.to(gl.float16, bitcast=True).to(gl.float32), 0.0)
    vzero = gl.where(ok, vzero.to(gl.float16, bitcast=True).to(gl.float32), 0.0)

    # S^T [w, 16 keys, 8 rows] = K @ Q^T; mse keys: times norm / ||c|| (||c||^2: a ones dot of the squares)
    s = mma_v2(kc, q, zero_s)
    visible = gl.expand_dims(ok, 2)
    if BLOCK_Q > 1:
        visible = visible & (gl.expand_dims(key_pos, 2) < row_end)
    if KEY_FP8:
        s = gl.where(visible, s * qk_scale, float("-inf"))
    else:
        knorm = knorm.to(gl.float16, bitcast=True).to(gl.float32)
        nsq = mma_v2(ksq, ones, zero_s)
        factor = gl.expand_dims(knorm * (square_scale * qk_scale), 2) * gl.rsqrt(nsq)
        s = gl.where(visible, s * factor, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    ps = (p * gl.expand_dims(vscale, 2)).to(gl.bfloat16)
    zp = p * gl.expand_dims(vzero, 2) - 128.0 * ps.to(gl.float32)
    if NR == 16:  # the sums stay per key (summed once after the loop): no shuffles, 4 more registers
        l_i = l_i * gl.expand_dims(alpha, 1) + p
        z_i = z_i * gl.expand_dims(alpha, 1) + zp
    else:  # (the 4-bit keys' 8-column loop would spill at `MAXNREG`)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        z_i = z_i * alpha + gl.sum(zp, axis=1)
    # P^T as a B operand: each 8 x 8 fragment of S^T's registers transposed across the warp
    # (`_TRANSPOSE_8X8`), then the same registers read as [keys, rows] with keys 2t + e: for the
    # compiler the asm is elementwise, so the indices are relabelled to what the registers hold.
    pt = gl.inline_asm_elementwise(_TRANSPOSE_8X8, "=r,r", [ps], dtype=gl.bfloat16, is_pure=True, pack=2)
    # [w, key half, g, column half, 2t + e] -> [w, (key half, 2t + e), (column half, g)]
    pt = gl.reshape(gl.permute(gl.reshape(pt, [NW, 2, 8, NR // 8, 8]), [0, 1, 4, 3, 2]), [NW, 16, NR])
    pt = gl.convert_layout(pt, B_L, assert_trivial=True)
    acc = mma_v2(vc, pt, acc * gl.expand_dims(alpha, 1))
    return acc, m_new, l_i, z_i


@gluon.jit
def gluon_decode_kernel(q_ptr, cache_ptr, kcache_ptr, cb_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, rot_ptr,
                        part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, ticket_ptr, tma_ws_ptr, stride_qt, stride_qh,
                        stride_bt, stride_cn, stride_cp, stride_ch, k_stride_cn, k_stride_cp, k_stride_ch, num_blocks,
                        num_splits, num_q_heads, num_seqs, num_tokens, qk_scale, max_seq_len, stride_ot, stride_oh,
                        base_mod16, rot_scale, G: gl.constexpr, KEY_BITS: gl.constexpr,
                        KEY_NORM_WORD: gl.constexpr, VALUE_BITS: gl.constexpr, VALUE_WORD: gl.constexpr,
                        SCALE_WORD: gl.constexpr, ZERO_WORD: gl.constexpr, UNROLL: gl.constexpr,
                        BLOCK_Q: gl.constexpr, NR: gl.constexpr, FUSED_MERGE: gl.constexpr,
                        HAS_SINKS: gl.constexpr, SPLITS_PAD: gl.constexpr, WIDE: gl.constexpr,
                        ROTATE: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """One (tile of query rows, kv head, split): unnormalised partials of the split's visible pages (log2
    domain), as `attention_kernel.paged_attention_kernel` writes them with ``SPLIT_KV``.

    ``q_ptr``: the query ``[T, Hq, 128]`` bf16, rotated for mse keys, or with ``ROTATE`` (mse keys) as given: the
    program rotates it (`_rotated_query`; ``rot_ptr``: the bf16 signs ``S [128, 128]`` of ``Pi = rot_scale * S``,
    row-major, not read otherwise); ``cache_ptr``: the cache as
    int16 words; ``kcache_ptr`` and ``k_stride_*``: the cache as key words (int16 words of 3- or
    4-bit codes, ``KEY_BITS`` 3 or 4; int32 words of four fp8 keys, ``KEY_BITS`` 8); ``cb_ptr``: the
    ``2**KEY_BITS``-entry fp32 key codebook (not read for fp8 keys); ``*_WORD``: the slot's int16
    word offsets of its fields; ``UNROLL``: pages per warp per loop trip (1 or 2).

    A tile is ``BLOCK_Q`` query tokens of one sequence x the ``G`` query heads of the kv head: ``NR``
    (8 or 16) columns of the dots, column ``r`` = token ``r // G``, head ``r % G``. ``BLOCK_Q`` 1 (decode
    steps): program ``x`` takes row ``x``, whose sequence is `_token_owner`'s. ``BLOCK_Q > 1`` (several
    query tokens per sequence): tile ids as the Triton kernels number them (`_find_tile`), each column
    masked causally.

    ``FUSED_MERGE`` (``BLOCK_Q`` 1 only): the split of a (row, kv head) that finishes last merges all of
    them into ``out`` (`_merge_splits`), counted in ``ticket_ptr`` (int32 ``[T * Hkv]``, zero between
    launches: the last split sets it back to 0), so a decode step is one launch. ``sinks_ptr``: fp32
    ``[Hq]`` (``HAS_SINKS``); ``out_ptr``: ``[T, Hq, 128]`` bf16 with strides ``stride_ot``,
    ``stride_oh``. Otherwise those three are not read and `decode._decode_merge_kernel` merges.

    ``WIDE`` (slot and block strides multiples of 8 bytes, so every slot of the kv head starts at the same
    byte ``a`` past an 8-byte boundary; ``base_mod16``: the cache's address mod 16): 4-bit key and value codes
    are read by 8-byte loads at aligned addresses, the bytes a lane holds rotated by ``a`` (`_wide_key_indices`).

    ``STAGES`` > 0 (decode steps of 4-bit keys and values at D = 128, not ``WIDE``; `tma_loads` strides): each
    warp's pages stream through ``STAGES`` shared-memory stages filled by TMA boxes, and the lanes read their mma
    fragments from there by `ldmatrix` (`_staged_page`); ``tma_ws_ptr``: `MAP_WORDS` fp32 words per program for its
    tensor maps (`LaunchShape.map_words`; not read otherwise).
    """
    pid = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    NW: gl.constexpr = 4
    KEY_FP8: gl.constexpr = KEY_BITS == 8
    WIDE_K: gl.constexpr = (WIDE or STAGES > 0) and KEY_BITS == 4  # (TMA stages: keys in the wide layout)
    WIDE_V: gl.constexpr = WIDE and VALUE_BITS == 4
    # D = 256: decode steps (`ineligible`), by 16-bit loads, the query rotated beforehand.
    gl.static_assert(D == 128 or (D == 256 and not WIDE and not ROTATE), "D = 256 reads by 16-bit loads")
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # K words [w, h, g, t, i] (+ code j): key 8h + g, word t + 4i of the key codes (4 bits, fp8), or
    # field i of four codes (3 bits).
    PK: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 1, D // 16, 4], threads_per_warp=[1, 1, 8, 4, 1, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1], order=[5, 4, 3, 2, 1, 0])
    if KEY_BITS == 3:
        # Loaded 3-bit key words [w, h, g, t, half, c]: key 8h + g, int16 word 6t + 2 half + c (lane t's
        # 96 bits: codes 32t..32t+31; words 2 and 3 are read twice, keeping the shape a power of two). D = 256:
        # [w, h, g, t, run, c], word 12t + 3 run + c (lane t's 192 bits, each run of three words read with the
        # next word).
        KW: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 1, D // 64, 4],
                                            threads_per_warp=[1, 1, 8, 4, 1, 1],
                                            warps_per_cta=[NW, 1, 1, 1, 1, 1], order=[5, 4, 3, 2, 1, 0])
    else:
        KW: gl.constexpr = gl.SliceLayout(5, PK)
    # V words [w, h, t, e, g, i] (+ code j): key 8h + 2t + e, word g + 8i of the value codes (4 bits), or
    # word (3D / 128) g + 3 (i // 4) + min(i % 4, 2), cut into fields i of four codes (3 bits).
    PV: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 2, 1, D // 32, 4],
                                        threads_per_warp=[1, 1, 4, 1, 8, 1, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1, 1], order=[3, 6, 5, 2, 4, 1, 0])
    VW: gl.constexpr = gl.SliceLayout(6, PV)
    # Wide loads: K [w, h, g, t, b, c, half, j]: code j of half `half` of 32-bit word 2b + c of lane t's 16 bytes
    # of key 8h + g; V [w, h, t, e, g, c, half, j]: likewise for lane g's 8 bytes of key 8h + 2t + e.
    PK8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 1, 2, 2, 2, 4],
                                         threads_per_warp=[1, 1, 8, 4, 1, 1, 1, 1],
                                         warps_per_cta=[NW, 1, 1, 1, 1, 1, 1, 1], order=[7, 6, 5, 4, 3, 2, 1, 0])
    PV8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 2, 1, 2, 2, 4],
                                         threads_per_warp=[1, 1, 4, 1, 8, 1, 1, 1],
                                         warps_per_cta=[NW, 1, 1, 1, 1, 1, 1, 1], order=[3, 7, 6, 5, 2, 4, 1, 0])
    SK: gl.constexpr = gl.SliceLayout(2, MMA)  # [w, key] along the scores' rows
    SR: gl.constexpr = gl.SliceLayout(1, MMA)  # [w, row] along the scores' (and O^T's) columns

    # Metadata guards (as the Triton kernels'): rows laid out with one owner each, lengths clamped to
    # what the block table can address, block ids outside [0, N) mask their keys (`_page_base`).
    if BLOCK_Q == 1:
        seq, q_start, q_len, live = _token_owner(qsl_ptr, pid, num_seqs, num_tokens, NW)
        tok0 = pid - q_start  # the row's token within its sequence
    else:
        seq, q_start, q_len = _find_tile(qsl_ptr, pid, num_seqs, num_tokens, BLOCK_Q, NW)
        tok0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # the tile's first token within its sequence
        live = (tok0 >= 0) & (tok0 < q_len)
        # Each sequence has one tile id more than it has tiles (for starts that are not multiples of BLOCK_Q),
        # and those programs write nothing: they leave at once. Run through the prologue and the warps' merge
        # they held their SM's slots long enough to delay the live tiles dispatched after them (H200, q_len 4,
        # B=32 x 8k, 4bit_nc, where half the tile ids are such: CUDA-graph replay 246.7 -> 226.9 us).
        if not live:
            return
    seq_len = gl.minimum(gl.maximum(gl.load(seq_lens_ptr + seq), 0), max_seq_len)
    # Token i of the sequence sits at position seq_len - q_len + i and sees keys [0, seq_len - q_len + i + 1);
    # the tile reads the keys its last token sees, [0, kv_end). A row no sequence owns (padding) sees none
    # (BLOCK_Q 1: its partials are written but never merged), a tile past its sequence writes nothing.
    kv_end = gl.where(live, seq_len - q_len + gl.minimum(tok0 + BLOCK_Q, q_len), 0)
    n_pages = (gl.maximum(kv_end, 0) + 15) // 16
    STEP: gl.constexpr = NW * UNROLL  # pages per loop trip
    chunk = (((n_pages + num_splits - 1) // num_splits + STEP - 1) // STEP) * STEP
    page_lo = split * chunk
    page_hi = gl.minimum(n_pages, page_lo + chunk)
    n_iter = (gl.maximum(page_hi - page_lo, 0) + NW - 1) // NW
    bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
    head_off = kv_head.to(gl.int64) * stride_ch
    if KEY_FP8:
        k_head_off = kv_head.to(gl.int64) * k_stride_ch
        k_cn = k_stride_cn
        k_cp = k_stride_cp
    else:  # the same words as the values: one set of offsets
        k_head_off = head_off
        k_cn = stride_cn
        k_cp = stride_cp

    # Wide loads: every slot of this kv head starts ``a_k`` bytes past an 8-byte boundary, its value codes ``a_v``.
    a_k = (base_mod16 + 2 * (kv_head * stride_ch)) % (16 if STAGES > 0 else 8)
    a_v = (a_k + 2 * VALUE_WORD) % 8

    # ---- query^T [w, 128, NR columns] in the B layout, dims permuted to the codes a lane holds (`_query_dims`)
    if not ROTATE:  # (the query as given: rotated already for mse keys)
        qk = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_L)))
        qr = gl.arange(0, NR, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_L)))
        if STAGES > 0:
            qcol = gl.expand_dims(gl.expand_dims(_query_dims_ldsm(qk, a_k), 0), 2)
        else:
            qcol = gl.expand_dims(gl.expand_dims(_query_dims(qk, a_k, KEY_BITS, WIDE_K, D), 0), 2)
        qrow = gl.expand_dims(gl.expand_dims(qr, 0), 1)
        qw = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, B_L))), 1), 2)
        q_row, q_head, q_written, _ = _tile_rows(qrow, q_start, q_len, tok0, live, seq_len, G, BLOCK_Q)
        qoff = q_row * stride_qt + (kv_head * G + q_head) * stride_qh + qcol + qw * 0
        q = gl.load(q_ptr + qoff, mask=q_written & (qcol >= 0) & (qw >= 0), other=0.0)
    ones = gl.full([NW, D, NR], 1.0, gl.float16, B_L)
    # Per column, the end of the keys it sees (read with BLOCK_Q > 1 only)
    _, _, _, row_end = _tile_rows(gl.arange(0, NR, layout=gl.SliceLayout(0, SR)), q_start, q_len, tok0, live,
                                  seq_len, G, BLOCK_Q)
    row_end = gl.expand_dims(gl.expand_dims(row_end, 0), 1)

    if STAGES > 0:
        gl.static_assert(not WIDE and KEY_BITS == 4 and VALUE_BITS == 4 and D == 128 and BLOCK_Q == 1,
                         "TMA-staged pages: decode steps of 4-bit keys and values at D = 128")
        # Whatever shared memory the prologue used (`_token_owner`) is done with before the stages take it.
        _cta_barrier()
        reserve = gl.allocate_shared_memory(gl.int32, [_stage_reserve_words(NW, STAGES)],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        copy = _stage_setup(cache_ptr, tma_ws_ptr, (pid * gl.num_programs(1) + kv_head) * num_splits + split,
                           2 * stride_cp, num_blocks * 16, kv_head, stride_ch, NW, STAGES)
        for pre in gl.static_range(STAGES):  # the warp's first STAGES pages, one per stage
            _stage_issue(_block_ids(bt_row, page_lo + pre * NW + copy[1], page_hi), page_lo + pre * NW, page_hi, copy,
                        pre, num_blocks)
        kidx, vidx, v_shift = _staged_indices(copy, a_k, gl.SliceLayout(6, gl.SliceLayout(7, PK8)), VW, VALUE_WORD,
                                              NW, STAGES)
    else:
        # ---- index tensors, K words
        if WIDE_K:
            k_w, kidx = _wide_key_indices(gl.SliceLayout(6, gl.SliceLayout(7, PK8)), NW, stride_cp, a_k)
        else:
            if KEY_BITS == 3:
                k_w, k_slot5, k_word5 = _key_words_3bit(KW, NW, k_cp, D)
            else:
                k_w, k_slot5, k_word5 = _key_words(KW, NW, k_cp, D)
            kidx = (k_slot5, k_word5)
        # ---- V words
        if WIDE_V:
            v_w, vidx = _wide_value_indices(gl.SliceLayout(6, gl.SliceLayout(7, PV8)), NW, stride_cp, a_v,
                                            VALUE_WORD)
        else:
            v_w, vw_h, vw_t, vw_e, vw_g, vw_i = _grid6(VW, NW, 2, 4, 2, 8, D // 32)
            v_slot6 = (8 * vw_h + 2 * vw_t + vw_e) * stride_cp
            if VALUE_BITS == 3:  # runs of words 3r .. 3r + 2 (the last read twice): codes (D / 8) g ..
                v_word6 = VALUE_WORD + (3 * D // 128) * vw_g + 3 * (vw_i // 4) + gl.minimum(vw_i % 4, 2)
            else:
                v_word6 = VALUE_WORD + vw_g + 8 * vw_i
            vidx = (v_slot6, v_word6)
    # ---- per-key scalars [w, key] in the score layout
    sk_w = gl.arange(0, NW, layout=gl.SliceLayout(1, SK))
    sk_n = gl.arange(0, 16, layout=gl.SliceLayout(0, SK))
    if STAGES > 0:  # per key, the shared address of its slot's byte 0 in the key box and in the value box (less x)
        key_at = copy[0] + _STAGE0 + sk_w[:, None] * (STAGES * _STAGE_BYTES) + a_k
        staged = (page_lo, page_hi, (key_at + sk_n[None, :] * _KBOX, key_at + 16 * _KBOX + sk_n[None, :] * _VBOX), copy)
        copy_w = copy[1]

    if KEY_FP8:
        entry = gl.zeros([NW, 2, 8, 4, D // 16, 4], gl.int32, PK)  # (the fp8 words' broadcast shape)
        square_scale = 1.0  # (not read)
    else:
        # This lane's codebook entry with its fp16 square (`kernel_math._lane_entry`), the squares scaled by
        # the power of two of `kv_tiles.key_square_scale` (``r * max|c|`` in [1, 2)).
        ENTRIES: gl.constexpr = 1 << KEY_BITS
        CB: gl.constexpr = gl.BlockedLayout(size_per_thread=[ENTRIES], threads_per_warp=[32], warps_per_cta=[NW],
                                            order=[0])
        cmax = gl.max(gl.abs(gl.load(cb_ptr + gl.arange(0, ENTRIES, layout=CB))), axis=0)
        scale_bits = 0x7F000000 - (cmax.to(gl.int32, bitcast=True) & 0x7F800000)
        square_scale = scale_bits.to(gl.float32, bitcast=True)
        if WIDE_K:  # (in the wide words' layout)
            entry = _lane_entries(cb_ptr, scale_bits, [NW, 2, 8, 4, 2, 2, 2, 4], PK8, ENTRIES)
        else:
            entry = _lane_entries(cb_ptr, scale_bits, [NW, 2, 8, 4, D // 16, 4], PK, ENTRIES)

    if WIDE_V:
        vzeros = gl.zeros([NW, 2, 4, 2, 8, 2, 2, 4], gl.int32, PV8)
    else:
        vzeros = gl.zeros([NW, 2, 4, 2, 8, D // 32, 4], gl.int32, PV)
    acc = gl.zeros([NW, D, NR], gl.float32, MMA)  # O^T: dims x columns
    m_i = gl.full([NW, NR], float("-inf"), gl.float32, SR)
    if NR == 16:  # (`_attend_page`)
        l_i = gl.zeros([NW, 16, NR], gl.float32, MMA)
        z_i = gl.zeros([NW, 16, NR], gl.float32, MMA)
    else:
        l_i = gl.zeros([NW, NR], gl.float32, SR)
        z_i = gl.zeros([NW, NR], gl.float32, SR)
    zero_s = gl.zeros([NW, 16, NR], gl.float32, MMA)
    if STAGES > 0:
        # One page per trip: the stages hold the pages ahead, so no words wait in registers. The block ids run one
        # page ahead of their use.
        blocks = _staged_blocks(bt_row, page_lo, page_hi, sk_w, copy_w, NW, STAGES)
        for it in range(0, n_iter):
            page0 = page_lo + it * NW
            words = _staged_page(blocks, page0, kv_end, num_blocks, kidx, vidx, sk_w, sk_n, staged, KEY_NORM_WORD,
                                 SCALE_WORD, ZERO_WORD, NW, STAGES)
            blocks = _staged_blocks(bt_row, page0 + NW, page_hi, sk_w, copy_w, NW, STAGES)
            key_pos = (page0 + sk_w[:, None]) * 16 + sk_n[None, :]
            acc, m_i, l_i, z_i = _attend_page(words, acc, m_i, l_i, z_i, q, ones, entry, vzeros, zero_s,
                                              square_scale, qk_scale, key_pos, row_end, NW, NR, BLOCK_Q,
                                              KEY_BITS, VALUE_BITS, PK, A_L, B_L, WIDE_K, WIDE_V, D)
    else:
        # Block ids run one page ahead of the words: a page's addresses never wait on its block id.
        blocks = _page_blocks(bt_row, page_lo + NW, page_hi, k_w, v_w, sk_w)
        cur = _load_page(cache_ptr, kcache_ptr, _page_blocks(bt_row, page_lo, page_hi, k_w, v_w, sk_w), page_lo,
                         kv_end, num_blocks, stride_cn, stride_cp, head_off, k_cn, k_head_off, kidx, vidx, sk_w, sk_n,
                         KEY_FP8, KEY_NORM_WORD, SCALE_WORD, ZERO_WORD, WIDE_K, WIDE_V)
        if ROTATE:  # (here, so that the first page's loads are in flight meanwhile)
            q = _rotated_query(q_ptr, rot_ptr, rot_scale, stride_qt, stride_qh, kv_head, q_start, q_len, tok0, live,
                               seq_len, a_k, G, BLOCK_Q, NR, NW, KEY_BITS, WIDE_K, B_L)
        # With UNROLL 2, two pages per trip, so that the words loaded ahead never move between registers at
        # the back edge; an odd count runs one page past ``page_hi``: no live keys, no change to the state.
        for it in range(0, n_iter, UNROLL):
            if UNROLL == 2:
                words = cur
                cur = _load_page(cache_ptr, kcache_ptr, blocks, page_lo + (it + 1) * NW, kv_end, num_blocks,
                                 stride_cn, stride_cp, head_off, k_cn, k_head_off, kidx, vidx, sk_w, sk_n, KEY_FP8,
                                 KEY_NORM_WORD, SCALE_WORD, ZERO_WORD, WIDE_K, WIDE_V)
                blocks = _page_blocks(bt_row, page_lo + (it + 2) * NW, page_hi, k_w, v_w, sk_w)
                key_pos = (page_lo + it * NW + sk_w[:, None]) * 16 + sk_n[None, :]
                acc, m_i, l_i, z_i = _attend_page(words, acc, m_i, l_i, z_i, q, ones, entry, vzeros, zero_s,
                                                  square_scale, qk_scale, key_pos, row_end, NW, NR, BLOCK_Q,
                                                  KEY_BITS, VALUE_BITS, PK, A_L, B_L, WIDE_K, WIDE_V, D)
            words = cur
            cur = _load_page(cache_ptr, kcache_ptr, blocks, page_lo + (it + UNROLL) * NW, kv_end, num_blocks,
                             stride_cn, stride_cp, head_off, k_cn, k_head_off, kidx, vidx, sk_w, sk_n, KEY_FP8,
                             KEY_NORM_WORD, SCALE_WORD, ZERO_WORD, WIDE_K, WIDE_V)
            blocks = _page_blocks(bt_row, page_lo + (it + UNROLL + 1) * NW, page_hi, k_w, v_w, sk_w)
            key_pos = (page_lo + (it + UNROLL - 1) * NW + sk_w[:, None]) * 16 + sk_n[None, :]
            acc, m_i, l_i, z_i = _attend_page(words, acc, m_i, l_i, z_i, q, ones, entry, vzeros, zero_s, square_scale,
                                              qk_scale, key_pos, row_end, NW, NR, BLOCK_Q, KEY_BITS, VALUE_BITS,
                                              PK, A_L, B_L, WIDE_K, WIDE_V, D)

    if STAGES > 0:  # every warp is done with its stages (no copy is in flight: each was waited for)
        lane_i = gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0])) % 32
        _side_effect(_MBAR_INVAL, "=r,r,r", [copy[3] + 8 * lane_i, (lane_i < STAGES).to(gl.int32)])
        _cta_barrier()
        reserve.slice(_STAGE_KEEP, 32 * NW).store(gl.zeros([32 * NW], gl.int32,
                                                          gl.BlockedLayout([1], [32], [NW], [0])))
    # ---- merge the warps
    if NR == 16:
        l_i = gl.sum(l_i, axis=1)
        z_i = gl.sum(z_i, axis=1)
    m_all = gl.max(m_i, axis=0)
    m_all_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
    wsc = gl.exp2(m_i - gl.expand_dims(m_all_safe, 0))
    l_all = gl.sum(l_i * wsc, axis=0)
    z_all = gl.sum(z_i * wsc, axis=0)
    o = gl.sum(acc * gl.expand_dims(wsc, 1), axis=0)  # [D, NR]
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    o = o + gl.expand_dims(gl.convert_layout(z_all, gl.SliceLayout(0, OL)), 0)
    on = gl.arange(0, D, layout=gl.SliceLayout(1, OL))
    orow = gl.arange(0, NR, layout=gl.SliceLayout(0, OL))
    if WIDE_V:  # row 32i + 8j + g holds code j of word i of lane g's rotated window: byte 2i + j // 2
        omem = 2 * ((8 * (on % 8) + 2 * (on // 32) + ((on // 8) % 4) // 2 - a_v + 64) % 64) + ((on // 8) % 4) % 2
    elif STAGES > 0:  # ... nibble j of value word (g + 8i - shift) mod 32 (`_staged_indices`)
        omem = 4 * ((8 * (on // 32) + on % 8 - v_shift + 32) % 32) + (on // 8) % 4
    elif VALUE_BITS == 3:  # row 32i + 8j + g holds code j of field i of lane g's codes (D / 8) g ..
        omem = (D // 8) * (on % 8) + 4 * (on // 32) + (on // 8) % 4
    else:  # ... nibble j of value word g + 8i
        omem = 32 * (on // 32) + 4 * (on % 8) + (on // 8) % 4
    o_row, o_head, o_written, _ = _tile_rows(orow, q_start, q_len, tok0, live, seq_len, G, BLOCK_Q)
    part = (o_row * num_q_heads + kv_head * G + o_head) * num_splits + split
    gl.store(part_acc_ptr + part[None, :] * D + omem[:, None], o, mask=o_written[None, :] & (omem >= 0)[:, None])
    rr = gl.arange(0, NR, layout=gl.SliceLayout(0, SR))
    r_row, r_head, r_written, _ = _tile_rows(rr, q_start, q_len, tok0, live, seq_len, G, BLOCK_Q)
    part_r = (r_row * num_q_heads + kv_head * G + r_head) * num_splits + split
    gl.store(part_m_ptr + part_r, m_all, mask=r_written)
    gl.store(part_l_ptr + part_r, l_all, mask=r_written)
    if FUSED_MERGE:
        # Every thread's partials are visible at GPU scope before one thread takes this split's ticket; the
        # split that takes the last one has every split's partials to read.
        _fence_gpu(gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0])))
        _cta_barrier()
        ticket = ticket_ptr + (pid * gl.num_programs(1) + kv_head)
        if gl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            _fence_gpu(gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0])))
            _merge_splits(part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, out_ptr, qsl_ptr, ticket, pid, kv_head,
                          stride_ot, stride_oh, num_q_heads, num_splits, num_seqs, G, NR, NW, HAS_SINKS, SPLITS_PAD,
                          D)


@gluon.jit
def _fence_gpu(x):
    """``fence.acq_rel.gpu`` in every thread holding an element of ``x``."""
    return gl.inline_asm_elementwise(_FENCE_GPU, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit(noinline=True)
def _merge_splits(part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, out_ptr, qsl_ptr, ticket, row, kv_head,
                  stride_ot, stride_oh, num_q_heads, num_splits, num_seqs, G: gl.constexpr, NR: gl.constexpr,
                  NW: gl.constexpr, HAS_SINKS: gl.constexpr, SPLITS_PAD: gl.constexpr, D: gl.constexpr):
    """Query row ``row``'s ``G`` heads of ``kv_head``: the splits' partials merged into ``out`` (bf16), as
    `decode._decode_merge_kernel` merges them (sinks in the denominator, a NaN denominator gives NaN,
    zeros for rows outside ``[query_start_loc[0], query_start_loc[B])`` and rows that saw no key). Sets
    the ``ticket`` counter back to 0 for the next launch (and CUDA-graph replays).

    Partials are read from L2 (``.cg``: other SMs wrote them), every split's m at once, then the
    accumulators ``CH`` splits per load round (one round per split left the last split's program
    waiting on 2 x 16 round trips at B = 1, slower than the merge kernel it replaces). Not inlined:
    inlined, its index math shared registers with the key loop, which then spilled."""
    CH: gl.constexpr = 4 if SPLITS_PAD >= 4 else SPLITS_PAD
    # [split, column, dim]: a thread holds CH splits x 4 dims of NR // NW columns.
    L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[CH, 1, 4], threads_per_warp=[1, 1, 32],
                                        warps_per_cta=[1, NW, 1], order=[2, 1, 0])
    SC: gl.constexpr = gl.SliceLayout(2, L3)  # [split, column]
    COL: gl.constexpr = gl.SliceLayout(0, SC)  # [column]
    OL: gl.constexpr = gl.SliceLayout(0, L3)  # [column, dim]
    # [split, column] for the m of every split (splits along lanes and warps)
    MS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32 // NR, NR],
                                        warps_per_cta=[NW, 1], order=[1, 0])
    real = (row >= gl.load(qsl_ptr)) & (row < gl.load(qsl_ptr + num_seqs))
    n_live = gl.where(real, num_splits, 0)  # splits to read (none for rows outside the batch)

    sm = gl.arange(0, SPLITS_PAD, layout=gl.SliceLayout(1, MS))
    rm = gl.arange(0, NR, layout=gl.SliceLayout(0, MS))
    part_m = (row.to(gl.int64) * num_q_heads + kv_head * G + rm) * num_splits
    m = gl.load(part_m_ptr + part_m[None, :] + sm[:, None], mask=(sm < n_live)[:, None] & (rm < G)[None, :],
                other=float("-inf"), cache_modifier=".cg")
    m_all = gl.convert_layout(gl.max(m, axis=0), COL)

    r = gl.arange(0, NR, layout=COL)
    head = kv_head * G + r
    if HAS_SINKS:
        sink = gl.load(sinks_ptr + head, mask=r < G, other=0.0) * LOG2E
        m_all = gl.maximum(m_all, sink)
    m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
    part = (row.to(gl.int64) * num_q_heads + head) * num_splits
    c = gl.arange(0, CH, layout=gl.SliceLayout(1, SC))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, OL))
    denom = gl.zeros([NR], gl.float32, COL)
    o = gl.zeros([NR, D], gl.float32, OL)
    for s0 in range(0, num_splits, CH):
        live = ((s0 + c) < n_live)[:, None] & (r < G)[None, :]
        idx = part[None, :] + (s0 + c)[:, None]  # [CH, NR]
        # Empty splits have m = -inf: weight exactly 0, they merge as nothing.
        w = gl.exp2(gl.load(part_m_ptr + idx, mask=live, other=float("-inf"), cache_modifier=".cg")
                    - m_safe[None, :])
        denom += gl.sum(w * gl.load(part_l_ptr + idx, mask=live, other=0.0, cache_modifier=".cg"), axis=0)
        acc = gl.load(part_acc_ptr + gl.expand_dims(idx * D, 2) + gl.expand_dims(gl.expand_dims(d, 0), 0),
                      mask=gl.expand_dims(live, 2), other=0.0, cache_modifier=".cg")
        o += gl.sum(gl.expand_dims(w, 2) * acc, axis=0)
    if HAS_SINKS:
        denom += gl.exp2(sink - m_safe)
    # `!= 0`, not `> 0`: a NaN denominator (NaN query or sink) must give NaN.
    denom_v = gl.expand_dims(gl.convert_layout(denom, gl.SliceLayout(1, OL)), 1) + gl.zeros([NR, D], gl.float32, OL)
    o = gl.where(denom_v != 0.0, gl.div_rn(o, gl.where(denom_v != 0.0, denom_v, 1.0)), 0.0)
    o = gl.where((gl.zeros([NR, D], gl.int32, OL) + real.to(gl.int32)) != 0, o, 0.0)
    ro = gl.arange(0, NR, layout=gl.SliceLayout(1, OL))
    gl.store(out_ptr + row.to(gl.int64) * stride_ot + gl.expand_dims((kv_head * G + ro).to(gl.int64) * stride_oh, 1)
             + gl.expand_dims(d, 0), o.to(gl.bfloat16), mask=gl.expand_dims(ro < G, 1))
    gl.store(ticket, 0)


def slot_key(layout: tq_spec.Layout) -> tuple:
    """A slot format as a hashable key: every field width and offset the kernel reads (not the preset's name)."""
    p = layout.preset
    return (layout.head_dim, p.key_format, p.key_bits, bool(p.norm_correction), layout.key_norm_offset,
            p.value_format, p.value_bits, layout.value_offset, layout.value_scale_offset, layout.value_zero_offset)


def _slot_format(preset: str, head_dim: int = HEAD_DIM) -> tuple:
    """`slot_key` of ``preset``'s slot at ``head_dim``."""
    return slot_key(tq_spec.layout(preset, head_dim))


# The presets whose slots the kernel reads (any preset with the same fields would do), at D = 128 and (decode
# steps) at D = 256.
PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4")
# Pages per loop trip (per warp). H200, CUDA-graph replays, a b a b, one trip of 1 -> 2 pages (us): 4bit_nc
# B=32 x 8k 184 -> 178, B=8 x 32k 182 -> 179, B=128 x 8k 702 -> 690; k3v4_nc 180 -> 175, 178 -> 176,
# 675 -> 668; 3bit_nc 180 -> 178, 178 -> 179, 657 -> 669; k8v4 158 -> 163, 159 -> 159, 629 -> 645.
_UNROLL = {"turboquant_4bit_nc": 2, "turboquant_k3v4_nc": 2, "turboquant_3bit_nc": 1, "turboquant_k8v4": 1}
# Their slot formats at D = 128 and 256 and the kernel's constexprs for each: 3- or 4-bit norm-corrected mse keys
# or fp8 keys, 3- or 4-bit uniform values, fields as int16 word offsets; one page per trip at D = 256 (`D256_*`).
_FORMATS = {}
for _d in (HEAD_DIM, 256):
    for _preset in PRESETS:
        _lay = tq_spec.layout(_preset, _d)
        _FORMATS[slot_key(_lay)] = dict(
            KEY_BITS=8 if _lay.preset.key_format == "fp8" else _lay.preset.key_bits,
            KEY_NORM_WORD=(_lay.key_norm_offset or 0) // 2, VALUE_BITS=_lay.preset.value_bits,
            VALUE_WORD=_lay.value_offset // 2, SCALE_WORD=_lay.value_scale_offset // 2,
            ZERO_WORD=_lay.value_zero_offset // 2, UNROLL=_UNROLL[_preset] if _d == HEAD_DIM else 1, D=_d)
# Process switch (``TQ_GLUON_DECODE=0``): the decode path then always runs the Triton (tq_torch) or Pallas
# (tq_jax) kernels.
ENABLED = os.environ.get("TQ_GLUON_DECODE", "1") != "0"
# Process switch (``TQ_GLUON_FUSED_MERGE=0``): decode steps then merge their splits in
# a second launch (tq_torch) or XLA (tq_jax), as tiles of several tokens always do.
FUSED_MERGE = os.environ.get("TQ_GLUON_FUSED_MERGE", "1") != "0"
# Process switch (``TQ_GLUON_WIDE=0``): 4-bit codes always read by 16-bit loads (`wide_loads`).
WIDE_LOADS = os.environ.get("TQ_GLUON_WIDE", "1") != "0"
# Where wide loads are taken: (slot, several query tokens per tile), where they won. H200, parity.bench rows,
# TQ_GLUON_WIDE=0 / 1, a b a b (ms): decode B=32 x 8k k8v4 0.1662, 0.1656 / 0.1558, 0.1557; q_len 4 4bit_nc
# 0.2517, 0.2525 / 0.2493, 0.2484. Not decode steps of 4bit_nc (0.1845, 0.1851 / 0.1986, 0.1986) or k3v4_nc
# (0.1758, 0.1761 / 0.1892, 0.1872): at the 168-register cap the wide 4bit_nc build spills in its key loop
# (15 spill instructions per trip, 2 without) and the k3v4_nc one needs 9 more registers uncapped (178 -> 187),
# so ptxas keeps fewer loads in flight. 3bit_nc has no 4-bit codes.
WIDE_SLOTS = frozenset({(_slot_format("turboquant_k8v4"), False), (_slot_format("turboquant_4bit_nc"), True)})
# Shared-memory stages per warp of the TMA-staged decode steps (``STAGES``, `_staged_page`): 4bit_nc decode steps at
# D = 128 where `tma_loads` holds (wide loads are off there). H200, B = 32 x 8k, Hq 32 / Hkv 8, CUDA-graph replay
# (us): 16-bit register loads 177.1, 2 stages 160.6, 3 stages 162.4. Process switch ``TQ_GLUON_STAGES`` (0: loads
# from global).
TMA_STAGES = int(os.environ.get("TQ_GLUON_STAGES", "2"))
STAGED_SLOTS = frozenset({_slot_format("turboquant_4bit_nc")})
# Tiles of several query tokens rotate an mse query in the kernel (``ROTATE``); decode steps take it rotated by
# `rotation.rotate_query`. H200, parity.bench, TQ_GLUON_ROTATE=0 / 1, a b a b (ms): q_len 4 B=32 x 8k 4bit_nc
# 0.2340, 0.2338 / 0.2109, 0.2108; but decode steps lost: B=32 x 8k 4bit_nc 0.1856, 0.1849 / 0.2366, 0.2371
# (not the key loop: its sm_90a SASS went 1124 -> 1130 instructions per trip, 2 -> 0 spill instructions),
# 3bit_nc 0.1797, 0.1798 / 0.1838, 0.1841, GQA 8 0.1104, 0.1108 / 0.1147, 0.1148.
# Process switch (``TQ_GLUON_ROTATE=0``): mse queries always rotated by `rotation.rotate_query` first.
ROTATE_IN_KERNEL = os.environ.get("TQ_GLUON_ROTATE", "1") != "0"
# Decode steps merge in the kernel up to this many splits (one round of loads in `_merge_splits`).
# H200, parity.bench decode rows, merge kernel / fused, two runs each (ms): B=32 x 8k (3 splits)
# 4bit_nc 0.1892, 0.1902 / 0.1852, 0.1848 and k8v4 0.1668, 0.1669 / 0.1646, 0.1653; but GQA 8
# (6 splits) 0.1115, 0.1103 / 0.1200, 0.1200 and B=1 x 4k (16 splits) CUDA graph 0.0127, 0.0126 /
# 0.0143, 0.0143: with more rounds the last split's merge outlasts the merge kernel.
FUSED_MERGE_MAX_SPLITS = 4
# The slots whose decode steps merge in the kernel. Not k3v4_nc's: with the merge's call in the kernel its
# key loop spills (3 local loads and stores per trip in the Triton 3.6 sm_90a build; none before), and
# its B=32 x 8k row went 0.1763 -> 0.1868 ms (3bit_nc 0.1812 -> 0.1806, no spill).
MERGES_IN_KERNEL = tuple([_slot_format(p) for p in ("turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k8v4")]
                         + [_slot_format(p, 256) for p in PRESETS])


def ineligible_shape(layout: tq_spec.Layout, *, num_tokens: int, num_seqs: int, num_q_heads: int,
                     kv_cache_shape: tuple) -> Optional[str]:
    """None where the kernel reads this slot format and these static shapes, else why not.

    The frameworks add their own facts: an sm_90 device, bfloat16 query and output (static), no sliding
    window and no soft cap (per call).
    """
    n, page, hkv, _ = kv_cache_shape
    if not ENABLED:
        return "switched off (TQ_GLUON_DECODE=0)"
    slot = _FORMATS.get(slot_key(layout))
    if slot is None:
        return f"reads the {', '.join(PRESETS)} slots at D={HEAD_DIM} (and D=256) only"
    if slot["D"] != HEAD_DIM and num_tokens > num_seqs:
        return f"reads several query tokens per sequence at D={HEAD_DIM} only"
    if page != PAGE_SIZE or n < 1:
        return f"needs {PAGE_SIZE}-slot pages and at least one block"
    if num_q_heads % hkv or num_q_heads // hkv > MAX_GROUP:
        return f"needs a GQA group of at most {MAX_GROUP}"
    return None


def tile_shape(*, num_tokens: int, num_seqs: int, group: int) -> tuple:
    """``(BLOCK_Q, NR)`` of a launch: query tokens per tile and the dots' columns. Decode steps
    (``T <= B``): one token per program, 8 columns. Otherwise (several query tokens per sequence, e.g.
    speculative decoding): the decode path's tile (`tq_spec.dispatch.decode_tile_tokens`: ``16 // G``
    tokens of one sequence), 16 columns, so that each key is decoded once for all of them."""
    return (1, 8) if num_tokens <= num_seqs else (tq_spec.dispatch.decode_tile_tokens(group), 16)


def tma_loads(cache_strides: tuple, base_mod16: int = 0) -> bool:
    """Whether the kernel may stage pages by TMA boxes (``STAGES``): the int16 cache is 16-byte aligned, its pages are
    16 contiguous rows (block stride 16 slot strides) and its rows a multiple of 16 bytes (a box starts 16-byte
    aligned in its row, and a tensor map's row stride is a multiple of 16 bytes). A per-call fact."""
    return base_mod16 == 0 and cache_strides[0] == 16 * cache_strides[1] and cache_strides[1] % 8 == 0


def wide_loads(cache_strides: tuple) -> bool:
    """Whether the kernel may read 4-bit codes with wide loads (``WIDE``): the int16 cache's block and slot
    strides are multiples of 8 bytes, so all slots of a kv head start at one offset mod 8 (a per-call fact)."""
    return cache_strides[0] % 4 == 0 and cache_strides[1] % 4 == 0


def num_splits(*, num_kv_heads: int, num_tokens: int, num_q_heads: int, num_seqs: int, max_context: int,
               sm_count: int, max_splits: int, partials_budget: int, head_dim: int = HEAD_DIM) -> int:
    """Splits per (row, kv head), from static shapes only (CUDA-graph safe), for a GPU of ``sm_count`` SMs, under
    the framework's caps on the decode path's splits and partials (bytes): its ``config._MAX_SPLITS`` and
    ``config._PARTIALS_BUDGET``.

    About 6 programs per SM in all (two waves of `PROGRAMS_PER_SM`) where the batch has 64 or more
    (row, kv head) programs, about 2 per SM for smaller batches, at least `MIN_SPLIT_PAGES` pages per
    split and the partials under budget. H200, CUDA-graph replays, GQA 4 (us, best / this rule):
    B=32 x 8k 182 / 182 (3 splits), B=128 x 8k 689 / 689 (1), B=64 x 4k 187 / 187 (2),
    B=16 x 8k 96 / 102 (6), B=8 x 32k 176 / 180 (12), B=4 x 4k 23.7 / 23.7 (8), B=2 x 8k 23.6 / 23.6
    (16), B=1 x 32k 34.9 at 32 (this rule: 33), B=1 x 4k 14.2 / 14.2 (16). At D = 256 (``head_dim``) one wave
    of `D256_PROGRAMS_PER_SM` instead.
    """
    block_q, _ = tile_shape(num_tokens=num_tokens, num_seqs=num_seqs, group=num_q_heads // num_kv_heads)
    programs = max(1, -(-num_tokens // block_q) * num_kv_heads)
    resident, waves = (PROGRAMS_PER_SM, WAVES) if block_q == 1 else (MULTI_PROGRAMS_PER_SM, MULTI_WAVES)
    if head_dim != HEAD_DIM:
        resident, waves = D256_PROGRAMS_PER_SM, D256_WAVES
    per_sm = resident * waves if programs >= 64 else WAVES
    splits = max(1, round(per_sm * sm_count / programs))
    splits = max(1, min(splits, max_context // (PAGE_SIZE * MIN_SPLIT_PAGES), max_splits))
    per_split = num_tokens * num_q_heads * (head_dim + 2) * 4
    while splits > 1 and splits * per_split > partials_budget:
        splits //= 2
    return splits


class LaunchShape(NamedTuple):
    """What a launch's static shapes decide (`launch_shape`), for either framework's launcher."""

    constexprs: dict  # the kernel's constexprs but ``WIDE``, and launch options (num_warps, maxnreg)
    wide: bool  # wide loads where the cache's strides allow them (`wide_loads`)
    rotates: bool  # the kernel rotates an mse query (``ROTATE``)
    fused: bool  # the last split of each (row, kv head) merges (``FUSED_MERGE``)
    grid: tuple  # (tiles, kv heads, splits)
    part_sizes: tuple  # fp32 elements of the acc ``[T, Hq, S, D]``, m and l ``[T, Hq, S]`` partials
    map_words: int  # fp32 words of the programs' tensor maps (``tma_ws_ptr``: `MAP_WORDS` each; 0: no TMA stages)
    tickets: int  # int32 counters of the fused merge, zero before the launch (0: none)
    splits_pad: int  # the splits as a power of two (the merge's loads)
    max_seq_len: int  # what the block table can address
    slot: dict  # the slot format's constexprs (`_FORMATS`)


def launch_shape(layout: tq_spec.Layout, *, num_tokens: int, num_q_heads: int, num_kv_heads: int, num_seqs: int,
                 max_blocks: int, num_splits: int, has_sinks: bool) -> LaunchShape:
    """The static part of a launch, for a ``layout`` and shapes `ineligible_shape` accepts."""
    key = slot_key(layout)
    slot = _FORMATS[key]
    group = num_q_heads // num_kv_heads
    block_q, nr = tile_shape(num_tokens=num_tokens, num_seqs=num_seqs, group=group)
    d = slot["D"]
    maxnreg = (MAXNREG if d == HEAD_DIM else D256_MAXNREG) if block_q == 1 else MULTI_MAXNREG
    # Decode steps with few splits merge in the kernel (the last split of each row); tiles of several
    # tokens keep the separate merge, which also zeroes the padding rows that no tile reaches.
    fused = FUSED_MERGE and block_q == 1 and num_splits <= FUSED_MERGE_MAX_SPLITS and key in MERGES_IN_KERNEL
    splits_pad = max(2, 1 << (num_splits - 1).bit_length())
    rotates = ROTATE_IN_KERNEL and slot["KEY_BITS"] != 8 and block_q > 1
    wide = WIDE_LOADS and (key, block_q > 1) in WIDE_SLOTS
    # Wide register loads and TMA stages exclude each other (the kernel asserts it); wide loads win where a
    # format is listed for both (say a test forcing `WIDE_SLOTS`).
    staged = block_q == 1 and key in STAGED_SLOTS and not wide
    constexprs = dict(G=group, **slot, BLOCK_Q=block_q, NR=nr, FUSED_MERGE=fused, HAS_SINKS=has_sinks,
                      SPLITS_PAD=splits_pad, ROTATE=rotates, STAGES=TMA_STAGES if staged else 0, num_warps=4,
                      **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    # Tile ids as the decode path numbers them: sequence b's from s[b] // BLOCK_Q + b.
    tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    rows = num_tokens * num_q_heads * num_splits
    grid = (tiles, num_kv_heads, num_splits)
    return LaunchShape(constexprs, wide, rotates, fused, grid, (rows * d, rows, rows),
                       tiles * num_kv_heads * num_splits * MAP_WORDS if staged else 0,
                       tiles * num_kv_heads if fused else 0, splits_pad, max_blocks * PAGE_SIZE, slot)


# `gluon_decode_kernel`'s runtime parameters in order: Triton signature types (its ``*tensors, *scalars``).
# The pointers read come first, those written last (tq_jax passes them as a custom call's operands and results).
KERNEL_POINTERS = ("q_ptr", "cache_ptr", "kcache_ptr", "cb_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr", "sinks_ptr",
                   "rot_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr", "out_ptr", "ticket_ptr", "tma_ws_ptr")
KERNEL_SCALARS = ("stride_qt", "stride_qh", "stride_bt", "stride_cn", "stride_cp", "stride_ch", "k_stride_cn",
                  "k_stride_cp", "k_stride_ch", "num_blocks", "num_splits", "num_q_heads", "num_seqs", "num_tokens",
                  "qk_scale", "max_seq_len", "stride_ot", "stride_oh", "base_mod16", "rot_scale")


def kernel_signature(slot: dict) -> dict:
    """`gluon_decode_kernel`'s runtime parameters as Triton signature types (every integer as ``i32``), for a
    compile without a launch (`triton.compile` of a ``GluonASTSource``); ``slot``: any dict with the slot's
    ``KEY_BITS``."""
    kcache = "*i32" if slot["KEY_BITS"] == 8 else "*i16"
    types = dict(q_ptr="*bf16", cache_ptr="*i16", kcache_ptr=kcache, cb_ptr="*fp32", bt_ptr="*i32",
                 seq_lens_ptr="*i32", qsl_ptr="*i32", sinks_ptr="*fp32", rot_ptr="*bf16", part_acc_ptr="*fp32",
                 part_m_ptr="*fp32", part_l_ptr="*fp32", out_ptr="*bf16", ticket_ptr="*i32", tma_ws_ptr="*fp32")
    pointers = {n: types[n] for n in KERNEL_POINTERS}
    floats = ("qk_scale", "rot_scale")
    return dict(pointers, **{n: "fp32" if n in floats else "i32" for n in KERNEL_SCALARS})
