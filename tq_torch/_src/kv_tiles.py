"""Device functions shared by the attention kernels: page addressing, K/V tile
fetch and dequantisation, and the online-softmax loop over a key range.

Conventions (both kernels):
* A tile of ``BLOCK_M`` rows serves several query heads of one GQA group (and,
  when it fits, several query tokens): row ``r`` is token ``r // G``, group
  head ``r % G``. Every K/V element is dequantised once per tile and used by
  all its rows through ``tl.dot``.
* Packed fields are read as whole 16-bit words (slots are only 2-byte
  aligned) with a warp's lanes along one slot, so a warp reads contiguous
  bytes; each byte is read once and split into codes in registers.
* For packed formats the key loop is software-pipelined by hand
  (``PREFETCH``): while tile ``i`` is computed, the raw words of tile
  ``i + 1`` and the block ids of tile ``i + 2`` are in flight. (Triton's own
  pipeliner cannot stage 2-byte loads through cp.async, and staging the
  centroid gather through shared memory is what made the earlier kernel
  slow.) Raw 16-bit tiles use Triton's pipeliner instead. With fp8 keys
  (``L2_PREFETCH``) each tile also asks L2 for the lines of tile ``i + 2``.
* Scores live in the log2 domain (``s * log2(e)``) so the softmax uses exp2;
  ``m`` (running max) is -inf until a row sees a key, guarded so -inf - -inf
  never produces NaN.
* Loads of keys outside ``[k_lo, k_hi)`` are masked, or, with ``ANY_PAGE``
  (`attention_kernel.any_page`), read page 0 of the cache unpredicated and are
  kept out of every row by selects (no load ever leaves the cache); values
  enter P @ V through ``P * scale`` and
  ``P @ zero`` with P zeroed where a key is not visible, so garbage (NaN/Inf)
  scales or zeros of masked keys cannot reach the output as ``0 * NaN``; raw
  values of keys that some rows of a tile may not see go through
  `masked_raw_value_dot` for the same reason.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_math import (biased_code_operand, biased_nibble_operand, dot, dot_operand, mma_operand,
                          prefetch_l2, table_lookup, table_lookup_with_squares, tanh_f32)

LOG2E = tl.constexpr(1.4426950408889634)  # jit code may only read constexpr globals
MAX_SCALAR_PAGES = tl.constexpr(4)  # `load_block_ids`: pages per tile read as scalars (more: one gather)


@triton.jit
def load_block_ids(bt_ptr, bt_row, start, k_hi, num_blocks, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ids ``[BLOCK_N]`` int32 of the pages of key positions ``start + arange(BLOCK_N)``.

    ``start`` is a multiple of ``BLOCK_N`` (`attend_key_range` aligns its tiles). When one of
    ``BLOCK_N`` and ``PAGE_SIZE`` divides the other, a tile is inside one page or covers whole
    pages, and the block table is read once per page: one uniform load, or loads that share
    address and mask within a page (so they are one), not one per key. A block id outside
    ``[0, num_blocks)`` (bad metadata), or of a page that starts at or past ``k_hi``, comes
    back as -1: the caller masks that key, so no load leaves the cache. Keys past ``k_hi`` in
    an earlier page keep its id (a per-page value: the slot addresses are computed per page):
    the caller checks ``keys < k_hi`` (`_tile_keys_valid`).
    """
    lane = tl.arange(0, BLOCK_N)
    # The page size is a constexpr (one compile per page size): a division by a runtime value
    # costs ~20 integer instructions.
    if PAGE_SIZE % BLOCK_N == 0:
        # (Splat to [BLOCK_N]: the interpreter's `&` of a scalar and a vector mask gives int32.)
        blk = tl.load(bt_ptr + bt_row + start // PAGE_SIZE, mask=start < k_hi, other=-1) + tl.zeros_like(lane)
    elif BLOCK_N % PAGE_SIZE == 0 and BLOCK_N // PAGE_SIZE <= MAX_SCALAR_PAGES:
        # One scalar load per page, selected per key: a [BN] gather is issued once per key a
        # thread holds, each with its own address and predicate.
        in_tile = lane // PAGE_SIZE
        col0 = start // PAGE_SIZE
        blk = tl.full([BLOCK_N], -1, tl.int32)
        for j in tl.static_range(BLOCK_N // PAGE_SIZE):
            blk_j = tl.load(bt_ptr + bt_row + col0 + j, mask=start + j * PAGE_SIZE < k_hi, other=-1)
            blk = tl.where(in_tile == j, blk_j, blk)
    elif BLOCK_N % PAGE_SIZE == 0:
        in_tile = lane // PAGE_SIZE
        blk = tl.load(bt_ptr + bt_row + (start // PAGE_SIZE + in_tile), mask=start + in_tile * PAGE_SIZE < k_hi,
                      other=-1)
    else:
        # Unsigned (keys >= 0): a signed division needs a rounding fix-up per key.
        keys = start + lane
        blk = tl.load(bt_ptr + bt_row + (keys.to(tl.uint32) // PAGE_SIZE).to(tl.int32), mask=keys < k_hi, other=-1)
    return tl.where((blk >= 0) & (blk < num_blocks), blk, -1)


@triton.jit
def _tile_keys_valid(blk, start, k_hi, BLOCK_N: tl.constexpr):
    """``[BLOCK_N]`` bool: key ``start + j`` is below ``k_hi`` and its page has a block id (`load_block_ids`)."""
    return (blk >= 0) & (start + tl.arange(0, BLOCK_N) < k_hi)


@triton.jit
def slot_pointers(cache_i16, blk, start, kv_head, stride_cn, stride_cp, stride_ch, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Pointers ``[BLOCK_N]`` (16-bit words) to the slot of each key ``start + arange(BLOCK_N)`` (block ids ``blk``).

    ``start`` is a multiple of ``BLOCK_N``, so when one of ``BLOCK_N`` and ``PAGE_SIZE``
    divides the other a key's place in its page is ``lane % PAGE_SIZE`` (loop-invariant) or
    ``start % PAGE_SIZE + lane``. ``stride_*``: the cache's byte strides, all even (slots are
    2-byte aligned). Halving the strides once per program, rather than each key's byte offset,
    saves a signed int64 division per key and field. A masked key (``blk`` -1) gets an address
    that is never read. The page's base is a function of the block id alone, so keys of one
    page share it; each key then adds its loop-invariant place in the page.
    """
    lane = tl.arange(0, BLOCK_N)
    if PAGE_SIZE % BLOCK_N == 0:
        in_page = lane + start % PAGE_SIZE
    elif BLOCK_N % PAGE_SIZE == 0:
        in_page = lane % PAGE_SIZE
    else:
        in_page = ((start + lane).to(tl.uint32) % PAGE_SIZE).to(tl.int32)
    # Zero-extended: -1 becomes a large offset, never dereferenced, and a 32 x 64-bit product
    # needs no sign fix-up.
    page = cache_i16 + blk.to(tl.uint32).to(tl.int64) * (stride_cn >> 1)
    return page + (in_page.to(tl.int64) * (stride_cp >> 1) + kv_head * (stride_ch >> 1))


@triton.jit
def _interleave(a, b):
    """``[BN, W]`` x 2 -> ``[BN, 2W]`` with ``a`` in even and ``b`` in odd columns.

    `tl.join` adds the new axis innermost, inside one thread's registers, so
    the reshape moves no data.
    """
    BN: tl.constexpr = a.shape[0]
    W: tl.constexpr = a.shape[1]
    return tl.reshape(tl.join(a, b), (BN, 2 * W))


@triton.jit
def _interleave_quads(a, b):
    """``[BN, 4W]`` x 2 -> ``[BN, 8W]``: per group of 8 columns, ``a``'s 4 then ``b``'s 4."""
    BN: tl.constexpr = a.shape[0]
    W4: tl.constexpr = a.shape[1]
    a3 = tl.reshape(a, (BN, W4 // 4, 4))
    b3 = tl.reshape(b, (BN, W4 // 4, 4))
    return tl.reshape(tl.permute(tl.join(a3, b3), (0, 1, 3, 2)), (BN, 2 * W4))


@triton.jit
def fetch_field(field_ptr, key_valid, D: tl.constexpr, D_PAD: tl.constexpr,
                BITS: tl.constexpr, MASK_KEYS: tl.constexpr = True):
    """Issues the loads of one packed field of ``BN`` keys; returns the raw words ``(a, b, c)``.

    ``field_ptr [BN]``: each key's field (16-bit words). ``BITS`` 16 (raw fp16/bf16
    elements), 8 (fp8) or 4: 16-bit words ``a [BN, D_PAD * BITS / 16]`` (``b``,
    ``c`` alias ``a``). ``BITS`` 3: two 8-code groups per 3 words, so the three
    words of each pair of groups, ``[BN, D_PAD / 16]`` each (when ``D / 8`` is
    odd, the last pair's middle word also holds the byte after the field: fields
    start on even bytes and slots are a whole number of words). Nothing here
    uses the loaded values, so the loads stay in flight until `decode_field`.
    ``D`` is a multiple of 8, so every field but a 3-bit one is a whole number
    of words. ``MASK_KEYS`` False: every key is loaded, ``key_valid`` or not
    (``field_ptr`` must then point inside the cache for every key).
    """
    if BITS == 3:
        # Three words per 16 codes: half the load instructions of three byte planes (one byte
        # per 8 codes each). H100, B=32 x 8k, same call: 3bit_nc decode 587 -> 490 us,
        # k3v4_nc 535 -> 531 us.
        p = tl.arange(0, D_PAD // 16)
        addr = field_ptr[:, None] + (3 * p)[None, :]
        m = (p < (D + 8) // 16)[None, :]
        m_c = (p < D // 16)[None, :]
        a = _load_words(addr, key_valid, m, MASK_KEYS, (D + 8) // 16 < D_PAD // 16)
        b = _load_words(addr + 1, key_valid, m, MASK_KEYS, (D + 8) // 16 < D_PAD // 16)
        c = _load_words(addr + 2, key_valid, m & m_c, MASK_KEYS, D // 16 < D_PAD // 16)
        return a, b, c
    else:
        NW: tl.constexpr = D_PAD * BITS // 16
        i = tl.arange(0, NW)
        a = _load_words(field_ptr[:, None] + i[None, :], key_valid, (i < D * BITS // 16)[None, :], MASK_KEYS,
                        D * BITS // 16 < NW)
        return a, a, a


@triton.jit
def _load_words(ptrs, key_valid, in_field, MASK_KEYS: tl.constexpr, PADDED: tl.constexpr):
    """``tl.load(ptrs [BN, W])`` (0 where masked) of the keys ``key_valid [BN]`` (all with
    ``MASK_KEYS`` False) and the words ``in_field [1, W]`` (all unless ``PADDED``).

    A load that needs no mask gets none: a masked 16-bit load costs a zeroing PRMT before it
    and a LOP3 after.
    """
    # (Masks are built full-size by `&`: the interpreter rejects a broadcast view.)
    if MASK_KEYS:
        return tl.load(ptrs, mask=key_valid[:, None] & in_field, other=0)
    elif PADDED:
        return tl.load(ptrs, mask=in_field & (tl.zeros(ptrs.shape, tl.int32) == 0), other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def decode_field(a, b, c, BITS: tl.constexpr, CLEAN: tl.constexpr = True):
    """Codes ``[BN, D_PAD]`` int32 in element order from `fetch_field`'s raw words.

    (``BITS`` 16 returns the loaded elements as they are: int16 patterns, or fp16/bf16
    elements where the cache came as a float view, the dequant workspace.) Codes are an LSB-first bit
    stream: word ``i``'s field ``j`` is element ``i * fields + j``. ``CLEAN``
    False (3- and 4-bit codes): the bits above each code are left as they are,
    for a consumer that reads only the code's bits (`kernel_math.table_lookup`
    on the GPU): one AND fewer per element.
    """
    if BITS == 16:
        return a
    elif BITS == 8:
        w = a.to(tl.uint16, bitcast=True).to(tl.int32)  # zero-extend: no sign fix-ups per field
        return _interleave(w & 0xFF, w >> 8)
    elif BITS == 4:
        w = a.to(tl.uint16, bitcast=True).to(tl.int32)  # zero-extend: no sign fix-ups per field
        return _interleave(_interleave(_code(w, 0, 4, CLEAN), _code(w, 8, 4, CLEAN)),
                           _interleave(_code(w, 4, 4, CLEAN), w >> 12))
    else:  # 3 bits: 8 fields of a 24-bit little-endian word, two per 3 words
        wa = a.to(tl.uint16, bitcast=True).to(tl.int32)
        wb = b.to(tl.uint16, bitcast=True).to(tl.int32)
        wc = c.to(tl.uint16, bitcast=True).to(tl.int32)
        w = _interleave(wa | ((wb & 0xFF) << 16), (wb >> 8) | (wc << 8))
        lo = _interleave(_interleave(_code(w, 0, 3, CLEAN), _code(w, 6, 3, CLEAN)),
                         _interleave(_code(w, 3, 3, CLEAN), _code(w, 9, 3, CLEAN)))
        hi = _interleave(_interleave(_code(w, 12, 3, CLEAN), _code(w, 18, 3, CLEAN)),
                         _interleave(_code(w, 15, 3, CLEAN), w >> 21))
        return _interleave_quads(lo, hi)


@triton.jit
def _code(w, SHIFT: tl.constexpr, BITS: tl.constexpr, CLEAN: tl.constexpr):
    """The ``BITS``-bit field of ``w`` at bit ``SHIFT`` (with the bits above it unless ``CLEAN``)."""
    if SHIFT > 0:
        w = w >> SHIFT
    if CLEAN:
        w = w & ((1 << BITS) - 1)
    return w


@triton.jit
def _load_scalar_field(ptrs, key_valid, MASK_KEYS: tl.constexpr):
    """One 16-bit word per key (``ptrs [BN]``): 0 for keys not ``key_valid`` unless ``MASK_KEYS`` is False."""
    if MASK_KEYS:
        return tl.load(ptrs, mask=key_valid, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def fetch_kv_tile(slot, key_valid,
                  D: tl.constexpr, D_PAD: tl.constexpr, KEY_FORMAT: tl.constexpr, KEY_FIELD_BITS: tl.constexpr,
                  KEY_NORM_OFF: tl.constexpr, VALUE_FORMAT: tl.constexpr, VALUE_FIELD_BITS: tl.constexpr,
                  VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
                  MASK_KEYS: tl.constexpr = True):
    """Issues every load of a K/V tile (slot pointers ``[BN]``, 16-bit words); returns the raw words.

    The ``*_OFF`` byte offsets are even constexprs. ``MASK_KEYS``: see `fetch_field`.

    ``*_FIELD_BITS``: bits per stored element (raw 16, fp8 8, codes 3 or 4).
    """
    ka, kb, kc = fetch_field(slot, key_valid, D, D_PAD, KEY_FIELD_BITS, MASK_KEYS)
    if KEY_FORMAT == 2:
        knorm = _load_scalar_field(slot + KEY_NORM_OFF // 2, key_valid, MASK_KEYS)
    else:
        knorm = tl.zeros(key_valid.shape, tl.int16)
    va, vb, vc = fetch_field(slot + VALUE_OFF // 2, key_valid, D, D_PAD, VALUE_FIELD_BITS, MASK_KEYS)
    if VALUE_FORMAT == 0:
        vscale = tl.zeros(key_valid.shape, tl.int16)
        vzero = vscale
    else:
        vscale = _load_scalar_field(slot + VALUE_SCALE_OFF // 2, key_valid, MASK_KEYS)
        vzero = _load_scalar_field(slot + VALUE_ZERO_OFF // 2, key_valid, MASK_KEYS)
    return ka, kb, kc, knorm, va, vb, vc, vscale, vzero


@triton.jit
def _fetch_keys(cache_i16, blk, start, key_valid, kv_head, stride_cn, stride_cp, stride_ch,
                PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                KEY_FORMAT: tl.constexpr, KEY_FIELD_BITS: tl.constexpr, KEY_NORM_OFF: tl.constexpr, VALUE_FORMAT: tl.constexpr,
                VALUE_FIELD_BITS: tl.constexpr, VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr,
                VALUE_ZERO_OFF: tl.constexpr, ANY_PAGE: tl.constexpr):
    """`fetch_kv_tile` of key positions ``start + arange(BLOCK_N)`` in pages ``blk`` (block ids, -1 = masked).

    ``ANY_PAGE``: masked keys read page 0 (inside the cache: `tiles_spec` sets it only for a
    cache with blocks) through unpredicated loads; `_key_loop` keeps what they read out of
    every row.
    """
    if ANY_PAGE:
        blk = tl.maximum(blk, 0)
    slot = slot_pointers(cache_i16, blk, start, kv_head, stride_cn, stride_cp, stride_ch, PAGE_SIZE, BLOCK_N)
    return fetch_kv_tile(slot, key_valid, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS,
                         KEY_NORM_OFF, VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF,
                         VALUE_ZERO_OFF, not ANY_PAGE)


@triton.jit
def prefetch_slot_lines(cache_i16, blk, start, kv_head, stride_cn, stride_cp, stride_ch,
                        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, LAST_WORD: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """L2 prefetch of every 128-byte line of the slots of keys ``start + arange(BLOCK_N)`` (block ids ``blk``).

    ``LAST_WORD``: the slot's last 16-bit word. A slot is asked for at words 0, 64, 128, ...
    and its last word: one address in each line it touches. Masked keys (``blk`` -1) ask for
    nothing. H100 loads-only micro-benchmark of 4bit_nc slots (B=32 x 8k, 1024 programs):
    255 us without, 207 us with the next tile's lines asked for (two tiles ahead: 229 us; one
    address per slot: 259 us; one per 32 bytes: 280 us; `cp.async.bulk.prefetch.L2` of 160
    bytes: 294 us; steps.md, thirty-second session).
    """
    slot = slot_pointers(cache_i16, blk, start, kv_head, stride_cn, stride_cp, stride_ch, PAGE_SIZE, BLOCK_N)
    if LAST_WORD < 192:
        words = tl.minimum(tl.arange(0, 4) * 64, LAST_WORD)
    elif LAST_WORD < 448:
        words = tl.minimum(tl.arange(0, 8) * 64, LAST_WORD)
    else:
        words = tl.minimum(tl.arange(0, 16) * 64, LAST_WORD)
    prefetch_l2(slot[:, None] + words[None, :], (blk >= 0)[:, None] & (words >= 0)[None, :], INTERPRET)


@triton.jit
def _fp16_bits_to_f32(bits):
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def key_square_scale(cb_ptr, KEY_FIELD_BITS: tl.constexpr):
    """fp32 power of two ``r`` with ``r * max|c|`` in ``[1, 2)`` over the mse codebook ``cb_ptr``.

    `decode_key_tile` squares ``r * c`` in fp16 for the norm: the scaling is
    exact and keeps any codebook's squares inside fp16's range.
    """
    cmax = tl.max(tl.abs(tl.load(cb_ptr + tl.arange(0, 1 << KEY_FIELD_BITS))), axis=0)
    exp_bits = cmax.to(tl.uint32, bitcast=True) & 0x7F800000
    return ((0x7F000000 - exp_bits).to(tl.int32)).to(tl.float32, bitcast=True)  # 2**-(e - 127)


@triton.jit
def decode_key_tile(ka, kb, kc, knorm, cb_ptr, key_valid, square_scale,
                    KEY_FORMAT: tl.constexpr, KEY_FIELD_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
                    RAW_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, NORM_ROWS: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Keys in scoring space: ``(k [BN, D_PAD], per-key factor)``.

    ``k`` is fp32, except for norm-corrected mse keys with ``NORM_ROWS > 0``, where it
    comes back as a ``DOT_DTYPE`` dot operand (`kernel_math.dot_operand`, which leaves it
    as it is) already behind `kernel_math.mma_operand`.

    score = factor * (q . k). Raw/fp8 keys: factor 1. mse keys: ``k`` holds the
    centroids and factor is ``norm`` (``norm / ||c||`` with norm correction),
    so the per-key scaling is one multiply after the dot. The factor is
    ``[BN]``, or ``[NORM_ROWS, BN]`` (all rows equal) when ``NORM_ROWS > 0``:
    then ``||c||**2`` comes from a tensor-core dot of a ones tile with the fp16
    squares of ``square_scale * c`` (`key_square_scale`; rounding each square
    to fp16 moves the factor by < 2**-12 relative), laid out like a
    ``[NORM_ROWS, BN]`` score tile, so no cross-lane row sum is needed.
    """
    # mse codes only index a table: the GPU lookup reads just their bits.
    codes = decode_field(ka, kb, kc, KEY_FIELD_BITS, KEY_FORMAT != 2 or INTERPRET)
    if KEY_FORMAT == 0:
        k = codes.to(RAW_DTYPE, bitcast=True).to(tl.float32)
        factor = tl.full(key_valid.shape, 1.0, tl.float32)
    elif KEY_FORMAT == 1:
        k = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        factor = tl.full(key_valid.shape, 1.0, tl.float32)
    elif NORM_CORRECTION and NORM_ROWS > 0:
        k, squares = table_lookup_with_squares(cb_ptr, codes, square_scale, 1 << KEY_FIELD_BITS, DOT_DTYPE,
                                               INTERPRET)
        k = mma_operand(k, INTERPRET)
        squares = mma_operand(squares, INTERPRET)
        ones = dot_operand(tl.full([NORM_ROWS, k.shape[1]], 1.0, tl.float32), tl.float16, INTERPRET)
        norm_sq = dot(ones, tl.trans(squares), tl.float16, INTERPRET)  # (||c|| * square_scale)**2
        # rsqrt is within 2 ulp: far below the bf16 rounding of k.
        factor = _fp16_bits_to_f32(knorm)[None, :] * (tl.math.rsqrt(norm_sq) * square_scale)
    else:
        k = table_lookup(cb_ptr, codes, 1 << KEY_FIELD_BITS, INTERPRET)
        factor = _fp16_bits_to_f32(knorm)
        if NORM_CORRECTION:
            factor = factor * tl.math.rsqrt(tl.sum(k * k, axis=1))
    return k, factor


@triton.jit
def decode_value_tile(va, vb, vc, vscale, vzero, key_valid,
                      VALUE_FORMAT: tl.constexpr, VALUE_FIELD_BITS: tl.constexpr, RAW_DTYPE: tl.constexpr):
    """Values as ``(v [BN, D_PAD] fp32, scale [BN], zero [BN])`` with ``value = v * scale + zero``.

    Uniform codes come back as the integer codes (exact in any dot dtype) and
    the fp16 scale/zero per key, so the caller folds the scale into P and the
    zero into one row sum instead of dequantising every element. Raw values
    come back as they are with scale 1, zero 0 (0 for keys whose loads were masked).
    """
    if VALUE_FORMAT == 0:
        # Raw values are loaded with their keys' mask (never `ANY_PAGE`), so keys outside the
        # cache come as zeros; a NaN/Inf value of a key in the cache but hidden from a row is
        # `_key_loop`'s to keep out (`masked_raw_value_dot`). No select here: it would bring
        # the tile into registers on its way to the dot.
        v = decode_field(va, vb, vc, VALUE_FIELD_BITS).to(RAW_DTYPE, bitcast=True).to(tl.float32)
        scale = tl.full(key_valid.shape, 1.0, tl.float32)
        zero = tl.zeros(key_valid.shape, tl.float32)
    else:
        v = decode_field(va, vb, vc, VALUE_FIELD_BITS).to(tl.float32)
        scale = _fp16_bits_to_f32(vscale)
        zero = _fp16_bits_to_f32(vzero)
    return v, scale, zero


@triton.jit
def _biased_value_operand(va, vb, vc, VALUE_FIELD_BITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                          INTERPRET: tl.constexpr):
    """Uniform value codes ``[BN, D_PAD]`` + bias as a dot operand, and the bias (`biased_code_operand`).

    4-bit codes on the GPU go straight from the words to 16-bit pairs
    (`biased_nibble_operand`); the result is the same. Not yet behind `mma_operand`: the
    caller places that.
    """
    if VALUE_FIELD_BITS == 4 and DOT_DTYPE != tl.float32 and not INTERPRET:
        return biased_nibble_operand(va, DOT_DTYPE)
    else:
        return biased_code_operand(decode_field(va, vb, vc, VALUE_FIELD_BITS), DOT_DTYPE, INTERPRET)


@triton.jit
def _scale_scores(s, k_factor, scale, NORM_ROWS: tl.constexpr):
    """``s [BLOCK_M, BN] * k_factor * scale``: `decode_key_tile`'s factor, ``[BN]`` or already ``[BLOCK_M, BN]``."""
    if NORM_ROWS == 0:
        return s * (k_factor * scale)[None, :]
    else:
        return s * (k_factor * scale)


@triton.jit
def masked_raw_value_dot(p, v, keys, key_valid, pos, row_valid, window, acc, DOT_DTYPE: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """``acc + P @ V`` over a tile whose keys are hidden from some rows, for raw values ``v [BN, D_PAD]``.

    ``p [BLOCK_M, BN]`` is 0 where a key is not visible (``keys``/``key_valid [BN]``,
    ``pos``/``row_valid [BLOCK_M]`` and ``window`` as in `_key_loop`), but a NaN/Inf raw
    value of a hidden key would still reach the row as ``0 * NaN`` (a later token's value on
    the causal diagonal, an out-of-window one at the window edge): DESIGN.md says masked
    keys never leak. The dot runs on the finite values (a compare and a select per value,
    in the few masked tiles of a row tile); if the tile had others, a loop over its keys
    gives each row exactly what IEEE products over its visible keys give: NaN where a
    visible value is NaN or a visible Inf meets ``p = 0`` (as a dot operand), else +Inf /
    -Inf (both: NaN). The loop touches only ``acc`` and vectors: a second
    ``[BLOCK_M, D_PAD]`` tensor would spill the extend tiles' registers.
    """
    finite = (v == v) & (tl.abs(v) != float("inf"))
    p_op = dot_operand(p, DOT_DTYPE, INTERPRET)
    v_op = dot_operand(v, DOT_DTYPE, INTERPRET)  # raw values: exact in the dot dtype
    # The dot stays out of the branch (a dot under an `if` is not pipelined with the loop).
    acc = dot(p_op, tl.where(finite, v_op, 0.0), DOT_DTYPE, INTERPRET, acc)
    if tl.sum(tl.sum(tl.where(finite, 0, 1), axis=1), axis=0) > 0:
        lane = tl.arange(0, v.shape[0])
        for j in range(0, v.shape[0]):
            # Key j's values [D_PAD] and, per row, its visibility and p (0 + NaN/Inf keeps them).
            v_j = tl.sum(tl.where((lane == j)[:, None], v_op, 0.0), axis=0).to(tl.float32)
            p_j = tl.sum(tl.where((lane == j)[None, :], p_op, 0.0), axis=1).to(tl.float32)
            # Visibility of key j per row from vectors (as `_key_loop` builds the tile's mask):
            # keeping that [BLOCK_M, BN] mask alive through the loop would spill.
            key_j = tl.sum(tl.where(lane == j, keys, 0), axis=0)
            valid_j = tl.sum(tl.where((lane == j) & key_valid, 1, 0), axis=0) > 0
            seen = row_valid & valid_j & (key_j <= pos)
            if window > 0:
                seen = seen & (key_j > pos - window)
            inf_j = tl.abs(v_j) == float("inf")
            acc = acc + tl.where((seen & (p_j != 0.0))[:, None] & inf_j[None, :], v_j[None, :], 0.0)
            nan_j = (seen[:, None] & (v_j != v_j)[None, :]) | ((seen & (p_j == 0.0))[:, None] & inf_j[None, :])
            acc = tl.where(nan_j, float("nan"), acc)
    return acc


@triton.jit
def _key_loop(
    q, acc, m_i, l_i, pos, row_valid, start_lo, start_hi, k_first, k_hi,
    ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next,
    bt_ptr, bt_row, kv_head, cache_i16, cb_ptr,
    stride_cn, stride_cp, stride_ch, num_blocks, sm_scale, softcap, window, square_scale,
    MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    KEY_FORMAT: tl.constexpr, KEY_FIELD_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_FORMAT: tl.constexpr, VALUE_FIELD_BITS: tl.constexpr,
    VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
    RAW_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, NORM_ROWS: tl.constexpr, PREFETCH: tl.constexpr,
    ANY_PAGE: tl.constexpr, L2_PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Key tiles starting at ``[start_lo, start_hi)`` (step BLOCK_N) of the online softmax.

    ``MASKED`` False: every key of these tiles below ``k_hi`` is visible to every valid row
    (causal and window checks skipped; only keys of masked pages are dropped), the common
    case away from the diagonal and the window edge. With ``PREFETCH`` the raw words of the
    first tile come in (``ka`` ... ``key_valid``, and ``blk_next`` the block ids of the tile
    after) and those of the tile after ``start_hi`` go out. ``L2_PREFETCH`` (with ``PREFETCH``;
    `attention_kernel.l2_prefetch`): each tile also asks L2 for the lines of the tile after next.
    """
    lane = tl.arange(0, BLOCK_N)
    for start in range(start_lo, start_hi, BLOCK_N):
        keys = start + lane
        if PREFETCH:
            # Tile i+1's words (its block ids arrived during tile i-1) and
            # tile i+2's block ids, all in flight while tile i is computed.
            valid_n = _tile_keys_valid(blk_next, start + BLOCK_N, k_hi, BLOCK_N)
            ka_n, kb_n, kc_n, knorm_n, va_n, vb_n, vc_n, vscale_n, vzero_n = _fetch_keys(
                cache_i16, blk_next, start + BLOCK_N, valid_n, kv_head, stride_cn, stride_cp, stride_ch,
                PAGE_SIZE, BLOCK_N, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, KEY_NORM_OFF,
                VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, ANY_PAGE)
            blk_next = load_block_ids(bt_ptr, bt_row, start + 2 * BLOCK_N, k_hi, num_blocks, PAGE_SIZE, BLOCK_N)
            c_ka, c_kb, c_kc, c_knorm, c_va, c_vb, c_vc, c_vscale, c_vzero = ka, kb, kc, knorm, va, vb, vc, vscale, vzero
            c_valid = key_valid
        else:
            blk = load_block_ids(bt_ptr, bt_row, start, k_hi, num_blocks, PAGE_SIZE, BLOCK_N)
            c_valid = _tile_keys_valid(blk, start, k_hi, BLOCK_N)
            c_ka, c_kb, c_kc, c_knorm, c_va, c_vb, c_vc, c_vscale, c_vzero = _fetch_keys(
                cache_i16, blk, start, c_valid, kv_head, stride_cn, stride_cp, stride_ch,
                PAGE_SIZE, BLOCK_N, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, KEY_NORM_OFF,
                VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, ANY_PAGE)

        if MASKED:
            # Tiles start on a multiple of BLOCK_N: keys before k_first are no row's.
            c_valid = c_valid & (keys >= k_first)
        k, k_factor = decode_key_tile(c_ka, c_kb, c_kc, c_knorm, cb_ptr, c_valid, square_scale, KEY_FORMAT,
                                      KEY_FIELD_BITS, NORM_CORRECTION, RAW_DTYPE, DOT_DTYPE, NORM_ROWS, INTERPRET)
        k = dot_operand(k, DOT_DTYPE, INTERPRET)
        # Keys decoded in registers go behind `mma_operand` (raw tiles must not: see there);
        # `decode_key_tile` did it at the lookup for norm-corrected mse keys on 16-row tiles.
        if KEY_FORMAT != 0 and not (KEY_FORMAT == 2 and NORM_CORRECTION and NORM_ROWS > 0):
            k = mma_operand(k, INTERPRET)
        s = dot(q, tl.trans(k), DOT_DTYPE, INTERPRET)
        if HAS_SOFTCAP:
            # On the scaled logits, before masking (DESIGN.md section 3).
            s = _scale_scores(s, k_factor, sm_scale, NORM_ROWS)
            s = (softcap * LOG2E) * tanh_f32(s / softcap)
        else:
            s = _scale_scores(s, k_factor, sm_scale * LOG2E, NORM_ROWS)
        if MASKED:
            visible = c_valid[None, :] & row_valid[:, None] & (keys[None, :] <= pos[:, None])
            if window > 0:
                visible = visible & (keys[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        elif ANY_PAGE:
            # Every valid key of these tiles is visible to every row (padding rows' scores are
            # never stored). A masked key (bad block id) read page 0: its score may be anything.
            s = tl.where(c_valid[None, :], s, float("-inf"))
        else:
            # As above, but a masked key was loaded as zeros, so its score is finite (or NaN
            # from a NaN query, whose row is NaN anyway) and adding -inf masks it: one add per
            # score (fused with the scaling), no select.
            s = s + tl.where(c_valid, 0.0, float("-inf"))[None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if VALUE_FORMAT == 0:
            # Raw values: no scale; p is already 0 where a key is not visible.
            v, v_scale, v_zero = decode_value_tile(c_va, c_vb, c_vc, c_vscale, c_vzero, c_valid, VALUE_FORMAT,
                                                   VALUE_FIELD_BITS, RAW_DTYPE)
            if MASKED:
                acc = masked_raw_value_dot(p, v, keys, c_valid, pos, row_valid, window, acc * alpha[:, None],
                                           DOT_DTYPE, INTERPRET)
            else:
                acc = dot(dot_operand(p, DOT_DTYPE, INTERPRET), dot_operand(v, DOT_DTYPE, INTERPRET),
                          DOT_DTYPE, INTERPRET, acc * alpha[:, None])
        else:
            # P @ (codes * scale + zero) = (P * scale) @ (codes + bias) + P @ zero - bias * sum(P * scale),
            # the last sum over the P * scale the dot multiplied (rounded to DOT_DTYPE).
            v, v_bias = _biased_value_operand(c_va, c_vb, c_vc, VALUE_FIELD_BITS, DOT_DTYPE, INTERPRET)
            # The asm of `mma_operand` keeps its place in the program. Right where the tile is
            # decoded, its trip to shared memory can overlap the softmax: 8-12 % faster on the
            # decode rows than at the dot, except behind 3-bit keys with 4-bit values (k3v4_nc),
            # where it goes at the dot below, 7 % faster there (steps.md, sessions 27 and 28).
            if not (KEY_FORMAT == 2 and KEY_FIELD_BITS == 3 and VALUE_FIELD_BITS == 4):
                v = mma_operand(v, INTERPRET)
            if ANY_PAGE and not MASKED:
                # A masked key's scale and zero came from page 0 (maybe NaN/Inf): zero them, per
                # key, so that its p = 0 stays 0. (Its codes are finite integers.)
                c_vscale = tl.where(c_valid, c_vscale, 0)
                c_vzero = tl.where(c_valid, c_vzero, 0)
            v_scale = _fp16_bits_to_f32(c_vscale)
            v_zero = _fp16_bits_to_f32(c_vzero)
            p_scale = p * v_scale[None, :]
            p_zero = p * v_zero[None, :]
            if MASKED:
                # `where` on the visibility, not the product alone: the garbage scale or zero
                # (NaN/Inf) of a key that is in the cache but not visible to a row must not reach
                # the output as 0 * NaN. (In unmasked tiles every valid key is visible, and masked
                # keys were loaded as zeros.)
                p_scale = tl.where(visible, p_scale, 0.0)
                p_zero = tl.where(visible, p_zero, 0.0)
            p_v = dot_operand(p_scale, DOT_DTYPE, INTERPRET)
            zero_term = tl.sum(p_zero - v_bias * p_v.to(tl.float32), axis=1)
            if KEY_FORMAT == 2 and KEY_FIELD_BITS == 3 and VALUE_FIELD_BITS == 4:
                v = mma_operand(v, INTERPRET)
            # The rescaled accumulator is the dot's accumulator input (no copies into a fresh one).
            acc = dot(p_v, v, DOT_DTYPE, INTERPRET, acc * alpha[:, None] + zero_term[:, None])
        m_i = m_new
        if PREFETCH:
            if L2_PREFETCH:
                # The lines of the tile after next on their way to L2 (its block ids have arrived).
                prefetch_slot_lines(cache_i16, blk_next, start + 2 * BLOCK_N, kv_head, stride_cn, stride_cp,
                                    stride_ch, PAGE_SIZE, BLOCK_N, VALUE_ZERO_OFF // 2, INTERPRET)
            ka, kb, kc, knorm, va, vb, vc, vscale, vzero = ka_n, kb_n, kc_n, knorm_n, va_n, vb_n, vc_n, vscale_n, vzero_n
            key_valid = valid_n
    return acc, m_i, l_i, ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next


@triton.jit
def attend_key_range(
    q, acc, m_i, l_i, pos, row_valid, k_first, k_lo, k_hi, all_lo, all_hi,
    bt_ptr, bt_row, kv_head, cache_i16, cb_ptr,
    stride_cn, stride_cp, stride_ch, num_blocks, sm_scale, softcap, window, HAS_SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    KEY_FORMAT: tl.constexpr, KEY_FIELD_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_FORMAT: tl.constexpr, VALUE_FIELD_BITS: tl.constexpr,
    VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
    RAW_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, NORM_ROWS: tl.constexpr, PREFETCH: tl.constexpr,
    ANY_PAGE: tl.constexpr, L2_PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Online softmax of rows ``q [BLOCK_M, D_PAD]`` over keys ``[max(k_first, k_lo), k_hi)`` of one sequence.

    ``k_lo`` is a multiple of ``BLOCK_N`` (tiles then sit on whole pages, see `load_block_ids`).
    Keys of the first tile below ``k_first`` are masked (they belong to no row; not even a
    ``0 * NaN`` of a raw value may reach the output), which only masked tiles check: every key
    of ``[all_lo, all_hi)`` is at or past ``k_first``.
    ``pos [BLOCK_M]``: each row's absolute query position; key ``j`` is visible
    iff ``j <= pos`` (and ``j > pos - window`` when ``window > 0``);
    ``window`` is a runtime scalar (a uniform branch, taken only in edge tiles): one
    compiled kernel serves every window. ``HAS_SOFTCAP`` (``softcap > 0``) is a constexpr: a
    branch in the key loop would cut its body in two basic blocks that ptxas schedules apart. Keys in
    ``[all_lo, all_hi)`` are visible to every valid row: whole tiles inside it
    skip the causal and window checks. Returns the updated
    ``(acc [BLOCK_M, D_PAD], m_i, l_i)`` (unnormalised, log2 domain).
    ``PREFETCH``: hand-pipeline the loads one tile ahead (else Triton's
    pipeliner may, with ``num_stages`` > 1). ``NORM_ROWS``: see `decode_key_tile`
    (``BLOCK_M`` or 0).
    """
    if NORM_ROWS > 0:  # mse keys (`attention_kernel.norm_rows`)
        square_scale = key_square_scale(cb_ptr, KEY_FIELD_BITS)
    else:
        square_scale = 1.0
    # Tile starts k_lo + i * BLOCK_N: masked ones before mid_lo (window edge),
    # unmasked ones in [mid_lo, mid_hi), masked ones from mid_hi (the diagonal).
    mid_lo = tl.minimum(k_lo + tl.cdiv(tl.maximum(all_lo - k_lo, 0), BLOCK_N) * BLOCK_N, k_hi)
    mid_lo = tl.maximum(mid_lo, k_lo)
    mid_hi = mid_lo + tl.maximum(tl.minimum(all_hi, k_hi) - mid_lo, 0) // BLOCK_N * BLOCK_N
    if PREFETCH:
        # Prologue of the hand pipeline: tile 0's words, tile 1's block ids.
        blk = load_block_ids(bt_ptr, bt_row, k_lo, k_hi, num_blocks, PAGE_SIZE, BLOCK_N)
        key_valid = _tile_keys_valid(blk, k_lo, k_hi, BLOCK_N)
        ka, kb, kc, knorm, va, vb, vc, vscale, vzero = _fetch_keys(
            cache_i16, blk, k_lo, key_valid, kv_head, stride_cn, stride_cp, stride_ch,
            PAGE_SIZE, BLOCK_N, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, KEY_NORM_OFF,
            VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, ANY_PAGE)
        blk_next = load_block_ids(bt_ptr, bt_row, k_lo + BLOCK_N, k_hi, num_blocks, PAGE_SIZE, BLOCK_N)
    else:
        # Placeholders: without the hand pipeline each tile loads its own words.
        blk_next = tl.zeros([BLOCK_N], tl.int32)
        key_valid = blk_next >= 0
        ka = tl.zeros([BLOCK_N, 1], tl.int16)
        kb, kc, va, vb, vc = ka, ka, ka, ka, ka
        knorm = tl.zeros([BLOCK_N], tl.int16)
        vscale, vzero = knorm, knorm
    acc, m_i, l_i, ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next = _key_loop(
        q, acc, m_i, l_i, pos, row_valid, k_lo, mid_lo, k_first, k_hi,
        ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next,
        bt_ptr, bt_row, kv_head, cache_i16, cb_ptr,
        stride_cn, stride_cp, stride_ch, num_blocks, sm_scale, softcap, window, square_scale, True, HAS_SOFTCAP,
        PAGE_SIZE, BLOCK_N, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, NORM_CORRECTION, KEY_NORM_OFF,
        VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, RAW_DTYPE,
        DOT_DTYPE, NORM_ROWS, PREFETCH, ANY_PAGE, L2_PREFETCH, INTERPRET)
    acc, m_i, l_i, ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next = _key_loop(
        q, acc, m_i, l_i, pos, row_valid, mid_lo, mid_hi, k_first, k_hi,
        ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next,
        bt_ptr, bt_row, kv_head, cache_i16, cb_ptr,
        stride_cn, stride_cp, stride_ch, num_blocks, sm_scale, softcap, window, square_scale, False, HAS_SOFTCAP,
        PAGE_SIZE, BLOCK_N, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, NORM_CORRECTION, KEY_NORM_OFF,
        VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, RAW_DTYPE,
        DOT_DTYPE, NORM_ROWS, PREFETCH, ANY_PAGE, L2_PREFETCH, INTERPRET)
    acc, m_i, l_i, ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next = _key_loop(
        q, acc, m_i, l_i, pos, row_valid, mid_hi, k_hi, k_first, k_hi,
        ka, kb, kc, knorm, va, vb, vc, vscale, vzero, key_valid, blk_next,
        bt_ptr, bt_row, kv_head, cache_i16, cb_ptr,
        stride_cn, stride_cp, stride_ch, num_blocks, sm_scale, softcap, window, square_scale, True, HAS_SOFTCAP,
        PAGE_SIZE, BLOCK_N, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, NORM_CORRECTION, KEY_NORM_OFF,
        VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, RAW_DTYPE,
        DOT_DTYPE, NORM_ROWS, PREFETCH, ANY_PAGE, L2_PREFETCH, INTERPRET)
    return acc, m_i, l_i


@triton.jit
def load_query_rows(q_ptr, q_tok, q_head, row_valid, stride_qt, stride_qh, d,
                    D: tl.constexpr, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Query rows ``[BLOCK_M, D_PAD]`` as dot operands (0 in padding rows / lanes).

    ``q_ptr``: the query's dtype (a rotated query, mse presets, comes in it too:
    `rotation.rotate_query`), converted here to ``DOT_DTYPE``.
    """
    ptrs = q_ptr + q_tok.to(tl.int64)[:, None] * stride_qt + q_head.to(tl.int64)[:, None] * stride_qh \
        + d[None, :]
    q = tl.load(ptrs, mask=row_valid[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    return dot_operand(q, DOT_DTYPE, INTERPRET)
