"""Argument checks shared by the reference and both frameworks.

`check_store_kv` / `check_paged_attention` read only ``.shape`` and ``.dtype``
(normalised through ``str(dtype)``), so they accept numpy, torch and jax
arrays and never synchronise with a device. The ``*_values`` checks read data
and are meant for numpy arrays (the reference, tests, and debug modes).
Every error names the argument, what was expected and what arrived.
"""

from __future__ import annotations

import math
import numbers
import os

import numpy as np

from .layout import Layout, layout as make_layout
from .presets import PresetLike, get_preset

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
VALIDATE_ENV = "TQ_VALIDATE"


def validate_enabled(validate=None) -> bool:
    """The ops' ``validate=``: True/False, or None for the process default (``TQ_VALIDATE=1`` turns it on).

    Full validation reads metadata values on the host, which synchronises with
    the device, so it is off unless asked for. Tests and the parity suite turn
    it on.
    """
    if validate is None:
        return os.environ.get(VALIDATE_ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected True, False or None, got {validate!r}")
    return validate
INDEX_DTYPE = "int32"
SLOT_MAPPING_DTYPES = ("int32", "int64")


def dtype_name(x) -> str:
    """``"float16"`` for numpy/jax/torch float16 arrays alike."""
    name = str(getattr(x, "dtype", type(x).__name__))
    return name.removeprefix("torch.")


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _expect_dtype(name: str, x, allowed) -> None:
    got = dtype_name(x)
    allowed = (allowed,) if isinstance(allowed, str) else tuple(allowed)
    if got not in allowed:
        want = allowed[0] if len(allowed) == 1 else " or ".join(allowed)
        raise TypeError(f"{name}: expected dtype {want}, got {got}")


def _expect_ndim(name: str, x, ndim: int, letters: str) -> tuple[int, ...]:
    if not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    shape = _shape(x)
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected shape [{letters}], got {list(shape)}")
    return shape


def _check_cache(kv_cache, head_dim: int, preset) -> tuple[Layout, tuple[int, ...]]:
    shape = _expect_ndim("kv_cache", kv_cache, 4, "num_blocks, block_size, num_kv_heads, slot_bytes")
    _expect_dtype("kv_cache", kv_cache, "uint8")
    lay = make_layout(preset, head_dim)
    if shape[3] != lay.slot_bytes:
        raise ValueError(
            f"kv_cache: preset {lay.preset.name!r} at head_dim {head_dim} needs slot_bytes "
            f"{lay.slot_bytes} in the last dim, got shape {list(shape)}"
        )
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"kv_cache: expected num_blocks >= 1 and block_size >= 1, got shape {list(shape)}")
    return lay, shape


def check_store_kv(key, value, kv_cache, slot_mapping, *, preset: PresetLike) -> Layout:
    """Static checks of `store_kv` arguments; returns the slot layout.

    Shapes: key, value ``[T, Hkv, D]`` float16/bfloat16/float32 (same dtype);
    kv_cache ``uint8[N, P, Hkv, slot_bytes]``; slot_mapping ``[T]`` int32/int64.
    """
    get_preset(preset)
    ks = _expect_ndim("key", key, 3, "T, Hkv, D")
    _expect_dtype("key", key, FLOAT_DTYPES)
    vs = _expect_ndim("value", value, 3, "T, Hkv, D")
    _expect_dtype("value", value, FLOAT_DTYPES)
    if vs != ks:
        raise ValueError(f"value: expected the shape of key {list(ks)}, got {list(vs)}")
    if dtype_name(value) != dtype_name(key):
        raise TypeError(f"value: expected the dtype of key ({dtype_name(key)}), got {dtype_name(value)}")
    lay, cs = _check_cache(kv_cache, ks[2], preset)
    if cs[2] != ks[1]:
        raise ValueError(
            f"kv_cache: expected num_kv_heads {ks[1]} (from key) in dim 2, got shape {list(cs)}"
        )
    ss = _expect_ndim("slot_mapping", slot_mapping, 1, "T")
    _expect_dtype("slot_mapping", slot_mapping, SLOT_MAPPING_DTYPES)
    if ss[0] != ks[0]:
        raise ValueError(f"slot_mapping: expected shape [{ks[0]}] (one slot per key token), got {list(ss)}")
    return lay


def _check_optional_float(name: str, x, *, positive: bool) -> None:
    if x is None:
        return
    # math.isfinite, not numpy: torch.compile traces numpy calls into tensor branches.
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise TypeError(f"{name}: expected a finite float or None, got {x!r}")
    if positive and float(x) <= 0:
        raise ValueError(f"{name}: expected a value > 0, got {x!r}")


