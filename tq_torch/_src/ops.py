"""torch.library custom ops ``tq_torch::store_kv`` and ``tq_torch::paged_attention``.

Both mutate a tensor argument in place (the cache; the output) and return
nothing, which is what `torch.compile` functionalises cleanly. The fake
implementations do nothing, so tracing never touches devices. Eager callers
use the ``*_impl`` functions directly: the custom-op dispatcher costs about
100 us of host time per call, more than a B=1 decode kernel takes. Arguments are
assumed validated by `tq_torch._src.api`; nothing here synchronises with the
device (no ``.item()``, no data-dependent shapes).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

import tq_spec

from . import config, gluon_decode, params
from .decode import decode_spec, launch_decode_spec
from .extend import launch_extend
from .rotation import QueryRotation, query_rotation, rotate_query, rotation_launch
from .store import launch_store_kv
from .workspace import launch_dequant


def store_kv_impl(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, preset: str, rotation: Optional[torch.Tensor],
                  midpoints: Optional[torch.Tensor]) -> None:
    """Quantises ``key, value [T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` (in place).

    ``rotation`` / ``midpoints`` None: the preset's defaults (mse presets).
    """
    launch_store_kv(key, value, kv_cache, slot_mapping.contiguous(), preset, rotation, midpoints)


store_kv_op = torch.library.custom_op("tq_torch::store_kv", mutates_args=("kv_cache",))(store_kv_impl)


@store_kv_op.register_fake
def _store_kv_fake(key, value, kv_cache, slot_mapping, preset, rotation, midpoints) -> None:
    return None


@functools.lru_cache(maxsize=None)
def _attention_setup(preset: str, head_dim: int, path: str, interpret: bool):
    """Per-(preset, D, path) launch facts: format constexprs, padded D, tile settings, and a dict of
    per-shape launch plans (`_plan`; cleared with this cache, e.g. after `config.TUNING_OVERRIDES` changes)."""
    fmt = config.format_constexprs(tq_spec.layout(preset, head_dim))
    d_pad = config.padded_head_dim(head_dim)
    return fmt, d_pad, config.attention_tiles(d_pad, interpret, path, config.key_kind(fmt)), {}


# Bound on the cached launch plans per (preset, D, path): eager prefills bring a new T each call.
_MAX_PLANS = 256


class _Plan(NamedTuple):
    """What a call of one static signature needs besides its tensors (built once, see `_plan`)."""

    centroids: Optional[torch.Tensor]  # default tables (mse presets), on the call's device
    rotation: Optional[QueryRotation]  # the default query rotation (mse presets)
    decode: Optional[tuple]  # `decode.decode_spec`, decode path only
    gluon: Optional[tuple]  # `gluon_decode.decode_spec` where that kernel may run this decode (`_gluon_spec`)


def _plan(setup, preset: str, path: str, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
          out: torch.Tensor, sinks: Optional[torch.Tensor], num_splits: int, interpret: bool) -> _Plan:
    """The cached `_Plan` of a call: every value that depends only on static shapes, dtypes and the device.

    Plain host work (no device reads, no allocation on a hit), so it is safe
    during CUDA-graph capture; the custom op is opaque to `torch.compile`.
    """
    fmt, d_pad, tiles, plans = setup
    dev = kv_cache.device
    key = (query.shape, query.dtype, out.dtype, kv_cache.shape, block_table.shape, sinks is None, num_splits, dev)
    plan = plans.get(key)
    if plan is not None:
        return plan
    t, hq, d = query.shape
    cents = rot = spec = None
    if fmt["KEY_FORMAT"] == config.KEY_MSE:
        cents = params.default_centroids(preset, d, dev)
        rot = query_rotation(preset, d, None, query.dtype, dev)
    gluon = None
    if path == "decode":
        gluon = _gluon_spec(tq_spec.layout(preset, d), query, out, kv_cache, block_table, sinks, num_splits, interpret)
        n, page, hkv, _ = kv_cache.shape
        num_seqs, max_blocks = block_table.shape
        block_m = config.decode_block_m(hq // hkv)
        tiles = config.decode_tiles(tiles, hq // hkv)
        splits = num_splits or config.decode_num_splits(
            num_seqs=num_seqs, num_kv_heads=hkv, num_tokens=t, num_q_heads=hq, head_dim=d,
            max_context=max_blocks * page, block_n=tiles["block_n"], device=dev, interpret=interpret,
            programs_per_sm=tiles["programs_per_sm"])
        spec = decode_spec(
            num_tokens=t, num_q_heads=hq, head_dim=d, num_seqs=num_seqs, num_splits=splits,
            has_sinks=sinks is not None, num_kv_heads=hkv, max_blocks=max_blocks, num_blocks=n, page_size=page,
            fmt=fmt, block_m=block_m, block_n=tiles["block_n"], d_pad=d_pad,
            dot_dtype=config.TORCH_TO_TL[query.dtype], out_dtype=config.TORCH_TO_TL[out.dtype],
            interpret=interpret, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
            maxnreg=tiles["maxnreg"], prefetch=tiles["prefetch"])
    plan = _Plan(cents, rot, spec, gluon)
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def _gluon_spec(layout: tq_spec.Layout, query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, sinks: Optional[torch.Tensor], num_splits: int,
                interpret: bool) -> Optional[tuple]:
    """`gluon_decode.decode_spec` where the Gluon decode may run this call's static shapes, else None.

    The decode path's fast kernel for the TurboQuant caches on sm_90 (`gluon_decode.PRESETS`): same
    function, same partials and merge; a call with a sliding window or a soft cap (or, for fp8 keys,
    a cache not 4-byte aligned) still takes the Triton kernels.
    """
    t, hq, _ = query.shape
    num_seqs, max_blocks = block_table.shape
    if gluon_decode.ineligible(layout, query_dtype=query.dtype, out_dtype=out.dtype, num_tokens=t, num_seqs=num_seqs,
                               num_q_heads=hq, kv_cache_shape=tuple(kv_cache.shape), device=kv_cache.device,
                               interpret=interpret) is not None:
        return None
    hkv = kv_cache.shape[2]
    splits = num_splits or gluon_decode.num_splits(
        num_kv_heads=hkv, num_tokens=t, num_q_heads=hq, num_seqs=num_seqs,
        max_context=max_blocks * kv_cache.shape[1], device=kv_cache.device, head_dim=query.shape[-1])
    return gluon_decode.decode_spec(layout, num_tokens=t, num_q_heads=hq, num_kv_heads=hkv, num_seqs=num_seqs,
                                    max_blocks=max_blocks, num_splits=splits, has_sinks=sinks is not None)


def paged_attention_impl(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
                         sinks: Optional[torch.Tensor], rotation: Optional[torch.Tensor],
                         centroids: Optional[torch.Tensor], preset: str, scale: float,
                         sliding_window: int, logits_soft_cap: float, path: str,
                         num_splits: int) -> None:
    """Paged attention into ``out [T, Hq, D]`` (every element written).

    ``sliding_window`` 0 and ``logits_soft_cap`` 0.0 mean "none"; ``path`` is
    a resolved path name (see `tq_spec.dispatch.PATHS`); ``num_splits`` 0 = automatic.
    Rows past ``query_start_loc[B]`` (padding) come back as zeros.
    """
    t, hq, d = query.shape
    if t == 0:
        return
    if path not in tq_spec.dispatch.PATHS:
        raise ValueError(f"path: expected a resolved path (one of {tq_spec.dispatch.PATH_NAMES}), got {path!r}")
    interpret = config.interpreted(kv_cache.device)
    setup = _attention_setup(preset, d, "extend" if path == "dequant" else path, interpret)
    fmt, d_pad, tiles, _ = setup
    plan = _plan(setup, preset, path, query, kv_cache, block_table, out, sinks, num_splits, interpret)
    gluon = (path == "decode" and plan.gluon is not None and not sliding_window and not logits_soft_cap
             and gluon_decode.aligned(plan.gluon, kv_cache))
    q = query if query.stride(-1) == 1 else query.contiguous()
    rot_signs, rot_scale = q, 1.0  # (read by a Gluon launch that rotates the query only)
    rotate_first = None  # the decode paths' query rotation, issued right before their kernels
    if fmt["KEY_FORMAT"] == config.KEY_MSE:
        cents = centroids if centroids is not None else plan.centroids
        # q_rot = Pi @ q once per call, in the query's dtype (`rotation.rotate_query`); scores are
        # taken in the rotated space. The Gluon decode rotates it itself where its spec says so: by the
        # signs of Pi = c * S, or for a general Pi, as rotated here, by the identity.
        rot = plan.rotation if rotation is None else query_rotation(preset, d, rotation, query.dtype, query.device)
        if gluon and plan.gluon.rotates:
            if rot.sign_rows is not None:
                rot_signs, rot_scale = rot.sign_rows, rot.scale
            else:
                q, rot_signs = rotate_query(query, rot), params.identity_rows(d, query.dtype, query.device)
        elif path == "decode":
            q, rotate_first = rotation_launch(query, rot)
        else:
            q = rotate_query(query, rot)
    else:
        cents = seq_lens  # dummy pointer, never dereferenced for these formats
    cache_i16 = kv_cache.view(torch.int16)
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    if gluon:
        gluon_decode.launch_decode_spec(plan.gluon, q, out, cache_i16, cents, block_table, seq_lens,
                                        query_start_loc, sinks, float(scale), rot_signs, rot_scale,
                                        first=rotate_first)
        return
    if path == "decode":
        launch_decode_spec(plan.decode, q, out, kv_cache, cache_i16, cents, block_table, seq_lens,
                           query_start_loc, sinks, float(scale), float(logits_soft_cap), int(sliding_window),
                           first=rotate_first)
        return
    common = dict(
        fmt=fmt, sm_scale=float(scale), softcap=float(logits_soft_cap), window=int(sliding_window),
        d_pad=d_pad, dot_dtype=config.TORCH_TO_TL[query.dtype], out_dtype=config.TORCH_TO_TL[out.dtype],
        interpret=interpret, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
        maxnreg=tiles["maxnreg"], prefetch=tiles["prefetch"], block_n=tiles["block_n"],
    )
    if path == "dequant":
        raw_tiles = config.attention_tiles(d_pad, interpret, "extend", "raw")
        launch_dequant(q, out, kv_cache, cache_i16, cents, block_table, seq_lens, query_start_loc, sinks,
                       raw_tiles=raw_tiles, **common)
    else:
        launch_extend(q, out, kv_cache, cache_i16, cents, block_table, seq_lens, query_start_loc, sinks,
                      block_m=tiles["extend_block_m"], **common)


paged_attention_op = torch.library.custom_op("tq_torch::paged_attention", mutates_args=("out",))(
    paged_attention_impl)


@paged_attention_op.register_fake
def _paged_attention_fake(query, kv_cache, block_table, seq_lens, query_start_loc, out, sinks,
                          rotation, centroids, preset, scale, sliding_window, logits_soft_cap, path,
                          num_splits) -> None:
    return None
