"""Public entry points: validate (statically, no device sync), resolve, call the custom ops."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

import tq_spec
from tq_spec import dispatch, validation

from . import config, params
from . import ops  # also registers torch.ops.tq_torch.*


def _expect_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _check_same_device(device: torch.device, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the kv_cache's device), got {x.device}")


def _check_cache_storage(kv_cache: torch.Tensor) -> None:
    """The kernels address 2-byte fields through an int16 view of the cache."""
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache: expected a contiguous last dim (stride 1), got strides {kv_cache.stride()}")
    # storage_offset() cannot be traced by torch.compile; a compiled caller's
    # cache is checked by the eager call that precedes capture in practice.
    offset = 0 if torch.compiler.is_compiling() else kv_cache.storage_offset()
    if any(s % 2 for s in kv_cache.stride()[:-1]) or offset % 2:
        raise ValueError(
            f"kv_cache: expected even strides and an even storage offset (2-byte fields), got strides "
            f"{kv_cache.stride()} and offset {offset}")


def _call(op, impl, *args) -> None:
    """The custom op under `torch.compile` (so it is traced as one node), else its body directly."""
    if torch.compiler.is_compiling():
        op(*args)
    else:
        impl(*args)


def _host(x: torch.Tensor):
    """A metadata tensor's values on the host (a device sync), for ``validate=``."""
    return x.detach().cpu().numpy()


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
             preset, rotation=None, codebook=None, validate=None) -> torch.Tensor:
    """Quantises new keys/values and scatters them into the paged cache, in place.

    Args:
      key, value: ``[T, Hkv, D]`` float16/bfloat16/float32 (same dtype).
      kv_cache: ``uint8[N, P, Hkv, slot_bytes]`` (vLLM layout), updated in place.
      slot_mapping: ``[T]`` int32/int64; token ``t`` goes to slot
        ``s = block * P + offset``; ``-1`` skips the token. Entries must be in
        ``[-1, N * P)`` and unique (not checked on device: that would sync).
      preset: a preset name or `tq_spec.Preset`.
      rotation, codebook: mse presets only; see `tq_spec.quant_params`
        (a torch tensor ``[D, D]`` is accepted for ``rotation`` as well).
      validate: full validation of `slot_mapping`'s values (in ``[-1, N * P)``,
        no duplicates) with the reference's ValueError. It copies the values
        to the host (a sync), so it is off by default; None means the process
        default, ``TQ_VALIDATE=1``.

    Returns:
      ``kv_cache`` (the same tensor, for convenience).
    """
    p = tq_spec.get_preset(preset)
    for name, x in (("key", key), ("value", value), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        _expect_tensor(name, x)
    # As in `_paged_attention`: a signature that passed every static check skips them.
    signature = None
    if type(preset) is str and rotation is None and codebook is None and not torch.compiler.is_compiling():
        signature = (preset, key.shape, key.dtype, value.shape, value.dtype, kv_cache.shape, kv_cache.dtype,
                     kv_cache.device, kv_cache.stride(), kv_cache.storage_offset() & 1, slot_mapping.shape,
                     slot_mapping.dtype)
    lay = None if signature is None else _STORE_CHECKED.get(signature)
    remembered = lay is not None
    if not remembered:
        lay = validation.check_store_kv(key, value, kv_cache, slot_mapping, preset=p)
    if validation.validate_enabled(validate):
        validation.check_store_kv_values(key, value, kv_cache, _host(slot_mapping), preset=p)
    dev = kv_cache.device
    if not remembered:
        config.check_device(dev)
    _check_same_device(dev, key=key, value=value, slot_mapping=slot_mapping)
    if not remembered:
        _check_cache_storage(kv_cache)
        if signature is not None:
            _remember(_STORE_CHECKED, signature, lay)
    kp = params.resolve_user_params(p, lay.head_dim, dev, rotation, codebook)
    _call(ops.store_kv_op, ops.store_kv_impl, key, value, kv_cache, slot_mapping, p.name,
          kp.rotation, kp.midpoints)
    return kv_cache


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, preset, scale=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None, codebook=None,
                    path: str = "auto", out: torch.Tensor | None = None, validate=None) -> torch.Tensor:
    """Attention of a varlen query batch over the paged, quantised cache (DESIGN.md section 3).

    Args:
      query: ``[T, Hq, D]`` float16/bfloat16/float32; sequence ``b`` owns rows
        ``[query_start_loc[b], query_start_loc[b+1])``, its last ``q_len`` tokens.
      kv_cache: ``uint8[N, P, Hkv, slot_bytes]``; ``Hq % Hkv == 0``.
      block_table: int32 ``[B, max_blocks]``; seq_lens: int32 ``[B]``;
        query_start_loc: int32 ``[B + 1]`` (starts at 0, ends at T,
        non-decreasing, ``q_len <= seq_len``; not checked on device).
      scale: logit scale, default ``1/sqrt(D)``.
      sliding_window: None or ``W >= 1`` (key ``j`` visible iff ``pos - W < j <= pos``).
      logits_soft_cap: None or ``cap > 0``.
      sinks: None or float32 ``[Hq]``.
      rotation, codebook: mse presets only (see `tq_spec.quant_params`).
      path: "auto" or a name in `tq_spec.dispatch.PATHS` ("decode", "extend").
      out: optional ``[T, Hq, D]`` tensor of the query's dtype to write into.
      validate: full validation of the metadata values (ranges, monotonic
        query_start_loc, q_len <= seq_len, block ids in range) with the
        reference's ValueError. It copies them to the host (a sync), so it is
        off by default; None means the process default, ``TQ_VALIDATE=1``.

    Returns:
      ``[T, Hq, D]`` in the query dtype (``out`` if given).
    """
    return _paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset,
                            scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                            sinks=sinks, rotation=rotation, codebook=codebook, path=path, out=out,
                            num_splits=0, validate=validate)


