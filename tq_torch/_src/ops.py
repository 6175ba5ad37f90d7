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
from typing import Optional

import torch

import tq_spec

from . import config, params
from .decode import launch_decode
from .extend import launch_extend
from .store import launch_store_kv
from .workspace import launch_dequant


def store_kv_impl(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, preset: str, rotation: Optional[torch.Tensor],
                  midpoints: Optional[torch.Tensor]) -> None:
    """Quantises ``key, value [T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` (in place)."""
    d = key.shape[-1]
    p = tq_spec.get_preset(preset)
    if p.key_format == "mse":
        if rotation is None:
            rotation = params.default_rotation(preset, d, kv_cache.device)
        if midpoints is None:
            midpoints = params.default_midpoints(preset, d, kv_cache.device)
    launch_store_kv(key, value, kv_cache, slot_mapping.contiguous(), preset, rotation, midpoints)


store_kv_op = torch.library.custom_op("tq_torch::store_kv", mutates_args=("kv_cache",))(store_kv_impl)


@store_kv_op.register_fake
def _store_kv_fake(key, value, kv_cache, slot_mapping, preset, rotation, midpoints) -> None:
    return None


@functools.lru_cache(maxsize=None)
def _attention_setup(preset: str, head_dim: int, path: str, interpret: bool):
    """Per-(preset, D, path) launch facts: format constexprs, padded D, tile settings."""
    fmt = config.format_constexprs(tq_spec.layout(preset, head_dim))
    d_pad = config.padded_head_dim(head_dim)
    return fmt, d_pad, config.attention_tiles(d_pad, interpret, path, config.key_kind(fmt))


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
    dev = kv_cache.device
    interpret = config.interpreted(dev)
    fmt, d_pad, tiles = _attention_setup(preset, d, "extend" if path == "dequant" else path, interpret)
    if fmt["KEY_FORMAT"] == config.KEY_MSE:
        cents = centroids if centroids is not None else params.default_centroids(preset, d, dev)
        # q_rot = Pi @ q once per call, in float64 then rounded to fp32 (immune
        # to a global TF32 setting); scores are taken in the rotated space.
        rot_t = (params.default_rotation_f64_t(preset, d, dev) if rotation is None
                 else rotation.to(torch.float64).t())
        q = torch.matmul(query.to(torch.float64), rot_t).to(torch.float32)
    else:
        q = query if query.stride(-1) == 1 else query.contiguous()
        cents = seq_lens  # dummy pointer, never dereferenced for these formats
    common = dict(
        fmt=fmt, sm_scale=float(scale), softcap=float(logits_soft_cap), window=int(sliding_window),
        d_pad=d_pad, dot_dtype=config.TORCH_TO_TL[query.dtype], out_dtype=config.TORCH_TO_TL[out.dtype],
        interpret=interpret, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
        maxnreg=tiles["maxnreg"], prefetch=tiles["prefetch"], block_n=tiles["block_n"],
    )
    cache_i16 = kv_cache.view(torch.int16)
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    if path == "decode":
        hkv = kv_cache.shape[2]
        splits = num_splits or config.decode_num_splits(
            num_seqs=block_table.shape[0], num_kv_heads=hkv, num_tokens=t, num_q_heads=hq,
            head_dim=d, max_context=block_table.shape[1] * kv_cache.shape[1],
            block_n=tiles["block_n"], device=dev, interpret=interpret,
            programs_per_sm=tiles["programs_per_sm"])
        launch_decode(q, out, kv_cache, cache_i16, cents, block_table, seq_lens, query_start_loc, sinks,
                      num_splits=splits, block_m=config.decode_block_m(hq // hkv), **common)
    elif path == "dequant":
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
