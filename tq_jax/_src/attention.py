"""`paged_attention`: validation, path dispatch (tq_spec's table), and the jitted launch.

Static arguments (part of the compilation key): preset, scale, sliding_window,
logits_soft_cap, path, whether sinks are given, and every shape/dtype. The
arrays (query, cache, block_table, seq_lens, query_start_loc, sinks, rotation)
are dynamic. Nothing reads device data on the host, so the op works under
`jax.jit` and recompiles only when a static argument or a shape changes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import tq_spec
from tq_spec.dispatch import PATHS, problem_for, select_path

from . import config, gluon_decode
from . import kernel_math as km
from .attention_kernel import AttentionConfig
from .cache_access import CacheWords, needs_word_view, to_word_view
from .decode import decode_partials, merge_partials
from .extend import extend_attention
from .inputs import array, index_array, not_differentiable, validate_values
from .kv_tiles import TileSpec, constant_key_entries, key_tables
from .params import _default_tables, resolve
from .platform import by_lowering_platform, check_interpret, interpret_default
from .store import host_sign_form
from .workspace import dequantize_pages, workspace_preset

try:
    from jax.core import Tracer as _Tracer
except ImportError:  # pragma: no cover - newer jax keeps it private
    from jax._src.core import Tracer as _Tracer


# Device copies of the default rotation and codebook per (preset, head_dim):
# an eager call otherwise copies the D x D rotation to the device every time
# (tens of microseconds of host time). Only concrete arrays are kept: under a
# trace `resolve` returns tracers, which must never outlive their trace.
_DEFAULT_TABLES: dict = {}


def _kernel_tables(preset, head_dim: int, rotation, codebook):
    """``(rotation, centroids)`` for the kernels (None, None for non-mse presets); see `resolve`."""
    default = rotation is None and codebook is None
    key = (preset.name, head_dim)
    if default and key in _DEFAULT_TABLES:
        return _DEFAULT_TABLES[key]
    kp = resolve(preset, head_dim, rotation, codebook)
    out = (kp.rotation, kp.centroids)
    if default and not any(isinstance(x, _Tracer) for x in out):
        _DEFAULT_TABLES[key] = out
    return out


def query_rotation(preset, head_dim: int, rotation, rot, query_dtype):
    """``(operand, rotation_scale)`` of `_attend`'s query rotation; ``rotation_scale`` is static.

    ``rot``: the rotation `_kernel_tables` gives (None for non-mse presets). A 16-bit query
    with a rotation known on the host to be ``Pi = c * S``, ``S = +-1`` (tq_spec's default, or
    such an array-like; `store.host_sign_form`) gets ``S`` in the query's dtype and ``c``:
    exact products on tensor cores (`_attend`). Anything else gets ``(rot, None)``, the IEEE fp32 einsum.
    """
    if rot is None or jnp.dtype(query_dtype).itemsize != 2:
        return rot, None
    form = host_sign_form(preset.name, head_dim, rotation)
    if form is None:
        return rot, None
    key = ("signs", preset.name, head_dim, jnp.dtype(query_dtype).name)
    signs = _DEFAULT_TABLES.get(key) if rotation is None else None
    if signs is None:
        signs = jnp.asarray(form[0].T, query_dtype)  # form[0] is S^T
        if rotation is None and not isinstance(signs, _Tracer):
            _DEFAULT_TABLES[key] = signs
    return signs, form[1]


def rotate_query(query, rotation, rotation_scale):
    """``Pi @ q`` per row of ``query [T, Hq, D]``, with `query_rotation`'s operand and scale.

    ``rotation_scale`` c (``rotation`` is then ``S = +-1`` in the query's 16-bit dtype): the
    products are exact and their fp32 sums exact unless the magnitudes span more than 2**16,
    so the result is float64 ``Pi @ q`` rounded to fp32, then to the query's dtype (the
    rounding the kernels would apply; tq_torch's `rotate_query` gives the same bits).
    None: ``rotation`` is ``Pi``, an IEEE fp32 einsum, float32 result.
    """
    if rotation_scale is not None:
        return (jnp.einsum("thd,rd->thr", query, rotation, preferred_element_type=jnp.float32)
                * jnp.float32(rotation_scale)).astype(query.dtype)
    return jnp.einsum("thd,rd->thr", query.astype(jnp.float32), rotation, precision=lax.Precision.HIGHEST)


def paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset, scale=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None, codebook=None,
                    path="auto", interpret=None, validate=None):
    """Paged attention over the (quantized) cache, DESIGN.md section 3.

    Args:
      query: ``[T, Hq, D]`` float16/bfloat16/float32; sequence ``b`` owns rows
        ``[query_start_loc[b], query_start_loc[b+1])``, its last ``q_len`` tokens.
        Rows past ``query_start_loc[B]`` are padding (bucketed T, CUDA graphs).
      kv_cache: ``uint8[N, P, Hkv, slot_bytes]``, written by `store_kv`.
      block_table: ``int32[B, max_blocks]``; seq_lens ``int32[B]``;
        query_start_loc ``int32[B + 1]`` (0, non-decreasing, ends at or
        before T). Requests with ``q_len == 0`` (and ``seq_len == 0``) are
        allowed. numpy integer arrays are converted to int32 on the host
        (ValueError if a value does not fit).
      preset: preset name or `tq_spec.Preset` (static).
      scale: logit scale (static), default ``1/sqrt(D)``.
      sliding_window: None or ``W >= 1`` (static): query at position ``i`` sees
        keys ``i - W < j <= i``.
      logits_soft_cap: None or ``cap > 0`` (static): ``cap * tanh(s / cap)``
        on scaled logits, before masking.
      sinks: None or float32 ``[Hq]``: per-head logits added to the softmax
        denominator only.
      rotation, codebook: mse presets only; see `tq_spec.quant_params`.
      path: ``"auto"``, ``"decode"`` or ``"extend"`` (static; tq_spec.dispatch).
      interpret: None (automatic, decided by the lowering platform: Triton for
        cuda/rocm, Pallas interpret mode elsewhere) or True/False (static).
      validate: full validation of the metadata values (ranges, monotonic
        query_start_loc, q_len <= seq_len, block ids in range), with the
        reference's ValueError. It reads values on the host (a sync), so it
        is off by default; None means the process default, ``TQ_VALIDATE=1``.

    Returns:
      ``[T, Hq, D]`` in the query dtype. Rows with no visible key and padding
      rows (outside ``[query_start_loc[0], query_start_loc[B])``) are zeros;
      NaN/Inf in a visible query, key, value or sink propagate (a NaN query
      row gives a NaN output row). Dots take operands in the query dtype
      (float32 queries: IEEE fp32) and accumulate in float32.

    Raises:
      ValueError/TypeError for malformed arguments (tq_spec.validation; torch
      tensors included), NotImplementedError for a forced path that cannot
      run the problem and under `jax.grad`/`jax.jvp`.
    """
    # Host time is the cost of a B=1 decode step: a call whose static facts already passed every
    # check skips the checks, the dispatcher and the table lookups (same errors, same order: only
    # passing signatures are remembered; tq_torch's `api._paged_attention` does the same).
    signature = _static_signature(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, preset,
                                  scale, sliding_window, logits_soft_cap, rotation, codebook, path, interpret,
                                  validate)
    launch = _CHECKED.get(signature) if signature is not None else None
    if launch is None:
        lay, (query, kv_cache, block_table, seq_lens, query_start_loc, sinks) = checked_arguments(
            query, kv_cache, block_table, seq_lens, query_start_loc, sinks, preset=preset, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, interpret=interpret,
            validate=validate)
        d = int(query.shape[2])
        problem = problem_for(query, kv_cache, block_table, preset=lay.preset, sliding_window=sliding_window)
        chosen = select_path(problem, path)
        rot, cents = _kernel_tables(lay.preset, d, rotation, codebook)
        rot, rotation_scale = query_rotation(lay.preset, d, rotation, rot, query.dtype)
        launch = (rot, cents, dict(
            preset_name=lay.preset.name, scale=float(1.0 / math.sqrt(d) if scale is None else scale),
            sliding_window=None if sliding_window is None else int(sliding_window),
            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            path=chosen, num_splits=None, interpret=interpret, rotation_scale=rotation_scale,
            key_entries=_default_key_entries(lay.preset, d, query.dtype, chosen, rotation, codebook,
                                             num_seqs=int(block_table.shape[0]))))
        if signature is not None and not any(isinstance(x, _Tracer) for x in (rot, cents)):
            if len(_CHECKED) >= _MAX_CHECKED:
                _CHECKED.clear()
            _CHECKED[signature] = launch
    rot, cents, static = launch
    return _paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, rot, cents, **static)


# Static facts of calls that passed every static check (see `paged_attention`): signature ->
# (rotation operand, centroids, static arguments of `_paged_attention`). Bounded: eager
# prefills bring new shapes every call.
_CHECKED: dict = {}
_MAX_CHECKED = 1024


def _static_signature(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, preset, scale,
                      sliding_window, logits_soft_cap, rotation, codebook, path, interpret, validate):
    """Everything the static checks, the dispatcher and the table lookups read, or None.

    None (no remembering) for user rotation/codebook, value validation, non-str preset or path,
    and arrays that are not jax arrays (numpy inputs are converted by the checks). Python
    types are part of it (``True == 1`` but ``sliding_window=True`` is a TypeError).
    """
    # A bad `validate` is reported by the full checks, after the arrays' (the order of errors).
    if (type(preset) is not str or type(path) is not str or rotation is not None or codebook is not None
            or (validate is not None and type(validate) is not bool)
            or tq_spec.validation.validate_enabled(validate)):
        return None
    arrays = (query, kv_cache, block_table, seq_lens, query_start_loc)
    if not all(isinstance(x, jax.Array) for x in arrays) or not (sinks is None or isinstance(sinks, jax.Array)):
        return None
    try:
        signature = (preset, path, *((x.shape, x.dtype) for x in arrays),
                     None if sinks is None else (sinks.shape, sinks.dtype), type(scale), scale,
                     type(sliding_window), sliding_window, type(logits_soft_cap), logits_soft_cap,
                     type(interpret), interpret)
        hash(signature)
    except TypeError:  # an unhashable argument: the full checks report it
        return None
    return signature


def checked_arguments(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, *, preset, scale,
                      sliding_window, logits_soft_cap, interpret, validate):
    """The arrays of a `paged_attention` call, converted and checked (every entry point's first step).

    Shapes and dtypes always (tq_spec.validation, raising its ValueError/TypeError);
    metadata values too when `validate` (or ``TQ_VALIDATE=1``) asks for them.

    Returns:
      ``(layout, (query, kv_cache, block_table, seq_lens, query_start_loc, sinks))``: the
      `tq_spec.layout` of the preset and the arguments as jax arrays (sinks may be None).
    """
    query, kv_cache = array("query", query), array("kv_cache", kv_cache)
    block_table, seq_lens, query_start_loc = (
        index_array(n, x) for n, x in (("block_table", block_table), ("seq_lens", seq_lens),
                                       ("query_start_loc", query_start_loc)))
    sinks = array("sinks", sinks, optional=True)
    lay = tq_spec.validation.check_paged_attention(
        query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
    )
    check_interpret(interpret)
    if tq_spec.validation.validate_enabled(validate):
        validate_values(tq_spec.validation.check_paged_attention_values,
                        dict(block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc),
                        query=query, kv_cache=kv_cache, preset=preset, scale=scale,
                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    return lay, (query, kv_cache, block_table, seq_lens, query_start_loc, sinks)


@functools.partial(
    jax.jit,
    static_argnames=("preset_name", "scale", "sliding_window", "logits_soft_cap", "path", "num_splits",
                     "interpret", "word_view", "poison", "rotation_scale", "key_entries"),
)
def _paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, rotation, centroids, *,
                     preset_name, scale, sliding_window, logits_soft_cap, path, num_splits, interpret,
                     word_view=None, poison=False, rotation_scale=None, key_entries=None):
    """The jitted op: `paged_attention_call` per lowering platform, not differentiable.

    ``rotation``, ``rotation_scale``: as `query_rotation` gives them.
    """
    call = functools.partial(
        paged_attention_call, preset_name=preset_name, scale=scale, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, path=path, num_splits=num_splits, word_view=word_view, poison=poison,
        rotation_scale=rotation_scale, key_entries=key_entries,
    )

    def op(*arrays):
        return by_lowering_platform(call, *arrays, interpret=interpret)

    return not_differentiable("tq_jax.paged_attention", op)(
        query, kv_cache, block_table, seq_lens, query_start_loc, sinks, rotation, centroids)


# Smallest batch whose decode takes constant table entries (`_default_key_entries`): measured
# faster at 32 sequences; at 1 the loop without the prefetch read slower (steps.md, sessions 28
# and 29: that row is host-bound and noisy); not measured in between.
CONSTANT_ENTRY_MIN_SEQS = 8


def _default_key_entries(preset, head_dim: int, query_dtype, path: str, rotation, codebook, *, num_seqs: int):
    """`kv_tiles.constant_key_entries` of the default codebook for the decode path of 4-bit mse
    keys with a 16-bit query and at least `CONSTANT_ENTRY_MIN_SEQS` sequences; None otherwise
    (user codebooks, other paths, presets and dtypes, small batches: see `_attend`)."""
    if (path != "decode" or num_seqs < CONSTANT_ENTRY_MIN_SEQS or rotation is not None or codebook is not None
            or preset.key_format != "mse" or preset.key_bits != 4 or jnp.dtype(query_dtype).itemsize != 2):
        return None
    return _constant_entries(preset.name, head_dim, jnp.dtype(query_dtype).name, preset.norm_correction)


@functools.lru_cache(maxsize=64)
def _constant_entries(preset_name: str, head_dim: int, dtype_name: str, norm_correction: bool):
    centroids = _default_tables(preset_name, head_dim)[0]
    return constant_key_entries(centroids, 4, dtype_name, norm_correction)


def attention_compute_dtype(query_dtype) -> str:
    """Dtype of the attention dot operands for a query dtype (name or dtype).

    The query's own dtype: ``"bfloat16"``/``"float16"`` (tensor-core dots with
    float32 accumulation) or ``"float32"`` (IEEE fp32 dots, never TF32). This
    is the ``compute_dtype`` to give `parity.tolerances.check_attention`.
    """
    return jnp.dtype(query_dtype).name


def paged_attention_call(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, rotation, centroids,
                         *, preset_name: str, scale: float, sliding_window, logits_soft_cap, path: str,
                         num_splits: int | None, interpret: bool | None, word_view: bool | None = None,
                         poison: bool = False, rotation_scale: float | None = None, key_entries=None):
    """The launch without validation (traced inside `_paged_attention`).

    `num_splits` None picks the decode split count from the shapes; `word_view`
    None picks the cache view from its size (tests force both); `poison`
    makes the kernels write into NaN-filled buffers (tests); `interpret`
    None falls back to `interpret_default()` (direct calls in tests);
    ``rotation_scale``: see `query_rotation` (None: ``rotation`` is ``Pi`` itself);
    ``key_entries``: `kv_tiles.constant_key_entries` of ``centroids`` (decode path) or None.
    """
    t, hq, d = query.shape
    if t == 0 or seq_lens.shape[0] == 0:  # no rows, or B = 0: every row is padding (zeros)
        return jnp.zeros(query.shape, query.dtype)
    if interpret is None:
        interpret = interpret_default()
    out = _attend(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, rotation, centroids,
                  preset_name=preset_name, scale=scale, sliding_window=sliding_window,
                  logits_soft_cap=logits_soft_cap, path=path, num_splits=num_splits, interpret=interpret,
                  word_view=word_view, poison=poison, rotation_scale=rotation_scale, key_entries=key_entries)
    if path != "decode":  # the extend kernels zero padding rows themselves (`extend.zero_padding_rows`)
        return out
    # Padding rows (T bucketed past query_start_loc[B]) belong to no sequence: the decode
    # merge's kernel does not write them, so they are zeroed here, fused into the merge.
    row = lax.broadcasted_iota(jnp.int32, (t, 1, 1), 0)
    owned = (row >= query_start_loc[0]) & (row < query_start_loc[-1])
    return jnp.where(owned, out, jnp.zeros((), out.dtype))


def _attend(query, kv_cache, block_table, seq_lens, query_start_loc, sinks, rotation, centroids, *,
            preset_name, scale, sliding_window, logits_soft_cap, path, num_splits, interpret, word_view,
            poison, rotation_scale=None, key_entries=None):
    """The chosen path's kernel (+ the decode merge): ``[T, Hq, D]``; padding rows are zero on the
    extend and dequant paths, unspecified on the decode path."""
    t, hq, d = query.shape
    n, page, hkv, _ = kv_cache.shape
    group = hq // hkv
    lay = tq_spec.layout(preset_name, d)
    cdt = attention_compute_dtype(query.dtype)
    # Rotate once per query (y = Pi @ q); scores are taken in the rotated space.
    q = query if rotation is None else rotate_query(query, rotation, rotation_scale)
    tables = None
    if centroids is not None:
        tables = key_tables(centroids, lay.preset.key_bits, cdt, lay.preset.norm_correction)
    if kv_cache.dtype.itemsize == 2:  # the dequant workspace: 16-bit elements, a word view already
        word_view, cache = True, kv_cache
    else:
        if word_view is None:
            word_view = needs_word_view(kv_cache.shape)
        cache = to_word_view(kv_cache) if word_view else kv_cache
    if path not in PATHS:
        raise ValueError(f"path: expected one of {tuple(PATHS)} after dispatch, got {path!r}")
    if path == "dequant":
        # Every page once into a 16-bit raw cache (keys in scoring space), then the
        # extend tiles over it with the query already rotated (`workspace`).
        ws, ws_table = dequantize_pages(cache, block_table, seq_lens, centroids, preset_name=preset_name,
                                        head_dim=d, ws_dtype=query.dtype, word_view=word_view,
                                        interpret=interpret)
        return _attend(q.astype(query.dtype), ws, ws_table, seq_lens, query_start_loc, sinks, None, None,
                       preset_name=workspace_preset(query.dtype), scale=scale, sliding_window=sliding_window,
                       logits_soft_cap=logits_soft_cap, path="extend", num_splits=None, interpret=interpret,
                       word_view=None, poison=poison)
    if path == "decode" and sliding_window is None and logits_soft_cap is None and kv_cache.dtype == jnp.uint8:
        why = gluon_decode.ineligible(lay, query_dtype=query.dtype, num_tokens=t, num_seqs=block_table.shape[0],
                                      num_q_heads=hq, kv_cache_shape=tuple(kv_cache.shape), interpret=interpret)
        if why is None:
            # The decode path's kernel on sm_90, shared with tq_torch (`gluon_decode`): same function, same
            # metadata guards; calls with a window or a soft cap keep the Pallas kernels.
            ns = num_splits or gluon_decode.num_splits(
                num_kv_heads=hkv, num_tokens=t, num_q_heads=hq, num_seqs=block_table.shape[0],
                max_context=block_table.shape[1] * page, head_dim=d)
            return gluon_decode.decode(q.astype(query.dtype), kv_cache, centroids, block_table, seq_lens,
                                       query_start_loc, sinks, layout=lay, scale=scale, num_splits=int(ns))
    d_pad = config.padded_head_dim(d)
    # Constant table entries on the GPU's decode path (`kv_tiles.TileSpec.key_entries`; the public
    # op passes them for batches of `CONSTANT_ENTRY_MIN_SEQS` sequences or more). Their loop runs
    # without the hand prefetch: a raw tile carried from the last step is defined outside the loop
    # body, which would keep the decoded tiles in shared memory. (H100, B = 32 x 8k 4bit_nc: 0.404
    # -> 0.388 ms; B = 1 x 4k, where the prefetch hides the latency of few programs: 0.046 -> 0.067
    # ms; steps.md, sessions 28 and 29.)
    constant_entries = key_entries is not None and path == "decode" and not interpret
    tiles = config.attention_tiles(d_pad, interpret, path, config.key_kind(lay.preset))
    if path == "decode":
        tiles = config.decode_tiles(tiles, group, packed=constant_entries)
    spec = TileSpec(
        lay=lay, access=CacheWords(word_view), block_size=int(page), num_blocks=int(n),
        max_blocks=int(block_table.shape[1]), block_n=tiles["block_n"], head_dim_padded=d_pad,
        compute_dtype=cdt, use_ptx=not interpret,
        fp8_convert=config.fp8_hardware_convert(interpret), shuffle_lookup=not interpret,
        key_entries=key_entries if constant_entries else None,
        prefetch=tiles["prefetch"] and not constant_entries,
    )
    common = dict(tiles=spec, num_q_heads=hq, group=group, scale=scale, window=sliding_window,
                  soft_cap=logits_soft_cap, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
                  max_registers=tiles["max_registers"], unmasked_tiles=tiles["unmasked_tiles"])
    if path == "decode":
        ns = num_splits or config.decode_num_splits(
            num_seqs=block_table.shape[0], num_kv_heads=hkv, num_tokens=t, num_q_heads=hq, head_dim=d,
            max_context=block_table.shape[1] * page, block_n=spec.block_n, interpret=interpret,
            programs_per_sm=tiles["programs_per_sm"])
        cfg = AttentionConfig(block_m=config.decode_block_m(group), split_kv=True, num_splits=int(ns), **common)
        acc, m, l = decode_partials(cfg, q, cache, block_table, seq_lens, query_start_loc, tables,
                                    interpret=interpret, poison=poison)
        return merge_partials(acc, m, l, sinks=sinks, out_dtype=query.dtype)
    cfg = AttentionConfig(block_m=max(tiles["extend_block_m"], km.next_pow2(group)), split_kv=False,
                          num_splits=1, **common)
    return extend_attention(cfg, q, cache, block_table, seq_lens, query_start_loc, tables, sinks,
                            out_dtype=query.dtype, interpret=interpret, poison=poison)
