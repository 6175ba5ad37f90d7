"""The one attention kernel both paths launch: a tile of query rows x all (or one
split of) its visible keys.

Grid ``(T // BLOCK_Q + B, Hkv, num_splits)``. Sequence ``b`` owns tile ids
``[qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1)`` (on the extend path in launch
order from the last tile down: `_longest_tiles_first`), enough for
``ceil(q_len / BLOCK_Q)`` tiles; a program finds its sequence by a scan of
``query_start_loc`` (`_find_sequence`, which also gives every row at most one
owner when the metadata is bad) and exits if its tile is past the sequence's
queries. The grid depends only on static shapes (no host sync; CUDA-graph safe).

A tile packs ``BLOCK_Q = BLOCK_M // G`` query tokens x the ``G`` query heads of
one kv head into its rows (row ``r``: token ``r // G``, head ``r % G``), so
every K/V element is dequantised once per tile and serves the whole GQA group
through ``tl.dot``. Only keys in ``[window start of the first row, position of
the last row]`` are visited: tiles before the window or past ``seq_lens`` are
skipped, and pages the sequence does not own are never read.

``SPLIT_KV`` (decode path): the tile's key range is cut into ``num_splits``
equal BLOCK_N-aligned chunks, split ``s`` takes chunk ``s`` and writes
unnormalised partials (``acc``, ``m``, ``l``, log2 domain) for the merge
kernel; chunks past the end are empty and write ``m = -inf, l = 0, acc = 0``.
Otherwise (extend path) the tile normalises, adds sinks and writes the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import config
from .launcher import Launch, kernel_site
from .kv_tiles import LOG2E, attend_key_range, load_query_rows
from .kernel_math import to_dtype_rne


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _find_sequence(qsl_ptr, pid, num_seqs, num_tokens, block_q, SEQ_CHUNK: tl.constexpr):
    """Sequence, first row and row count of tile id ``pid``: ``(seq, q_start, q_len)``, int32 scalars.

    Query rows are laid out from the metadata so that every row has at most one
    owner whatever ``query_start_loc`` holds: with ``c = clamp(qsl, 0, T)``,
    sequence ``b`` starts at ``s[b] = min(T, c[0] + sum_{j<b} max(c[j+1] - c[j], 0))``
    and owns ``[s[b], s[b+1])``. For valid metadata ``s == qsl``. ``s`` never
    decreases, so the first tile ids ``s[b] // block_q + b`` increase and tile
    ``pid`` belongs to the last sequence whose first tile id is ``<= pid``
    (a tile before the first sequence's rows gets ``seq = 0`` and a negative
    offset: the caller skips it). Sequences are scanned ``SEQ_CHUNK`` at a time
    (int32 prefix sums stay exact for T < 2**31 / (SEQ_CHUNK + 2)); the scan
    stops at the first chunk holding a later sequence.
    """
    if num_seqs == 1:
        # (Triton specialises an int argument equal to 1 into a constant: the
        # single-sequence kernel, the B = 1 decode latency case, skips the scan.)
        seq = pid * 0
        q_start = _clamp(tl.load(qsl_ptr), 0, num_tokens)
        q_len = _clamp(tl.load(qsl_ptr + 1), q_start, num_tokens) - q_start
    else:
        j = tl.arange(0, SEQ_CHUNK)
        base = _clamp(tl.load(qsl_ptr), 0, num_tokens)  # s[start], already capped at T
        q_start = base
        count = pid * 0
        start = pid * 0
        stop = pid * 0 + num_seqs
        while start < stop:
            idx = start + j
            live = idx < num_seqs
            lo = _clamp(tl.load(qsl_ptr + idx, mask=live, other=0), 0, num_tokens)
            hi = _clamp(tl.load(qsl_ptr + idx + 1, mask=live, other=0), 0, num_tokens)
            grow = tl.where(live, tl.maximum(hi - lo, 0), 0)
            s = tl.minimum(base + tl.cumsum(grow, axis=0) - grow, num_tokens)
            take = live & (s // block_q + idx <= pid)
            count += tl.sum(take.to(tl.int32), axis=0)
            q_start = tl.maximum(q_start, tl.max(tl.where(take, s, 0), axis=0))
            base = tl.minimum(base + tl.sum(grow, axis=0), num_tokens)
            stop = tl.where(tl.sum((live & ~take).to(tl.int32), axis=0) > 0, 0, stop)
            start += SEQ_CHUNK
        seq = tl.maximum(count - 1, 0)
        grow_b = tl.maximum(_clamp(tl.load(qsl_ptr + seq + 1), 0, num_tokens)
                            - _clamp(tl.load(qsl_ptr + seq), 0, num_tokens), 0)
        q_len = tl.minimum(q_start + grow_b, num_tokens) - q_start
    return seq, q_start, q_len


# Kv heads whose tiles the extend path interleaves (`_longest_tiles_first`); tq_jax's TILE_ORDER_HEADS.
TILE_ORDER_HEADS = tl.constexpr(4)


@triton.jit
def _longest_tiles_first(x, y, nx, ny, HEADS: tl.constexpr):
    """Extend path: ``(tile id, kv head)`` of program ``(x, y)`` of an ``(nx, ny)`` grid.

    The GPU starts programs in launch order (``x`` fastest), and a sequence's
    last tiles see the most keys (causal). Launch order takes the kv heads
    ``HEADS`` at a time (one at a time if ``ny`` is not a multiple), and each
    group's tiles from the last down, its heads next to each other: the final
    wave holds the shortest tiles instead of the longest.

    H100, 4bit_nc, one call, launch order in ms (8k prefill / window 4k /
    chunked 1k over 8k / mixed b16): program id order 2.246 / 1.783 / 0.680 /
    1.190; heads 4 at a time 2.205 / 1.681 / 0.650 / 1.190; 2 at a time 2.205 /
    1.676 / 0.665 / 1.197. Tiles reversed with one head at a time (earlier
    call) made the window row 1.685 but the causal one 2.285: one head's
    longest tiles start together at key 0 and read its lines in step.
    """
    launch = y * nx + x
    g = tl.where(ny % HEADS == 0, HEADS, 1)
    r = launch % (g * nx)
    return nx - 1 - r // g, launch // (g * nx) * g + r % g


@triton.jit
def paged_attention_kernel(
    q_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    cache_i16, cb_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cn, stride_cp, stride_ch,
    sm_scale, softcap, window, num_seqs, group, block_q, num_q_heads, num_splits,
    num_tokens, num_blocks, max_seq_len,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    KEY_FORMAT: tl.constexpr, KEY_FIELD_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_FORMAT: tl.constexpr, VALUE_FIELD_BITS: tl.constexpr,
    VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
    RAW_DTYPE: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SPLIT_KV: tl.constexpr,
    DOT_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, NORM_ROWS: tl.constexpr, PREFETCH: tl.constexpr,
    ANY_PAGE: tl.constexpr, L2_PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
    SEQ_CHUNK: tl.constexpr = 128,
):
    if SPLIT_KV:
        pid = tl.program_id(0)
        kv_head = tl.program_id(1).to(tl.int64)
    else:
        pid, kv_head = _longest_tiles_first(tl.program_id(0), tl.program_id(1), tl.num_programs(0),
                                            tl.num_programs(1), TILE_ORDER_HEADS)
        kv_head = kv_head.to(tl.int64)
    split = tl.program_id(2)
    # Metadata guards, always on (no value of qsl/seq_lens/block_table may move an
    # access outside the op's buffers, and no output row gets two writers): query
    # ranges are laid out by `_find_sequence`, lengths are clamped to what the
    # block table can address, and block ids outside [0, N) mask their keys.
    seq, q_start, q_len = _find_sequence(qsl_ptr, pid, num_seqs, num_tokens, block_q, SEQ_CHUNK)
    seq_len = _clamp(tl.load(seq_lens_ptr + seq), 0, max_seq_len)
    tok0 = (pid - (q_start // block_q + seq)) * block_q
    if (tok0 >= 0) & (tok0 < q_len):
        d = tl.arange(0, D_PAD)
        r = tl.arange(0, BLOCK_M)
        tok = tok0 + r // group
        row_valid = (r // group < block_q) & (tok < q_len)
        head = kv_head * group + r % group
        pos = seq_len - q_len + tok
        # Keys any row of this tile may see: [k_first, k_hi).
        k_hi = seq_len - q_len + tl.minimum(tok0 + block_q, q_len)
        k_first = tl.where(window > 0, tl.maximum(seq_len - q_len + tok0 - window + 1, 0), 0)
        # Tiles start on multiples of BLOCK_N (page-aligned tiles: `kv_tiles.load_block_ids`).
        k_lo = k_first // BLOCK_N * BLOCK_N
        # Keys every valid row sees, [all_lo, all_hi): causal up to the first row's
        # position, window from the last row's.
        all_hi = seq_len - q_len + tok0 + 1
        all_lo = tl.where(window > 0, k_hi - window, 0)
        if SPLIT_KV:
            chunk = tl.cdiv(tl.cdiv(tl.maximum(k_hi - k_lo, 0), num_splits), BLOCK_N) * BLOCK_N
            k_lo = k_lo + split * chunk
            k_hi = tl.minimum(k_hi, k_lo + chunk)
        q = load_query_rows(q_ptr, q_start + tok, head, row_valid, stride_qt, stride_qh, d,
                            D, DOT_DTYPE, INTERPRET)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = attend_key_range(
            q, acc, m_i, l_i, pos, row_valid, k_first, k_lo, k_hi, all_lo, all_hi,
            bt_ptr, seq.to(tl.int64) * stride_bt, kv_head, cache_i16, cb_ptr,
            stride_cn, stride_cp, stride_ch, num_blocks, sm_scale, softcap, window, HAS_SOFTCAP,
            PAGE_SIZE, BLOCK_N, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, NORM_CORRECTION, KEY_NORM_OFF,
            VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, RAW_DTYPE,
            DOT_DTYPE, NORM_ROWS, PREFETCH, ANY_PAGE, L2_PREFETCH, INTERPRET,
        )
        t_idx = (q_start + tok).to(tl.int64)
        dmask = row_valid[:, None] & (d < D)[None, :]
        if SPLIT_KV:
            part = (t_idx * num_q_heads + head) * num_splits + split
            tl.store(part_m_ptr + part, m_i, mask=row_valid)
            tl.store(part_l_ptr + part, l_i, mask=row_valid)
            tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=dmask)
        else:
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * LOG2E
                m_fin = tl.maximum(m_i, sink)
                rescale = tl.exp2(m_i - m_fin)  # m_i = -inf (no key seen) -> 0
                l_i = l_i * rescale + tl.exp2(sink - m_fin)
                acc = acc * rescale[:, None]
            # `!= 0`, not `> 0`: a NaN denominator (NaN query or sink) must give NaN.
            denom = tl.zeros_like(acc) + l_i[:, None]
            o = tl.where(denom != 0.0, tl.math.div_rn(acc, tl.where(denom != 0.0, denom, 1.0)), 0.0)
            optrs = out_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(optrs, to_dtype_rne(o, OUT_DTYPE, INTERPRET), mask=dmask)


def norm_rows(fmt: dict, block_m: int, dot_dtype, num_warps: int) -> int:
    """``NORM_ROWS`` of a launch: ``block_m`` where the key norms come from a tensor-core dot
    (`kv_tiles.decode_key_tile`: norm-corrected mse keys, 16-bit dots, 16-row decode tiles over
    several warps), else 0.

    Measured on an H100 (B=32 x 8k decode, same call): 4-bit keys on 4 warps 0.571 -> 0.559 ms
    (D = 256: 0.699 -> 0.649 ms). The one-warp 3-bit tiles got slower (0.659 -> 0.809 ms for
    k3v4_nc): their row sum needs no cross-warp barrier. Taller (extend) tiles keep the row sum
    too: a ones dot as tall as the tile would double the QK^T dot.
    """
    mma_norm = fmt["KEY_FORMAT"] == config.KEY_MSE and fmt["NORM_CORRECTION"] and dot_dtype != tl.float32
    return block_m if mma_norm and block_m == 16 and num_warps > 1 else 0


def any_page(fmt: dict, num_blocks: int, prefetch: bool) -> bool:
    """``ANY_PAGE`` of a launch (`kv_tiles._fetch_keys`): keys without a block id read page 0
    through unpredicated loads, where every use of what they read is masked: quantized values
    (their scale and zero are zeroed per key, and the scores of such keys are selected to
    -inf) in a cache with at least one block. Raw values keep masked loads: P @ V would meet a
    NaN/Inf value of such a key as ``0 * NaN``.

    Only with the hand prefetch. H100, B=32 x 8k decode, a b a b in one call (ms): k8v4 0.450 /
    0.403 / 0.450 / 0.403, k3v4_nc 0.525 / 0.456 / 0.526 / 0.459; 8k prefill 2.52 -> 2.43. The
    4-bit D=128 decode tiles (no prefetch: each tile's loads are waited for in the same
    iteration) got slower with it: 0.368 / 0.404 / 0.370 / 0.406.
    """
    return prefetch and fmt["VALUE_FORMAT"] != config.VALUE_RAW and num_blocks > 0


def l2_prefetch(fmt: dict, num_kv_heads: int, prefetch: bool) -> bool:
    """``L2_PREFETCH`` of a launch (`kv_tiles._key_loop`): with the hand prefetch, each key tile
    also asks L2 for the lines of the tile after next (`kv_tiles.prefetch_slot_lines`). Only for
    fp8 keys with quantized values, in a cache of more than one kv head.

    H100, one call, a b a b (ms), k8v4: B=32 x 8k decode 0.350 / 0.332 / 0.350 / 0.331, page 64
    0.379 / 0.328, window 4k 0.207 / 0.188, skewed lengths 0.421 / 0.381, B=128 x 8k 1.31 /
    1.24, D=512 (Hkv 2) 0.951 / 0.911, q_len 8 1.034 / 0.852, mixed b64 1.732 / 1.485; 4k prefill
    and chunked 2k over 8k unchanged. One kv head (Hq 8 / Hkv 1 / D 256, slots of a page back to
    back, which the loads themselves read as whole lines) lost, B=32 0.203 / 0.226 and B=128
    0.651 / 0.747, even with every prefetch predicated off. mse keys lost: 3bit_nc 0.444 / 0.457
    (k3v4_nc 0.435 / 0.430), and 4bit_nc decode (no hand prefetch), asking for its next tile's
    lines, 0.336 / 0.347 (steps.md, thirty-second session).
    """
    return (prefetch and fmt["KEY_FORMAT"] == config.KEY_FP8 and fmt["VALUE_FORMAT"] != config.VALUE_RAW
            and num_kv_heads > 1)


def tiles_spec(*, num_tokens: int, num_q_heads: int, num_kv_heads: int, num_seqs: int, max_blocks: int,
               num_blocks: int, page_size: int, num_splits: int, split_kv: bool, has_sinks: bool, fmt: dict,
               block_m: int, block_n: int, d_pad: int, dot_dtype, out_dtype, interpret: bool, num_warps: int,
               num_stages: int, maxnreg, prefetch: bool) -> tuple:
    """The static part of a `paged_attention_kernel` launch: ``(grid, int args, kernel sites)``.

    The sites (`launcher.KernelSite`) are indexed by ``HAS_SOFTCAP``. Depends on
    static shapes and settings only, so callers cache it (host time matters at
    B=1 decode); `launch_tiles_spec` adds the per-call tensors and scalars.
    """
    g = num_q_heads // num_kv_heads
    block_m = max(block_m, 1 << (g - 1).bit_length())
    block_q = max(1, block_m // g)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    ints = (num_seqs, g, block_q, num_q_heads, num_splits, num_tokens, num_blocks, max_blocks * page_size)
    kwargs = dict(
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad, HAS_SINKS=has_sinks,
        SPLIT_KV=split_kv, NORM_ROWS=norm_rows(fmt, block_m, dot_dtype, num_warps),
        DOT_DTYPE=dot_dtype, OUT_DTYPE=out_dtype, PREFETCH=prefetch, ANY_PAGE=any_page(fmt, num_blocks, prefetch),
        L2_PREFETCH=l2_prefetch(fmt, num_kv_heads, prefetch), INTERPRET=interpret, num_warps=num_warps,
        num_stages=num_stages,
        **({} if maxnreg is None else dict(maxnreg=maxnreg)), **config.field_bits_constexprs(fmt),
    )
    sites = tuple(kernel_site(paged_attention_kernel, dict(kwargs, HAS_SOFTCAP=c)) for c in (False, True))
    return grid, ints, sites


def launch_tiles_spec(spec: tuple, q, out, part_acc, part_m, part_l, kv_cache, cache_i16, centroids, block_table,
                      seq_lens, query_start_loc, sinks, sm_scale: float, softcap: float, window: int) -> None:
    """Launches `paged_attention_kernel` with a `tiles_spec` of these tensors' static shapes.

    ``cache_i16``: the cache as 2-byte elements, for its 2-byte fields: an int16 view of a
    uint8 cache, or the dequant workspace's own float16/bfloat16 view (`workspace.launch_dequant`:
    its raw tiles then reach the dots without a bitcast).
    """
    tiles_launch(spec, q, out, part_acc, part_m, part_l, kv_cache, cache_i16, centroids, block_table, seq_lens,
                 query_start_loc, sinks, sm_scale, softcap, window)()


def tiles_launch(spec: tuple, q, out, part_acc, part_m, part_l, kv_cache, cache_i16, centroids, block_table,
                 seq_lens, query_start_loc, sinks, sm_scale: float, softcap: float, window: int) -> Launch:
    """`launch_tiles_spec`'s launch, not yet issued (`launcher.Launch`)."""
    grid, ints, sites = spec
    qs, os_, cs = q.stride(), out.stride(), kv_cache.stride()
    return Launch(
        sites[softcap > 0], grid,
        (q, out, part_acc, part_m, part_l, cache_i16, centroids, block_table, seq_lens,
         query_start_loc, sinks if sinks is not None else q),
        (qs[0], qs[1], os_[0], os_[1], block_table.stride(0), cs[0], cs[1], cs[2], sm_scale, softcap, window,
         *ints),
    )


