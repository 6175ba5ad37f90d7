"""In-kernel helpers shared by the attention kernel: page addressing, K/V tile fetch
and decode, and the online-softmax loop over a key range (tq_torch's ``kv_tiles``
translated to Pallas).

Conventions:

* A tile of ``block_m`` rows serves the query heads of one GQA group (and,
  when it fits, several query tokens): row ``r`` is token ``r // G``, group
  head ``r % G``. Every K/V element is decoded once per tile and used by all
  its rows through two dots (``q @ k^T``, ``p @ v``).
* Packed fields are read as contiguous bytes of one slot per key, lanes along
  the slot (`CacheWords.load_bytes`), so each byte is read once and a warp
  reads contiguous memory; codes are split out in registers (joins, no
  gathers). 3-bit streams go through three byte planes.
* The key loop is software-pipelined by hand (``prefetch``): while tile ``i``
  is computed, the raw bytes of tile ``i + 1`` and the block ids of tile
  ``i + 2`` are in flight, carried in the `lax.fori_loop` state. (Byte loads
  that still need a split into codes are not something Triton's pipeliner
  stages; ``num_stages`` > 1 is left to the tile table.)
* Tiles start on multiples of ``block_n`` (`attend_key_range`), so when one
  of ``block_n`` and the page size divides the other the block table is read
  once per page and a key's place in its page needs no per-key division
  (`load_block_ids`, `in_page_offsets`).
* Loads of keys outside ``[k_first, k_hi)``, and of keys whose block id is
  outside ``[0, N)``, are masked: pages the sequence does not own are never
  touched and those keys read as 0 and are not visible. The exception is a key
  loop whose tiles are all masked (the split-KV decode) with quantized values:
  there such keys read page 0 of the cache, with plain unmasked loads, and the
  selects on the visibility keep what they read out of every row
  (`attend_key_range`). Scores of keys a row
  may not see become -inf with `jnp.where` (not a multiply), values enter
  ``P @ V`` as ``(P * scale) @ codes + P @ zero`` with ``P`` zeroed by
  `jnp.where` on the visibility, so NaN/Inf garbage cannot reach a row that
  does not see it. Extend tiles whose keys every valid row sees skip these
  checks (`attend_key_range`).
* Keys are scored in the rotated basis for mse presets: ``s = scale *
  factor * (q_rot . c[code])`` with ``factor = norm / ||c||`` (norm
  correction) or ``norm``, one multiply per key after the dot.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from tq_spec import Layout

from . import kernel_math as km
from .cache_access import CacheWords

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class TileSpec:
    """Static description of the key/value tiles one kernel reads."""

    lay: Layout
    access: CacheWords
    block_size: int  # P, tokens per page
    num_blocks: int  # N, pages in the cache (a block id outside [0, N) masks its keys)
    max_blocks: int  # block-table columns per sequence
    block_n: int  # keys per tile: a power of two, >= 16 where a dot takes the tile
    head_dim_padded: int  # power of two >= head_dim (and >= 32)
    compute_dtype: str  # dtype of the dot operands (the query dtype)
    prefetch: bool  # hand-pipelined key loop
    use_ptx: bool  # inline PTX (GPU lowering): IEEE division, ex2.approx; jnp in interpret mode
    fp8_convert: bool = True  # fp8 keys by a hardware cast (sm_89+), else the integer decode
    shuffle_lookup: bool = False  # mse keys by warp shuffles (GPU lowering), else gathers
    # 4-bit mse keys of a default codebook: its 16 shuffle-table entries as constants
    # (`constant_key_entries`); the keys are then read as bytes. None: entries read in the kernel.
    key_entries: tuple | None = None

    @property
    def head_dim(self) -> int:
        return self.lay.head_dim

    def field_bits(self, part: str) -> int:
        """Bits per stored element of the key or value field: 16 raw, 8 fp8, else the code width."""
        p = self.lay.preset
        if part == "key":
            return {"raw": 16, "fp8": 8}.get(p.key_format, p.key_bits)
        return 16 if p.value_format == "raw" else p.value_bits


class RawTile(NamedTuple):
    """The loaded, not yet decoded fields of one K/V tile (the prefetch carry); each is a tuple
    of what `fetch_kv_tile` loaded for its code width:

    * 3-bit codes: three byte planes ``[BN, Dp / 8]``;
    * 4-bit codes: int32 16-bit words ``[BN, Dp / 4]`` (bytes ``[BN, Dp / 2]`` for keys read
      with constant table entries, `TileSpec.key_entries`);
    * 8-bit codes: bytes ``[BN, Dp]``;
    * raw 16-bit elements: ``[BN, Dp]`` in the cache's float dtype for a float16/bfloat16
      view (the dequant workspace), else int32 16-bit words (`CacheWords.load_halves`).
    """

    key: tuple
    key_norm: object  # int32 [BN] fp16 bits, or None
    value: tuple  # as `key`
    value_scale: object  # int32 [BN] fp16 bits, or None
    value_zero: object


_MAX_SCALAR_PAGES = 4  # `load_block_ids`: pages per tile read as scalars (more: one gather)


def load_block_ids(spec: TileSpec, bt_ref, b, start, k_hi):
    """Block ids ``[BN]`` int32 of key positions ``start + arange(BN)`` of sequence `b`; -1 past `k_hi`.

    `start` is a multiple of ``block_n`` (`attend_key_range` aligns its tiles). When one of
    ``block_n`` and the page size divides the other, a tile is inside one page or covers whole
    pages, and the block table is read once per page: one scalar load, or loads that share
    address and mask within a page (so they are one), not one per key. A block id outside
    ``[0, N)`` (bad metadata, or a dequant workspace's unused entry) also comes back as -1:
    the caller masks that key, so no load leaves the cache (the metadata guard tq_torch has
    too).
    """
    page, bn = spec.block_size, spec.block_n
    lane = lax.broadcasted_iota(jnp.int32, (bn,), 0)
    # The page size is static (one compile per page size); columns are clamped so that
    # even a masked load's address stays inside the block table.
    if page % bn == 0:
        col = jnp.minimum(km.div_nonneg(start, page), spec.max_blocks - 1)
        blk = pltriton.load(bt_ref.at[b, col], mask=start < k_hi, other=-1)
    elif bn % page == 0 and bn // page <= _MAX_SCALAR_PAGES:
        # One scalar load per page, selected per key: a [BN] gather would be issued once per
        # layout the ids are used in and per key a thread holds.
        in_tile = km.div_nonneg(lane, page)
        col0 = km.div_nonneg(start, page)
        blk = jnp.full((bn,), -1, jnp.int32)
        for j in range(bn // page):
            col = jnp.minimum(col0 + j, spec.max_blocks - 1)
            blk_j = pltriton.load(bt_ref.at[b, col], mask=start + j * page < k_hi, other=-1)
            blk = jnp.where(in_tile == j, blk_j, blk)
    elif bn % page == 0:
        in_tile = km.div_nonneg(lane, page)
        col = jnp.minimum(km.div_nonneg(start, page) + in_tile, spec.max_blocks - 1)
        blk = pltriton.load(bt_ref.at[b, col], mask=start + in_tile * page < k_hi, other=-1)
    else:
        keys = start + lane
        col = jnp.minimum(km.div_nonneg(keys, page), spec.max_blocks - 1)
        blk = pltriton.load(bt_ref.at[b, col], mask=keys < k_hi, other=-1)
    blk = jnp.where((blk >= 0) & (blk < spec.num_blocks), blk, -1)
    return jnp.where(start + lane < k_hi, blk, -1)


def in_page_offsets(spec: TileSpec, start):
    """int32 ``[BN]``: the place in its page of each key ``start + arange(BN)`` (tq_torch's
    ``slot_word_offsets``; here the cache ref is indexed by block id and this offset).

    `start` is a multiple of ``block_n``, so when one of ``block_n`` and the page size
    divides the other a key's place in its page is ``lane % P`` (loop-invariant) or
    ``start % P + lane``; otherwise one division per key.
    """
    page, bn = spec.block_size, spec.block_n
    lane = lax.broadcasted_iota(jnp.int32, (bn,), 0)
    if page % bn == 0:
        return lane + km.rem_nonneg(start, page)
    if bn % page == 0:
        return km.rem_nonneg(lane, page)
    return km.rem_nonneg(start + lane, page)


def fetch_kv_tile(spec: TileSpec, cache_ref, blk, start, kv_head, valid) -> RawTile:
    """Issues every load of the K/V tile of positions ``start + arange(BN)`` (block ids `blk`, keys
    with `valid` False read nothing); nothing is decoded, so the loads stay in flight.

    ``valid=None``: every key reads (every id in `blk` must name a page of the cache); the
    loads are then plain loads, without the zeroing and merge a masked 16-bit load costs.
    """
    lay, acc = spec.lay, spec.access
    p = lay.preset
    d, dp = spec.head_dim, spec.head_dim_padded
    off = in_page_offsets(spec, start)

    def field(byte0, bits, as_bytes=False):
        if bits == 3:
            return acc.load_byte_planes(cache_ref, blk, off, kv_head, byte0, dp // 8, d // 8, valid)
        if bits == 4 and not as_bytes:  # 16-bit words: four codes each, split by shifts alone
            return (acc.load_words(cache_ref, blk, off, kv_head, byte0, dp // 4, d // 4, valid),)
        if bits == 16:  # fp16/bf16 elements
            return (acc.load_halves(cache_ref, blk, off, kv_head, byte0, dp, d, valid),)
        return (acc.load_bytes(cache_ref, blk, off, kv_head, byte0, dp * bits // 8, d * bits // 8, valid),)

    def half(byte):
        return None if byte is None else acc.load_half(cache_ref, blk, off, kv_head, byte, valid)

    key = field(lay.key_offset, spec.field_bits("key"), as_bytes=spec.key_entries is not None)
    norm = half(lay.key_norm_offset) if p.key_format == "mse" else None
    value = field(lay.value_offset, spec.field_bits("value"))
    uniform = p.value_format != "raw"
    return RawTile(key, norm, value, half(lay.value_scale_offset) if uniform else None,
                   half(lay.value_zero_offset) if uniform else None)


def _codes(raw_field, bits):
    if bits == 3:
        return km.codes_from_byte_planes(*raw_field)
    if bits == 4:
        return km.codes_from_words(raw_field[0], 4)
    return raw_field[0].astype(jnp.int32)  # 8-bit codes: the bytes


def key_tables(centroids, bits: int, compute_dtype, norm_correction: bool):
    """Lookup tables of the mse key decode (plain jnp, outside the kernel): uint32 ``[3, 4**bits]``.

    16-bit compute dtypes, one entry per code ``i < 2**bits`` (the rest 0):

    * row 0: ``bits(c[i])`` in the compute dtype, ORed with the float16 bits of ``(r * c[i])**2``
      shifted up by 16 (`decode_key_tile` takes both halves from one warp shuffle);
    * row 1: the float32 bits of ``r``, a power of two with ``r * max|c|`` in ``[1, 2)``, in every
      entry. ``(r * ||c||)**2`` is summed from the float16 squares by a tensor-core dot: the
      scaling is exact and keeps any codebook's squares inside float16's range, and rounding a
      square to float16 moves the norm factor by < 2**-12 relative, far below the rounding of
      the scores' operands (tq_torch's `key_square_scale` is the same);
    * row 2: 0.

    float32, indexed by a pair of codes (``2 * bits`` bits: ``lo = i & (2**bits - 1)``, the even
    element, and ``hi = i >> bits``; for 4-bit keys a whole byte, for 3-bit keys a 6-bit field
    of the 24-bit group word): row 0 ``bits(c[lo])``, row 1 ``bits(c[hi])``, row 2
    ``c[lo]**2 + c[hi]**2`` (0 without norm correction).

    The rounding of a centroid to the compute dtype is the one the dot would
    apply, so the scores are those of ``q . c[code]`` with rounded operands.
    """
    n = 1 << (2 * bits)
    i = jnp.arange(n, dtype=jnp.int32)
    zero = jnp.zeros((n,), jnp.uint32)
    if jnp.dtype(compute_dtype).itemsize == 2:
        def half(x, dtype):
            return lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32)

        c = centroids[: 1 << bits].astype(jnp.float32)
        exp_bits = lax.bitcast_convert_type(jnp.max(jnp.abs(c)), jnp.uint32) & jnp.uint32(0x7F800000)
        r_bits = jnp.uint32(0x7F000000) - exp_bits  # 2**-(e - 127)
        r = lax.bitcast_convert_type(r_bits, jnp.float32)
        entry = half(c, compute_dtype) | (half(jnp.square(r * c), jnp.float16) << 16)
        return jnp.stack([zero.at[: 1 << bits].set(entry),
                          jnp.full((n,), r_bits, jnp.uint32), zero])
    lo = centroids[i & ((1 << bits) - 1)].astype(jnp.float32)
    hi = centroids[i >> bits].astype(jnp.float32)
    return jnp.stack([lax.bitcast_convert_type(lo, jnp.uint32), lax.bitcast_convert_type(hi, jnp.uint32),
                      lax.bitcast_convert_type(lo * lo + hi * hi, jnp.uint32) if norm_correction else zero])


def constant_key_entries(centroids, key_bits: int, compute_dtype, norm_correction: bool):
    """`key_tables`' row-0 entries (16-bit compute dtypes), computed on the host: a tuple of
    ``2**key_bits`` int32 Python ints, the same bits `key_tables` gives on the device.

    For `TileSpec.key_entries`: a kernel built with them holds the table as constants.
    ``centroids``: numpy float32 ``[>= 2**key_bits]``.
    """
    c = np.asarray(centroids, np.float32)[: 1 << key_bits]
    exp_bits = np.asarray(np.max(np.abs(c)), np.float32).view(np.uint32) & np.uint32(0x7F800000)
    r = np.asarray(np.uint32(0x7F000000) - exp_bits, np.uint32).view(np.float32)  # 2**-(e - 127)
    low = np.asarray(c, jnp.dtype(compute_dtype)).view(np.uint16).astype(np.uint32)
    high = np.asarray(np.square(r * c), np.float16).view(np.uint16).astype(np.uint32)
    return tuple(int(x) for x in (low | (high << np.uint32(16))).view(np.int32))


def lane_entries(spec: TileSpec, tab_ref):
    """The 16-bit per-code entries of `key_tables` as int32 scalars, read once before the key loop
    (`decode_key_tile`'s warp-shuffle lookup); None where the lookup is a gather."""
    p = spec.lay.preset
    if p.key_format != "mse" or not spec.shuffle_lookup or jnp.dtype(spec.compute_dtype).itemsize != 2:
        return None
    return [lax.bitcast_convert_type(tab_ref[0, k], jnp.int32) for k in range(1 << p.key_bits)]


def _pair_indices(raw_field, bits):
    """Code-pair indices ``[BN, Dp/2]`` in element order (pair ``j`` = elements ``2j, 2j+1``).

    4-bit keys: the bytes themselves. 3-bit keys: the four 6-bit fields of
    each 24-bit group word, interleaved (integer joins; the lookup that
    follows yields floats in a plain layout).
    """
    if bits == 4:
        return km.words_to_bytes(raw_field[0])
    return km.interleave_fields([x & 63 for x in km.unmasked_fields(km.group_words(*raw_field), 6, 4)])


def key_parts(spec: TileSpec) -> int:
    """How many column parts the key tile comes in: 2 (even, odd elements) for mse keys, else 1."""
    return 2 if spec.lay.preset.key_format == "mse" else 1


def load_query_parts(spec: TileSpec, q_ref, t_idx, h_idx, row_valid):
    """Query rows as dot operands matching `decode_key_tile`'s parts (0 in padding rows / lanes).

    ``t_idx, h_idx [M, 1]`` (unclamped; masked rows read nothing). mse keys
    come as even and odd elements (``[M, Dp/2]`` each: the split dot), so the
    query is read the same way; otherwise one ``[M, Dp]`` part.
    """
    dp, d = spec.head_dim_padded, spec.head_dim
    parts = key_parts(spec)
    lane = lax.broadcasted_iota(jnp.int32, (1, dp // parts), 1)
    out = []
    for j in range(parts):
        col = parts * lane + j
        q = pltriton.load(q_ref.at[t_idx, h_idx, col], mask=row_valid[:, None] & (col < d), other=0)
        out.append(q.astype(spec.compute_dtype))
    return tuple(out)


def decode_key_tile(spec: TileSpec, raw: RawTile, tab_ref, rows: int, entries=None):
    """Keys in scoring space: ``(parts, factor)``; score = factor * sum_j (q_j . parts_j).

    Raw and fp8 keys: one part ``[BN, Dp]`` in the compute dtype, factor None.
    mse keys: the centroids (rounded to the compute dtype) of the even and of
    the odd elements, ``[BN, Dp/2]`` each; the two halves feed two dots (the
    "split dot"), so no float tile is ever interleaved. factor is ``norm /
    ||c||`` (norm correction) or ``norm``. Lanes ``>= head_dim`` meet zero
    query lanes (and are left out of the norm).

    16-bit compute dtypes: each element is one warp shuffle of the lane that holds its code's
    `key_tables` entry (``entries``, from `lane_entries`; interpret mode gathers the same
    entries), which brings the centroid and its float16 square. With norm correction the
    factor is ``[rows, BN]`` (all rows equal): ``||c||**2`` comes from tensor-core dots of a
    ones tile with the squares, laid out like the ``[rows, BN]`` score tile, so no cross-lane
    row sum runs. float32: two gathers per pair of elements from the 1 KB pair table, factor ``[BN]``.
    """
    p = spec.lay.preset
    cdt = spec.compute_dtype
    if p.key_format == "raw":
        return (km.half_words_to_float(raw.key[0], p.raw_dtype, cdt),), None
    if p.key_format == "fp8":
        if spec.fp8_convert:
            return (km.fp8_bytes_to_float(raw.key[0], cdt),), None
        return (km.fp8_e4m3fn_decode(raw.key[0].astype(jnp.int32)).astype(cdt),), None
    bits = p.key_bits
    half_pairs = spec.head_dim // 2  # pairs past the head hold code 0
    norm = km.half_words_to_float(raw.key_norm, "float16", jnp.float32)
    if jnp.dtype(cdt).itemsize == 2:
        name = jnp.dtype(cdt).name
        # Each element is its field shifted down, unmasked (the lookup masks, see below):
        # 4 bits: element 4i + j is field j of 16-bit word i; 3 bits: element 8g + j is field j
        # of group g's 24-bit word. Even and odd elements come from the even and odd fields.
        if spec.key_entries is not None:
            # Key bytes: element 2j is the low nibble of byte j, element 2j + 1 its high nibble.
            # Every step from the loaded bytes to the dots is elementwise with the same shift for
            # every element, and the table entry comes from constants inside the loop, so Triton
            # moves the MMA layout conversion onto the byte tile: no decoded key tile crosses
            # shared memory (steps.md, session 28).
            key_bytes = raw.key[0].astype(jnp.int32)
            even, odd = key_bytes, lax.shift_right_logical(key_bytes, 4)
        else:
            if bits == 4:
                fields = km.unmasked_fields(raw.key[0], 4, 4)
            else:
                fields = km.unmasked_fields(km.group_words(*raw.key), 3, 8)
            even, odd = km.interleave_fields(fields[0::2]), km.interleave_fields(fields[1::2])
        if spec.key_entries is not None and spec.shuffle_lookup:
            entry = km.lane_table_entry(spec.key_entries, even.shape, like=even)

            def lookup(codes):
                return km.shuffle_lookup(codes, entry)
        elif entries is not None:
            # A shuffle reads only the lane bits of its index: lanes l and l + 2**bits hold the
            # same entry, so the higher code bits need no mask.
            entry = km.lane_table_entry(entries, even.shape)

            def lookup(codes):
                return km.shuffle_lookup(codes, entry)
        else:
            def lookup(codes):
                return lax.bitcast_convert_type(tab_ref[0, codes & ((1 << bits) - 1)], jnp.int32)

        def split(e):
            return (km.half_words_to_float(e & 0xFFFF, name, cdt),
                    km.half_words_to_float(lax.shift_right_logical(e, 16), "float16", jnp.float16))

        (k_even, sq_even), (k_odd, sq_odd) = split(lookup(even)), split(lookup(odd))
        if not p.norm_correction:
            return (k_even, k_odd), norm
        j = lax.broadcasted_iota(jnp.int32, (rows, even.shape[1]), 1)
        ones = jnp.where(j < half_pairs, 1.0, 0.0).astype(jnp.float16)
        norm_sq = _dot(ones, sq_even, 1, jnp.float16) + _dot(ones, sq_odd, 1, jnp.float16)  # (r ||c||)**2
        r = lax.bitcast_convert_type(tab_ref[1, 0], jnp.float32)
        # rsqrt is within 2 ulp: far below the rounding of the keys to the compute dtype.
        return (k_even, k_odd), norm[None, :] * (lax.rsqrt(jnp.where(norm_sq > 0.0, norm_sq, 1.0)) * r)
    idx = _pair_indices(raw.key, bits)
    parts = (lax.bitcast_convert_type(tab_ref[0, idx], jnp.float32),
             lax.bitcast_convert_type(tab_ref[1, idx], jnp.float32))
    if not p.norm_correction:
        return parts, norm
    sq2 = lax.bitcast_convert_type(tab_ref[2, idx], jnp.float32)
    if spec.head_dim_padded != spec.head_dim:
        j = lax.broadcasted_iota(jnp.int32, sq2.shape, 1)
        sq2 = jnp.where(j < half_pairs, sq2, 0.0)
    sq = jnp.sum(sq2, axis=1)
    return parts, km.ieee_div(norm, jnp.sqrt(jnp.where(sq > 0.0, sq, 1.0)), use_ptx=spec.use_ptx)


# 16-bit float bit patterns ``BITS | c`` that are exactly ``BIAS + c`` for every 7-bit code ``c``.
_BIASED_CODE_BITS = {"bfloat16": (0x4300, 128.0), "float16": (0x6400, 1024.0)}


def decode_value_tile(spec: TileSpec, raw: RawTile):
    """Values as ``(v [BN, Dp] compute dtype, scale [BN], zero [BN], bias)``, value = (v - bias) * scale + zero.

    Uniform codes come back as the integer codes plus ``bias`` (exact in any dot dtype) and
    the fp16 scale/zero as float32, so the caller folds the scale into P and
    the zero into one row sum, and takes ``bias * sum(P * scale)`` back out. With a 16-bit
    compute dtype the biased code is its bit pattern ``BITS | c`` (one OR per element, where
    an int -> float conversion issues at a quarter of the integer rate); float32 takes the
    codes themselves (bias 0). Raw values come back as they are, scale and zero None, bias 0.
    Masked keys read 0 everywhere.
    """
    p = spec.lay.preset
    cdt = spec.compute_dtype
    if p.value_format == "raw":
        return km.half_words_to_float(raw.value[0], p.raw_dtype, cdt), None, None, 0.0
    name = jnp.dtype(cdt).name
    if name not in _BIASED_CODE_BITS:
        v, bias = _codes(raw.value, p.value_bits).astype(cdt), 0.0
    elif p.value_bits == 4 and spec.use_ptx:  # two elements per few instructions, straight from the words
        bits, bias = _BIASED_CODE_BITS[name]
        v = km.biased_nibble_operand(raw.value[0], cdt, bits)
    else:
        bits, bias = _BIASED_CODE_BITS[name]
        v = km.half_words_to_float(_codes(raw.value, p.value_bits) | bits, name, cdt)
    scale = km.half_words_to_float(raw.value_scale, "float16", jnp.float32)
    zero = km.half_words_to_float(raw.value_zero, "float16", jnp.float32)
    return v, scale, zero, bias


def _dot(a, b, contract_b: int, compute_dtype):
    # float32 operands must not silently become TF32 on the GPU: HIGHEST makes
    # the Triton lowering emit an IEEE fp32 dot.
    prec = lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None
    return lax.dot_general(a.astype(compute_dtype), b.astype(compute_dtype), (((1,), (contract_b,)), ((), ())),
                           precision=prec, preferred_element_type=jnp.float32)


def _hidden_safe_raw_values(v, _hidden):
    """``(v with NaN/Inf entries as 0, whether it had any)``: ``v [BN, Dp]`` float.

    The `lax.cond` branch for tiles some rows cannot fully see; the other branch returns
    ``(v, hidden)`` (False there: a branch must yield traced values, not a constant)."""
    finite = jnp.isfinite(v)
    # (A sum, not jnp.all: Pallas' Triton lowering has no reduce_and.)
    return jnp.where(finite, v, 0.0), jnp.sum(jnp.where(finite, 0, 1)) > 0


def _add_nonfinite_values(acc, prob, v, seen_of, compute_dtype):
    """``acc [M, Dp]`` plus what the NaN/Inf entries of raw values ``v [BN, Dp]`` give visible keys.

    ``prob [M, BN]`` is 0 where a key is not visible, but a plain dot would still give a row
    ``0 * NaN`` from a key it cannot see (a later token, an out-of-window one); DESIGN.md says
    masked keys never leak. The dot ran on the finite values; a loop over the tile's keys adds,
    per row and lane, what IEEE products over the visible keys give: NaN where a value is NaN or
    an Inf meets ``prob = 0`` (as a dot operand), else +Inf / -Inf (both: NaN). ``seen_of(j)``:
    bool ``[M]``, which rows see key ``j``. Only ``acc`` and vectors are live in the loop (a
    second ``[M, Dp]`` tensor would cost the tile registers).
    """
    p_op = prob.astype(compute_dtype)
    v_op = v.astype(compute_dtype)  # raw values: exact in the compute dtype
    lane = lax.broadcasted_iota(jnp.int32, (v.shape[0],), 0)

    def body(j, acc):
        v_j = jnp.sum(jnp.where((lane == j)[:, None], v_op, 0.0), axis=0).astype(jnp.float32)
        p_j = jnp.sum(jnp.where((lane == j)[None, :], p_op, 0.0), axis=1).astype(jnp.float32)
        seen = seen_of(j)
        inf_j = jnp.isinf(v_j)
        acc = acc + jnp.where((seen & (p_j != 0.0))[:, None] & inf_j[None, :], v_j[None, :], 0.0)
        nan_j = (seen[:, None] & jnp.isnan(v_j)[None, :]) | ((seen & (p_j == 0.0))[:, None] & inf_j[None, :])
        return jnp.where(nan_j, jnp.nan, acc)

    return lax.fori_loop(0, v.shape[0], body, acc)


def attend_key_range(spec: TileSpec, q, state, pos, row_valid, k_first, k_lo, k_hi, *, cache_ref, bt_ref,
                     tab_ref, b, kv_head, scale: float, soft_cap: float | None, window: int | None,
                     unmasked_tiles: bool = True):
    """Online softmax of query rows over keys ``[max(k_first, k_lo), k_hi)`` of sequence `b`.

    ``k_lo`` is a multiple of ``block_n`` (tiles then sit on whole pages, see `load_block_ids`).
    Keys of the first tile below ``k_first`` are masked (they belong to no row; not even a
    ``0 * NaN`` of a raw value may reach the output; their loads are masked too). Only the
    first tile can hold such keys: the hand-pipelined loop checks tile 0's block ids once, the
    plain loop each tile's (one compare and select per key); without a window ``k_first`` is 0
    and nothing is checked.

    ``unmasked_tiles``: three loops over the tiles, as tq_torch's: those at the window edge and
    those on the diagonal check each score's visibility; the tiles between, whose keys every
    valid row sees, skip the causal and window checks and the hidden-value handling (a key of
    a masked page was loaded as zeros; its score gets -inf added). Padding rows take part
    there with zero queries; their results are never stored. False: one loop, every tile
    checked (split-KV decode: measured faster there, see `attention_kernel`).

    ``q``: `load_query_parts` (a tuple of compute-dtype ``[M, Dp / parts]``).

    ``state = (m, l, acc)``: float32 ``[M]``, ``[M]``, ``[M, Dp]`` (natural-log
    domain in and out; the loop keeps ``m`` in the log2 domain, as tq_torch's kernels
    do; ``m`` is -inf until a row sees a key). ``pos [M]``: each row's
    absolute query position; key ``j`` is visible iff ``j <= pos`` (and
    ``j > pos - window``). Returns the updated state, unnormalised.
    """
    bn = spec.block_n
    cdt = spec.compute_dtype
    # exp2 of log2-domain scores: one MUFU.EX2 per element (`kernel_math.exp2`), where exp is
    # libdevice's accurate expf (about ten instructions). The soft cap applies to the plain logits.
    score_scale = scale if soft_cap is not None else scale * LOG2E
    lane = lax.broadcasted_iota(jnp.int32, (bn,), 0)
    k_lo = jnp.asarray(k_lo, jnp.int32)
    n_tiles = km.div_nonneg(jnp.maximum(k_hi - k_lo, 0) + bn - 1, bn)
    # Valid rows' first and last positions: a tile whose keys all sit in [pos_last - window + 1,
    # pos_first] is visible to every valid row.
    pos_first = jnp.min(jnp.where(row_valid, pos, jnp.iinfo(jnp.int32).max))
    pos_last = jnp.max(jnp.where(row_valid, pos, -1))

    entries = lane_entries(spec, tab_ref)

    def block_ids(start):
        return load_block_ids(spec, bt_ref, b, start, k_hi)

    def window_block_ids(start):
        # Tiles start on a multiple of block_n: keys before k_first are no row's.
        blk = block_ids(start)
        return blk if window is None else jnp.where(start + lane >= k_first, blk, -1)

    # When every tile is masked (scores by `jnp.where` on the visibility, P and the value
    # scale/zero terms too) and values are quantized, a key that is not visible may read any
    # page: keys with no block id read page 0 (inside the cache) and their loads need no mask.
    # Raw values stay masked (a plain dot would meet their garbage as 0 * NaN), and so do the
    # loads of the three-loop form, whose unmasked tiles rely on masked keys reading zeros.
    any_page = not unmasked_tiles and spec.lay.preset.value_format != "raw" and spec.num_blocks > 0

    def fetch(blk, start):
        if any_page:
            return fetch_kv_tile(spec, cache_ref, jnp.maximum(blk, 0), start, kv_head, None)
        return fetch_kv_tile(spec, cache_ref, blk, start, kv_head, blk >= 0)

    def compute(start, blk, raw, m, l, acc, masked: bool):
        keys = start + lane
        valid = blk >= 0  # in [max(k_first, k_lo), k_hi) with a block id inside the cache
        ks, factor = decode_key_tile(spec, raw, tab_ref, q[0].shape[0], entries)
        s = _dot(q[0], ks[0], 1, cdt)
        for qj, kj in zip(q[1:], ks[1:]):
            s = s + _dot(qj, kj, 1, cdt)
        # Scores in the log2 domain (`score_scale`), so the softmax is exp2.
        if factor is None:
            s = s * score_scale
        else:
            s = s * (factor * score_scale if factor.ndim == 2 else (factor * score_scale)[None, :])
        if soft_cap is not None:
            # On the scaled logits, before masking (DESIGN.md section 3).
            s = (soft_cap * LOG2E) * jnp.tanh(s / soft_cap)
        if masked:
            visible = valid[None, :] & row_valid[:, None] & (keys[None, :] <= pos[:, None])
            if window is not None:
                visible = visible & (keys[None, :] > pos[:, None] - window)
            s = jnp.where(visible, s, -jnp.inf)
        else:
            s = s + jnp.where(valid, 0.0, -jnp.inf)[None, :]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row that has seen no visible key keeps m = -inf; shift by 0 instead
        # so exp2() sees -inf - 0 (-> 0), never -inf - -inf (NaN).
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = km.exp2(m - m_safe, use_ptx=spec.use_ptx)
        prob = km.exp2(s - m_safe[:, None], use_ptx=spec.use_ptx)
        l = l * alpha + jnp.sum(prob, axis=1)
        v, v_scale, v_zero, bias = decode_value_tile(spec, raw)
        if v_scale is None and not masked:
            pv = _dot(prob, v, 0, cdt)
        elif v_scale is None:
            # prob is exactly 0 where a key is not visible; raw values of such keys go
            # through `_hidden_safe_raw_values` (tiles on the diagonal or the window edge).
            hidden = (start + bn - 1 > pos_first) if window is None else \
                (start + bn - 1 > pos_first) | (start <= pos_last - window)
            v_raw = v
            v, fix = lax.cond(hidden, _hidden_safe_raw_values, lambda x, h: (x, h), v_raw, hidden)

            def seen_of(j):
                key = start + j
                ok = row_valid & (jnp.sum(jnp.where(lane == j, valid, False).astype(jnp.int32)) > 0) & (key <= pos)
                return ok if window is None else ok & (key > pos - window)

            pv = _dot(prob, v, 0, cdt)
            pv = lax.cond(fix, lambda x: _add_nonfinite_values(x, prob, v_raw, seen_of, cdt), lambda x: x, pv)
        else:
            # P @ (codes * scale + zero) = (P * scale) @ (codes + bias) + P @ zero - bias * sum(P * scale),
            # the last two in one row sum (over the rounded operands the dot saw); `where` on the
            # visibility, not the product alone: a scale or zero a row may not see (NaN/Inf)
            # must not reach it as 0 * NaN.
            p_scaled = prob * v_scale[None, :]
            row_terms = prob * v_zero[None, :]
            if masked:
                p_scaled = jnp.where(visible, p_scaled, 0.0)
                row_terms = jnp.where(visible, row_terms, 0.0)
            p_scaled = p_scaled.astype(cdt)
            if bias:
                row_terms = row_terms - bias * p_scaled.astype(jnp.float32)
            # One add onto the dot's result: Triton's combine pass makes it the dot's accumulator.
            acc = acc * alpha[:, None] + jnp.sum(row_terms, axis=1)[:, None]
            return m_new, l, _dot(p_scaled, v, 0, cdt) + acc
        return m_new, l, acc * alpha[:, None] + pv

    # Tiles k_lo + i * bn for i in [i_mid, i_diag) hold only keys every valid row sees.
    all_lo = k_first if window is None else jnp.maximum(k_first, pos_last - window + 1)
    all_hi = jnp.minimum(pos_first, k_hi - 1) + 1
    i_mid = jnp.minimum(km.div_nonneg(jnp.maximum(all_lo - k_lo, 0) + bn - 1, bn), n_tiles)
    i_diag = jnp.minimum(i_mid + km.div_nonneg(jnp.maximum(all_hi - (k_lo + i_mid * bn), 0), bn), n_tiles)
    loops = ((0, i_mid, True), (i_mid, i_diag, False), (i_diag, n_tiles, True)) if unmasked_tiles else \
        ((0, n_tiles, True),)

    m, l, acc = state
    m = m * LOG2E  # the loop's running max is in the log2 domain
    if not spec.prefetch:
        def body(i, carry, masked):
            m, l, acc = carry
            start = k_lo + i * bn
            blk = window_block_ids(start)
            return compute(start, blk, fetch(blk, start), m, l, acc, masked)

        carry = (m, l, acc)
        for lo, hi, masked in loops:
            carry = lax.fori_loop(lo, hi, functools.partial(body, masked=masked), carry)
        m, l, acc = carry
        return m * LN2, l, acc

    def body_prefetch(i, carry, masked):
        m, l, acc, raw, blk, blk_next = carry
        start = k_lo + i * bn
        # Tile i+1's bytes (its block ids arrived during tile i-1) and tile
        # i+2's block ids are in flight while tile i is computed.
        raw_next = fetch(blk_next, start + bn)
        blk_after = block_ids(start + 2 * bn)
        m, l, acc = compute(start, blk, raw, m, l, acc, masked)
        return m, l, acc, raw_next, blk_next, blk_after

    # Prologue: tile 0's bytes, tile 1's block ids (all masked when the range is empty).
    # Only tile 0 can hold keys before k_first.
    blk0 = window_block_ids(k_lo)
    carry = (m, l, acc, fetch(blk0, k_lo), blk0, block_ids(k_lo + bn))
    for lo, hi, masked in loops:
        carry = lax.fori_loop(lo, hi, functools.partial(body_prefetch, masked=masked), carry)
    m, l, acc, *_ = carry
    return m * LN2, l, acc