# Static facts of calls that passed every static check (eager only; see
# `_static_signature`): signature -> `_Resolved`. Bounded: eager prefills
# bring new shapes every call.
_CHECKED: dict = {}
_MAX_CHECKED = 1024
# The same for `store_kv`: signature -> slot layout.
_STORE_CHECKED: dict = {}


def _remember(table: dict, signature: tuple, value) -> None:
    if len(table) >= _MAX_CHECKED:
        table.clear()
    table[signature] = value


def _static_signature(preset, path, query, kv_cache, block_table, seq_lens, query_start_loc, scale,
                      sliding_window, logits_soft_cap, sinks) -> tuple:
    """Everything the static checks, the device/storage checks and the dispatcher read.

    Python types are part of it (``True == 1`` but ``sliding_window=True`` is
    a TypeError). An unhashable argument raises TypeError (then the full
    checks run and report it).
    """
    return (preset, path, query.shape, query.dtype, kv_cache.shape, kv_cache.dtype, kv_cache.device,
            kv_cache.stride(), kv_cache.storage_offset() & 1, block_table.shape, block_table.dtype,
            seq_lens.shape, seq_lens.dtype, query_start_loc.shape, query_start_loc.dtype,
            type(scale), scale, type(sliding_window), sliding_window, type(logits_soft_cap), logits_soft_cap,
            None if sinks is None else (sinks.shape, sinks.dtype))


def _remembered_path(preset, path, query, kv_cache, block_table, seq_lens, query_start_loc, scale,
                     sliding_window, logits_soft_cap, sinks, rotation, codebook):
    """``(signature, resolved)``: the call's static signature (None when it is not remembered: traced
    calls, user rotation/codebook, non-str preset or path, unhashable arguments) and the `_Resolved`
    of a call with that signature that passed every static check (None if none did)."""
    if (type(preset) is not str or type(path) is not str or rotation is not None or codebook is not None
            or torch.compiler.is_compiling()):
        return None, None
    try:
        signature = _static_signature(preset, path, query, kv_cache, block_table, seq_lens, query_start_loc,
                                      scale, sliding_window, logits_soft_cap, sinks)
        return signature, _CHECKED.get(signature)
    except TypeError:
        return None, None