def check_paged_attention(
    query,
    kv_cache,
    block_table,
    seq_lens,
    query_start_loc,
    *,
    preset: PresetLike,
    scale=None,
    sliding_window=None,
    logits_soft_cap=None,
    sinks=None,
) -> Layout:
    """Static checks of `paged_attention` arguments; returns the slot layout.

    Shapes: query ``[T, Hq, D]`` float16/bfloat16/float32; kv_cache
    ``uint8[N, P, Hkv, slot_bytes]`` with ``Hq % Hkv == 0``; block_table
    ``int32[B, max_blocks]``; seq_lens ``int32[B]``; query_start_loc
    ``int32[B + 1]``; sliding_window None or int >= 1; logits_soft_cap None or
    > 0; scale None or finite; sinks None or float32 ``[Hq]``.
    """
    get_preset(preset)
    qs = _expect_ndim("query", query, 3, "T, Hq, D")
    _expect_dtype("query", query, FLOAT_DTYPES)
    lay, cs = _check_cache(kv_cache, qs[2], preset)
    hq, hkv = qs[1], cs[2]
    if hq < 1 or hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"query: num_q_heads (Hq={hq}) must be a positive multiple of num_kv_heads "
            f"(Hkv={hkv}, kv_cache dim 2)"
        )
    bt = _expect_ndim("block_table", block_table, 2, "B, max_blocks")
    _expect_dtype("block_table", block_table, INDEX_DTYPE)
    sl = _expect_ndim("seq_lens", seq_lens, 1, "B")
    _expect_dtype("seq_lens", seq_lens, INDEX_DTYPE)
    if sl[0] != bt[0]:
        raise ValueError(f"seq_lens: expected shape [{bt[0]}] (B from block_table), got {list(sl)}")
    qsl = _expect_ndim("query_start_loc", query_start_loc, 1, "B + 1")
    _expect_dtype("query_start_loc", query_start_loc, INDEX_DTYPE)
    if qsl[0] != bt[0] + 1:
        raise ValueError(
            f"query_start_loc: expected shape [{bt[0] + 1}] (B + 1), got {list(qsl)}"
        )
    _check_optional_float("scale", scale, positive=False)
    _check_optional_float("logits_soft_cap", logits_soft_cap, positive=True)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window: expected an int >= 1 or None, got {sliding_window!r}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window: expected an int >= 1 or None, got {sliding_window}")
    if sinks is not None:
        ss = _expect_ndim("sinks", sinks, 1, "Hq")
        _expect_dtype("sinks", sinks, "float32")
        if ss[0] != hq:
            raise ValueError(f"sinks: expected shape [{hq}] (one logit per query head), got {list(ss)}")
    return lay


def check_store_kv_values(key, value, kv_cache, slot_mapping, *, preset: PresetLike) -> Layout:
    """`check_store_kv` plus data checks: every slot in ``[-1, N * P)``, no duplicates."""
    lay = check_store_kv(key, value, kv_cache, slot_mapping, preset=preset)
    n, p = _shape(kv_cache)[:2]
    sm = np.asarray(slot_mapping).astype(np.int64)
    bad = (sm < -1) | (sm >= n * p)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"slot_mapping: expected entries in [-1, {n * p}) (num_blocks * block_size), "
            f"got {sm[i]} at index {i}"
        )
    used = sm[sm >= 0]
    uniq, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"slot_mapping: expected each slot at most once, got slot {uniq[np.argmax(counts > 1)]} "
            f"{counts.max()} times"
        )
    return lay


def check_paged_attention_values(
    query, kv_cache, block_table, seq_lens, query_start_loc, *, preset: PresetLike, **kwargs
) -> Layout:
    """`check_paged_attention` plus data checks on the metadata.

    query_start_loc starts at 0, is non-decreasing and ends at most at T (rows
    past its end are padding and attend to nothing); each q_len is
    at most its seq_len; seq_lens are >= 0 and fit in the block table; every
    block_table entry a sequence uses is in ``[0, num_blocks)``.
    """
    lay = check_paged_attention(
        query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, **kwargs
    )
    t = _shape(query)[0]
    n, p = _shape(kv_cache)[:2]
    bt = np.asarray(block_table).astype(np.int64)
    sl = np.asarray(seq_lens).astype(np.int64)
    qsl = np.asarray(query_start_loc).astype(np.int64)
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc: expected to start at 0, got {qsl[0]}")
    q_lens = np.diff(qsl)
    if (q_lens < 0).any():
        b = int(np.argmax(q_lens < 0))
        raise ValueError(
            f"query_start_loc: expected non-decreasing entries, got {qsl[b]} then {qsl[b + 1]} at index {b}"
        )
    if qsl[-1] > t:
        # Ending before T is allowed: rows past query_start_loc[B] are padding
        # (CUDA-graph / bucketed batches) and come back as zeros.
        raise ValueError(f"query_start_loc: expected to end at most at T={t} (the query rows), got {qsl[-1]}")
    if (sl < 0).any():
        b = int(np.argmax(sl < 0))
        raise ValueError(f"seq_lens: expected entries >= 0, got {sl[b]} for sequence {b}")
    capacity = bt.shape[1] * p
    if (sl > capacity).any():
        b = int(np.argmax(sl > capacity))
        raise ValueError(
            f"seq_lens: sequence {b} has {sl[b]} tokens but block_table holds at most "
            f"{bt.shape[1]} blocks x {p} = {capacity}"
        )
    if (q_lens > sl).any():
        b = int(np.argmax(q_lens > sl))
        raise ValueError(
            f"query_start_loc: sequence {b} has q_len {q_lens[b]} > seq_lens[{b}] = {sl[b]} "
            f"(queries are the last tokens of their sequence)"
        )
    blocks_used = (sl + p - 1) // p
    cols = np.arange(bt.shape[1])[None, :]
    used = cols < blocks_used[:, None]
    bad = used & ((bt < 0) | (bt >= n))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"block_table: entry [{b}, {j}] = {bt[b, j]} is outside [0, {n}) (num_blocks) "
            f"but sequence {b} uses {blocks_used[b]} blocks"
        )
    return lay
