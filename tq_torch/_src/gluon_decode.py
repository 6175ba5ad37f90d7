"""tq_torch's launcher of the Gluon decode (`tq_gluon.decode`): the decode path's kernel on sm_90 where
`ineligible` allows it.

The kernel, its slot table and its launch shapes are framework-free and shared with tq_jax
(`tq_gluon.decode`); this module adds torch's facts (device, dtypes, cache alignment), the kernel sites,
the fused merge's ticket counters and the launch. Calls the kernel does not take keep the Triton kernels
of the decode path (`decode`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton.language as tl

import tq_spec
from tq_gluon.decode import (_FORMATS, HEAD_DIM, LOG2E, PRESETS, _query_dims, _slot_format,  # noqa: F401 (tests)
                             gluon_decode_kernel, ineligible_shape, launch_shape, slot_key, tile_shape, wide_loads,
                             tma_loads)
from tq_gluon.decode import num_splits as _num_splits

from . import config
from .decode import _decode_merge_kernel
from .launcher import Launch, current_stream, kernel_site


def ineligible(layout: tq_spec.Layout, *, query_dtype: torch.dtype, out_dtype: torch.dtype, num_tokens: int,
               num_seqs: int, num_q_heads: int, kv_cache_shape: tuple, device: torch.device,
               interpret: bool) -> Optional[str]:
    """None where the decode path may run this kernel on these static facts, else why not.

    The per-call facts (no sliding window, no soft cap, `aligned`) are the caller's to check.
    """
    if interpret or device.type != "cuda":
        return "needs a CUDA device (no interpreter)"
    why = ineligible_shape(layout, num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
                           kv_cache_shape=kv_cache_shape)
    if why is not None:
        return why
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "built and measured for sm_90 (H100/H200) only"
    if query_dtype != torch.bfloat16 or out_dtype != torch.bfloat16:
        return "needs a bfloat16 query and output"
    return None


def aligned(spec: DecodeSpec, kv_cache: torch.Tensor) -> bool:
    """Whether this call's cache can be read as the spec's key words: fp8 keys are read as int32 words,
    so the cache's address and strides must be multiples of 4 bytes (a per-call fact; the decode
    path takes the Triton kernels otherwise)."""
    if spec.slot["KEY_BITS"] != 8:
        return True
    return not kv_cache.data_ptr() % 4 and all(st % 4 == 0 for st in kv_cache.stride()[:-1])


def num_splits(*, num_kv_heads: int, num_tokens: int, num_q_heads: int, num_seqs: int, max_context: int,
               device: torch.device, head_dim: int = HEAD_DIM) -> int:
    """`tq_gluon.decode.num_splits` on ``device``'s SMs."""
    return _num_splits(num_kv_heads=num_kv_heads, num_tokens=num_tokens, num_q_heads=num_q_heads,
                       num_seqs=num_seqs, max_context=max_context, sm_count=config.sm_count(device),
                       max_splits=config._MAX_SPLITS, partials_budget=config._PARTIALS_BUDGET, head_dim=head_dim)


class DecodeSpec(NamedTuple):
    """The static part of a launch (`decode_spec`)."""

    split: object  # `KernelSite` of `gluon_decode_kernel` (``WIDE``: caches whose strides allow wide loads)
    grid: tuple
    merge: Optional[object]  # `KernelSite` of `decode._decode_merge_kernel`; None: merged in the kernel
    merge_grid: tuple
    part_numel: int  # fp32 elements of the tensor maps' workspace and the three partial buffers (one allocation)
    part_sizes: tuple  # the tensor maps (`LaunchShape.map_words`; first, so 256-byte aligned), acc, m, l
    num_splits: int
    num_seqs: int
    max_seq_len: int  # what the block table can address
    slot: dict  # the slot format's constexprs (`tq_gluon.decode._FORMATS`)
    tickets: int  # counters of the fused merge (0: none)
    split_narrow: object  # `split` without wide loads or TMA stages (for caches `wide_loads` or `tma_loads` refuse)
    rotates: bool  # the kernel rotates the query (``ROTATE``): `launch_decode_spec` takes it as given


def decode_spec(layout: tq_spec.Layout, *, num_tokens: int, num_q_heads: int, num_kv_heads: int, num_seqs: int,
                max_blocks: int, num_splits: int, has_sinks: bool) -> DecodeSpec:
    """The static part of a launch (kernel + merge sites, buffer sizes), for `launch_decode_spec`.

    ``layout``: the cache's slot layout (one `ineligible` accepts).
    """
    shape = launch_shape(layout, num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                         num_seqs=num_seqs, max_blocks=max_blocks, num_splits=num_splits, has_sinks=has_sinks)
    split = kernel_site(gluon_decode_kernel, dict(shape.constexprs, WIDE=shape.wide))
    split_narrow = kernel_site(gluon_decode_kernel, dict(shape.constexprs, WIDE=False, STAGES=0))
    d = shape.slot["D"]
    merge = None if shape.fused else kernel_site(_decode_merge_kernel, dict(
        SPLITS_PAD=shape.splits_pad, D=d, D_PAD=d, HAS_SINKS=has_sinks, OUT_DTYPE=tl.bfloat16,
        INTERPRET=False, num_warps=4))
    part_sizes = (shape.map_words, *shape.part_sizes)
    return DecodeSpec(split, shape.grid, merge, (num_tokens, num_q_heads), sum(part_sizes), part_sizes,
                      num_splits, num_seqs, shape.max_seq_len, shape.slot, shape.tickets, split_narrow,
                      shape.rotates)