class _Resolved(NamedTuple):
    """What the op gets besides the tensors, for every call of one static signature."""

    path: str  # the dispatched path
    preset: str  # the preset's name
    scale: float
    sliding_window: int  # 0: none
    logits_soft_cap: float  # 0.0: none


def _paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset, scale,
                     sliding_window, logits_soft_cap, sinks, rotation, codebook, path, out,
                     num_splits: int, validate=None):
    """`paged_attention` with the decode split count forceable (0 = automatic), for tests."""
    for name, x in (("query", query), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        _expect_tensor(name, x)
    if sinks is not None:
        _expect_tensor("sinks", sinks)
    # Host time is the cost of a B=1 decode step: an eager call whose static facts
    # already passed skips the static checks, the dispatcher and the argument
    # resolution (same errors, same order: only passing signatures are remembered).
    signature, resolved = _remembered_path(preset, path, query, kv_cache, block_table, seq_lens, query_start_loc,
                                           scale, sliding_window, logits_soft_cap, sinks, rotation, codebook)
    p = None
    if resolved is None:
        p = tq_spec.get_preset(preset)
        validation.check_paged_attention(
            query, kv_cache, block_table, seq_lens, query_start_loc, preset=p, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    if validation.validate_enabled(validate):
        validation.check_paged_attention_values(
            query, kv_cache, _host(block_table), _host(seq_lens), _host(query_start_loc),
            preset=p or tq_spec.get_preset(preset), scale=scale, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, sinks=sinks)
    dev = kv_cache.device
    if resolved is None:
        if not isinstance(path, str):
            raise TypeError(f"path: expected a str ('auto' or a path name), got {type(path).__name__}")
        config.check_device(dev)
    _check_same_device(dev, query=query, block_table=block_table, seq_lens=seq_lens,
                       query_start_loc=query_start_loc, sinks=sinks, out=out)
    if resolved is None:
        _check_cache_storage(kv_cache)
    out = _check_out(query, out)
    if sinks is not None:
        sinks = sinks.contiguous()
    rot = cents = None  # a remembered signature has the default rotation and codebook (`_remembered_path`)
    if resolved is None:
        d = query.shape[-1]
        problem = dispatch.problem_for(query, kv_cache, block_table, preset=p.name, sliding_window=sliding_window)
        resolved = _Resolved(dispatch.select_path(problem, path), p.name,
                             float(1.0 / math.sqrt(d) if scale is None else scale), int(sliding_window or 0),
                             float(logits_soft_cap or 0.0))
        kp = params.resolve_user_params(p, d, dev, rotation, codebook)
        rot, cents = kp.rotation, kp.centroids
        if signature is not None:
            # Every check above passed for this signature, and none of them reads
            # a value that the signature leaves out.
            _remember(_CHECKED, signature, resolved)
    _call(ops.paged_attention_op, ops.paged_attention_impl,
          query, kv_cache, block_table, seq_lens, query_start_loc, out, sinks, rot, cents, resolved.preset,
          resolved.scale, resolved.sliding_window, resolved.logits_soft_cap, resolved.path, int(num_splits))
    return out


def _check_out(query: torch.Tensor, out) -> torch.Tensor:
    """`out` checked against the query (TypeError/ValueError), or a new output tensor when None."""
    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    _expect_tensor("out", out)
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out: expected {query.dtype}{list(query.shape)} (the query's), got {out.dtype}{list(out.shape)}")
    if out.stride(-1) != 1:
        raise ValueError(f"out: expected a contiguous last dim (stride 1), got strides {out.stride()}")
    return out