def launch_tiles(q, out, part_acc, part_m, part_l, kv_cache, cache_i16, centroids, block_table, seq_lens,
                 query_start_loc, sinks, *, num_splits: int, split_kv: bool, fmt: dict, sm_scale: float,
                 softcap: float, window: int, block_m: int, block_n: int, d_pad: int, dot_dtype, out_dtype,
                 interpret: bool, num_warps: int, num_stages: int, maxnreg, prefetch: bool) -> None:
    """Launches `paged_attention_kernel` over every (tile, kv head, split)."""
    t, hq, _ = q.shape
    spec = tiles_spec(
        num_tokens=t, num_q_heads=hq, num_kv_heads=kv_cache.shape[2], num_seqs=block_table.shape[0],
        max_blocks=block_table.shape[1], num_blocks=kv_cache.shape[0], page_size=kv_cache.shape[1],
        num_splits=num_splits, split_kv=split_kv, has_sinks=sinks is not None, fmt=fmt, block_m=block_m,
        block_n=block_n, d_pad=d_pad, dot_dtype=dot_dtype, out_dtype=out_dtype, interpret=interpret,
        num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg, prefetch=prefetch)
    launch_tiles_spec(spec, q, out, part_acc, part_m, part_l, kv_cache, cache_i16, centroids, block_table,
                      seq_lens, query_start_loc, sinks, sm_scale, softcap, window)