# Ticket counters of the fused merge, per (device index, CUDA stream): ``[int32 buffer, clean]``. Per
# stream, so that launches running at once on two streams never share a counter; grown by replacement,
# and every buffer is kept, since CUDA graphs hold the address they were captured with.
_TICKETS: dict = {}
_TICKETS_KEPT: list = []


def ticket_counters(device: torch.device, numel: int) -> torch.Tensor:
    """An int32 buffer of at least ``numel`` counters on ``device``, all zero when the next launch on its
    current stream runs (each launch leaves them zero).

    A buffer made during a CUDA-graph capture is zeroed by a memset that only that graph's replays run,
    so until an eager launch has zeroed it, every later launch (captured or not) zeroes it first: a
    graph captured after the first may be replayed before it.
    """
    key = (device.index, current_stream(device.index))
    entry = _TICKETS.get(key)
    if entry is None or entry[0].numel() < numel:
        buf = torch.zeros(max(numel, 4096), dtype=torch.int32, device=device)
        _TICKETS_KEPT.append(buf)
        entry = _TICKETS[key] = [buf, not torch.cuda.is_current_stream_capturing()]
    elif not entry[1]:
        entry[0].zero_()
        entry[1] = not torch.cuda.is_current_stream_capturing()
    return entry[0]


def launch_decode_spec(spec: DecodeSpec, q: torch.Tensor, out: torch.Tensor, cache_i16: torch.Tensor,
                       centroids: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, sinks: Optional[torch.Tensor], sm_scale: float,
                       rotation_signs: torch.Tensor, rotation_scale: float, first: Optional[Launch] = None) -> None:
    """Decode into ``out`` ``[T, Hq, D]`` bf16: the kernel, then the merge kernel unless the spec
    merges in the kernel (`DecodeSpec.tickets`); ``first`` (the query rotation that fills ``q``), if given,
    right before them, once every argument is ready (`launcher.Launch`).

    ``q``: the query ``[T, Hq, D]`` bf16, last dim contiguous; for mse keys rotated by
    `rotation.rotate_query`, except where the spec ``rotates``: then as given, and ``rotation_signs`` (bf16
    ``[128, 128]``, row-major) and ``rotation_scale`` are ``Pi``'s (`rotation.QueryRotation.sign_rows`; any
    tensor otherwise); ``cache_i16``: the cache ``uint8[N, 16, Hkv, slot_bytes]`` viewed as int16 (for
    fp8 keys `aligned` must hold); ``centroids``: the fp32 ``[16]`` key codebook (any tensor for fp8
    keys: not read); ``block_table`` int32 ``[B, max_blocks]`` (last dim contiguous); ``seq_lens``
    int32 ``[B]`` and ``query_start_loc`` int32 ``[B + 1]`` contiguous; ``sinks`` None or fp32
    ``[Hq]``. Any metadata values are safe (`gluon_decode_kernel`); rows past
    ``query_start_loc[B]`` come out zero.
    """
    (split, grid, merge, merge_grid, part_numel, part_sizes, splits, num_seqs, max_seq_len, slot, tickets,
     split_narrow, _) = spec
    t, hq, _ = q.shape
    cs = cache_i16.stride()
    base_mod16 = cache_i16.data_ptr() % 16
    if ((split.constexprs["WIDE"] and not wide_loads(cs))
            or (split.constexprs["STAGES"] and not tma_loads(cs, base_mod16))):
        split = split_narrow
    parts = torch.empty(part_numel, dtype=torch.float32, device=q.device)
    tma_ws, part_acc, part_m, part_l = torch.split_with_sizes(parts, part_sizes)  # (tma_ws: empty without stages)
    kcache = cache_i16.view(torch.int32) if slot["KEY_BITS"] == 8 else cache_i16
    ks = kcache.stride()
    qs, outs = q.stride(), out.stride()
    sinks = part_m if sinks is None else sinks  # (not read without sinks)
    counters = ticket_counters(q.device, tickets) if tickets else part_m
    tensors = (q, cache_i16, kcache, centroids, block_table, seq_lens, query_start_loc, sinks, rotation_signs,
               part_acc, part_m, part_l, out, counters, tma_ws)
    scalars = (qs[0], qs[1], block_table.stride(0), cs[0], cs[1], cs[2], ks[0], ks[1], ks[2],
               cache_i16.shape[0], splits, hq, num_seqs, t, float(sm_scale) * float(LOG2E.value), max_seq_len,
               outs[0], outs[1], base_mod16, float(rotation_scale))
    if first is not None:
        first()
    split(grid, tensors, scalars)
    if merge is not None:
        merge(merge_grid, (part_acc, part_m, part_l, sinks, out, query_start_loc), (outs[0], outs[1], hq, splits,
                                                                                    num_seqs))
