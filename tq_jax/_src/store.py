"""`store_kv`: quantize K/V and scatter them into the paged cache (one Pallas kernel).

tq_torch's ``store`` translated to Pallas (same structure and names). Rows
``r`` = (token ``r // Hkv``, kv head ``r % Hkv``) are encoded ``block_r`` at a
time; a grid of resident programs loops over the row tiles, so the rotation
operand is loaded once per program, and with ``prefetch`` the next tile's
K/V loads are in flight (in the `lax.fori_loop` carry) while this one is
encoded. Per tile:

* mse keys: ``n = ||k||``; the rotation runs on tensor cores as
  ``Y = K @ Pi^T``. For tq_spec's rotations (and any rotation given as
  numpy data whose entries are all ``+-c``) the kernel multiplies by the
  exact +-1 sign matrix and scales by ``c / (n + 1e-8)`` per row: bf16/fp16
  keys are dot operands as they are, fp32 keys are split into three bf16
  parts whose sum is the key exactly; products are exact, sums fp32. A jax
  array rotation (its values are not known when tracing) is split into three
  bf16 parts as well (six dots, about fp32 accuracy). Codes come from a
  binary search over the midpoints (`bucketize`).
* fp8 keys: saturate to +-448, round to nearest even, NaN kept: a hardware
  cast of the clamped key on sm_89+ (and in interpret mode), else an exact
  integer encode (`kernel_math.fp8_e4m3fn_encode`).
* uniform values: ``lo``, ``hi``, ``scale = max((hi - lo) / (2**b - 1), 1e-8)``
  and ``code = clamp(floor((v - lo) / scale + 0.5), 0, 2**b - 1)`` with the
  correctly rounded fp32 quotient (one reciprocal per row, FMA corrections
  per element through PTX; interpret mode divides, exactly: see `_div_rn`).
* raw presets: a 16-bit copy (rounded to the cache dtype when it differs).

Every field is built as 16-bit words in registers and written as one tile
per field: uint16 words on the word view of the cache, else the words'
bytes (Triton vectorises to the alignment it can prove). A row whose slot is
outside ``[0, N * P)`` is not written: on the GPU its stores are masked, as
in tq_torch. In interpret mode such a row is instead *redirected to the
tile's first written row* (same inputs, same slot, identical bytes):
interpret mode implements a masked store as a read-modify-write of every
lane, which would race with a written lane of the same slot; a tile with no
written row is skipped. There is one writer per slot and no atomics. The
cache is aliased input -> output (`input_output_aliases`): under
``jax.jit(..., donate_argnums=...)``, or eagerly with
``store_kv(..., donate_cache=True)``, the update happens in place; without
donation XLA copies the cache first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import tq_spec

from . import gluon_store
from . import kernel_math as km
from .cache_access import WordFields, from_word_view, needs_word_view, to_word_view
from .config import fp8_hardware_convert
from .inputs import array, index_array, not_differentiable, validate_values
from .params import _default_tables, resolve
from .platform import by_lowering_platform, check_interpret, interpret_default, pallas_kwargs

NORM_EPS = 1e-8
VALUE_SCALE_MIN = 1e-8
_F32_MAX = float(np.finfo(np.float32).max)

# Rotation operand kinds (tq_torch's ROT_MODE).
ROT_SIGNS = 0  # Pi = c * S with S = +-1: S^T in the dot dtype, exact products
ROT_GENERAL = 1  # any Pi: float32 Pi, split into bf16 parts (six dots)
# Midpoint searches (tq_torch's MID_MODE; see `bucketize`).
MID_SYMMETRIC, MID_SORTED, MID_ANY = 0, 1, 2

# Tile settings at D=128 by key format (see `store_tiles`). Swept on an H100
# (T = 32k, Hkv 8, bf16 input; block_r 16/32/64, warps 4/8/16, programs_per_sm
# 1/2/4, prefetch; one process, bytes identical across settings): mse keeps
# tq_torch's 64 rows x 16 warps x 1 program (4bit_nc 183, 3bit_nc 180, k3v4_nc
# 182 us; 32 x 4 x 4 gave 180 / 166 / 172 us but spills 150-270 bytes a thread
# when Triton 3.9 builds it for sm_90a); fp8 went 155 -> 140 us with
# 32 rows x 4 warps x 4 programs (103 registers, no spills).
# `TUNING_OVERRIDES` replaces any setting, for tuning runs only (keys:
# "block_r", "num_warps", "programs_per_sm", "num_stages", "rot_n",
# "prefetch"); it is read when a call is traced.
_TILES_D128 = {
    "mse": dict(block_r=64, num_warps=16, programs_per_sm=1, prefetch=True),
    "mse_general": dict(block_r=16, num_warps=4, programs_per_sm=2, prefetch=False),
    "fp8": dict(block_r=32, num_warps=4, programs_per_sm=4, prefetch=False),
    "raw": dict(block_r=64, num_warps=8, programs_per_sm=4, prefetch=False),
}
_INTERPRET_BLOCK_R = 16
TUNING_OVERRIDES: dict = {}
_DEFAULT_SM_COUNT = 132  # H100 SXM; used when no GPU is visible (export from a CPU host)


def store_kv(key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None, interpret=None,
             donate_cache=False, validate=None):
    """Quantizes ``key``/``value`` and writes them into the slots named by `slot_mapping`.

    Args:
      key, value: ``[T, Hkv, D]`` float16/bfloat16/float32 (same dtype).
      kv_cache: ``uint8[N, P, Hkv, slot_bytes]`` (vLLM layout; see `tq_spec.layout`).
      slot_mapping: ``int32/int64[T]``; token ``t`` goes to block ``s // P``,
        offset ``s % P`` with ``s = slot_mapping[t]``; ``-1`` skips the token.
        Entries must be unique. A slot outside ``[0, N * P)`` is not written
        (guarded on device). numpy int64 is converted to int32 on the host
        (ValueError if a value does not fit).
      preset: a preset name or `tq_spec.Preset` (static).
      rotation: mse presets only: None (tq_spec's Hadamard) or ``float[D, D]``.
        numpy data with all entries ``+-c`` (tq_spec's rotations) takes the
        exact sign path; a jax array takes the general path (six dots).
      codebook: mse presets only: None (flavor "vllm") or a `tq_spec.Codebook`.
      interpret: None (automatic: the Triton lowering when compiled for
        cuda/rocm, Pallas interpret mode for any other platform, decided at
        lowering time, so `jax.export` for CUDA works from a CPU host), or
        True/False to force it (static).
      donate_cache: donate `kv_cache` to an eager call, so the cache is updated
        in place instead of copied (the whole cache is copied per call
        otherwise). The input array is then *consumed*: it is deleted (reading
        it raises) and only the returned cache is valid. Under an outer
        `jax.jit` it has no effect: donate at that jit (``donate_argnums``).
      validate: full validation of `slot_mapping`'s values (in ``[-1, N * P)``,
        no duplicates), with the reference's ValueError; reads values on the
        host (a sync), so off by default; None means ``TQ_VALIDATE=1``.

    Returns:
      The new cache (same shape/dtype). Every byte outside the named slots is
      unchanged.

    Raises:
      TypeError/ValueError naming the argument for malformed input (torch
      tensors included); NotImplementedError under `jax.grad`/`jax.jvp`.

    Static (trigger recompilation): preset, interpret, donate_cache, shapes and
    dtypes, whether the rotation is numpy +-c data (and its ``c``) and the
    codebook's symmetry; the arrays and the rotation/codebook values are dynamic.
    """
    key, value, kv_cache = (array(n, x) for n, x in (("key", key), ("value", value), ("kv_cache", kv_cache)))
    slot_mapping = index_array("slot_mapping", slot_mapping)
    lay = tq_spec.validation.check_store_kv(key, value, kv_cache, slot_mapping, preset=preset)
    check_interpret(interpret)
    if tq_spec.validation.validate_enabled(validate):
        validate_values(tq_spec.validation.check_store_kv_values, dict(slot_mapping=slot_mapping),
                        key=key, value=value, kv_cache=kv_cache, preset=preset)
    kp = resolve(preset, lay.head_dim, rotation, codebook)
    rot, rot_form, mid_mode = store_operands(lay, kp, rotation, codebook, key.dtype)
    fn = _store_kv_donated if donate_cache else _store_kv
    return fn(key, value, kv_cache, slot_mapping, rot, kp.midpoints, preset_name=lay.preset.name,
              interpret=interpret, rotation_form=rot_form, midpoint_mode=mid_mode,
              default_tables=rotation is None and codebook is None)


# --------------------------------------------------------------------------- host-side operand forms


@functools.lru_cache(maxsize=64)
def _sign_form(rotation_bytes: bytes, d: int):
    """(``S^T`` float32 numpy, ``c``) if the float32 rotation is ``c * S`` with ``S = +-1``, else None."""
    rot = np.frombuffer(rotation_bytes, dtype=np.float32).reshape(d, d)
    c = float(abs(rot[0, 0]))
    if not (np.isfinite(c) and c > 0 and np.all(np.abs(rot) == np.float32(c))):
        return None
    out = np.ascontiguousarray(np.where(rot > 0, 1.0, -1.0).astype(np.float32).T)
    out.setflags(write=False)
    return out, c


def _midpoint_form(mid: np.ndarray) -> int:
    """MID_SYMMETRIC / MID_SORTED / MID_ANY for float32 midpoints (see `bucketize`)."""
    n = mid.size
    if n < 3 or not np.all(np.diff(mid) > 0):
        return MID_ANY
    if mid[n // 2] == 0 and np.array_equal(mid, -mid[::-1]):
        return MID_SYMMETRIC
    return MID_SORTED


def host_sign_form(preset_name: str, d: int, rotation):
    """`_sign_form` of a rotation whose values the host can read, else None.

    ``rotation``: None (tq_spec's default) or array-like; a jax array, whose values a trace
    cannot see, gives None (the general path). Used by the store and the query rotation.
    """
    if isinstance(rotation, jax.Array):
        return None
    rot = _default_tables(preset_name, d)[2] if rotation is None else np.asarray(rotation, np.float32)
    return _sign_form(np.ascontiguousarray(rot, dtype=np.float32).tobytes(), d)


def store_operands(lay, kp, rotation, codebook, key_dtype):
    """(rotation operand, static ``rotation_form``, static ``midpoint_mode``) for `store_kv_call`.

    The forms are decided on the host from numpy data (tq_spec's default
    rotation and codebook, numpy rotations, every `tq_spec.Codebook`); a jax
    array rotation, whose values a trace cannot see, takes the general path.
    Only numpy results are cached; the jax operand is made per call.
    """
    if lay.preset.key_format != "mse":
        return None, None, None
    d = lay.head_dim
    qp = tq_spec.quant_params(lay.preset, d, codebook=codebook)
    mid_mode = _midpoint_form(np.asarray(qp.codebook.midpoints, np.float32))
    form = host_sign_form(lay.preset.name, d, rotation)
    if form is None:
        return kp.rotation, (ROT_GENERAL, 1.0), mid_mode
    op_dtype = jnp.float16 if jnp.dtype(key_dtype) == jnp.float16 else jnp.bfloat16
    return jnp.asarray(form[0], op_dtype), (ROT_SIGNS, form[1]), mid_mode


def _store_kv_impl(key, value, kv_cache, slot_mapping, rotation, midpoints, *, preset_name, interpret,
                   rotation_form, midpoint_mode, default_tables=False):
    n, p = kv_cache.shape[:2]
    # Memory safety whatever the values: a slot outside the cache is skipped
    # (compared before narrowing, so an int64 slot cannot wrap into range).
    slots = jnp.where((slot_mapping >= 0) & (slot_mapping <= min(n * p - 1, 2**31 - 1)), slot_mapping, -1)
    slots = slots.astype(jnp.int32)

    def call(key, value, kv_cache, slots, rotation, midpoints):
        return by_lowering_platform(
            functools.partial(store_kv_call, preset_name=preset_name, rotation_form=rotation_form,
                              midpoint_mode=midpoint_mode, default_tables=default_tables),
            key, value, kv_cache, slots, rotation, midpoints, interpret=interpret)

    return not_differentiable("tq_jax.store_kv", call)(key, value, kv_cache, slots, rotation, midpoints)


_STORE_STATIC = ("preset_name", "interpret", "rotation_form", "midpoint_mode", "default_tables")
_store_kv = jax.jit(_store_kv_impl, static_argnames=_STORE_STATIC)
# The cache buffer is reused for the output (the kernel aliases it).
_store_kv_donated = jax.jit(_store_kv_impl, static_argnames=_STORE_STATIC, donate_argnums=(2,))


# --------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class StoreConfig:
    """Static description of one store kernel."""

    lay: tq_spec.Layout
    fields: WordFields
    word_view: bool  # the cache ref is uint16 words, else uint8
    num_kv_heads: int
    block_size: int  # P
    num_slots: int  # N * P
    n_rows: int  # T * Hkv
    head_dim_padded: int
    in_dtype: str
    rot_mode: int
    rot_scale: float
    rot_n: int
    mid_mode: int
    block_r: int
    prefetch: bool
    ptx: bool  # GPU lowering: IEEE division/FMAs through PTX; interpret mode divides
    fp8_convert: bool = False  # fp8 keys by a clamped hardware cast (sm_89+), else the integer encode

    @property
    def n_tiles(self) -> int:
        return -(-self.n_rows // self.block_r)

    @property
    def rot_resident(self) -> bool:
        return self.lay.preset.key_format == "mse" and self.lay.head_dim <= self.rot_n


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    try:
        return int(jax.devices("gpu")[0].core_count)
    except Exception:  # no GPU backend (a CPU host exporting for CUDA)
        return _DEFAULT_SM_COUNT


def store_tiles(d_pad: int, key_format: str, rot_mode: int, in_bytes: int, interpret: bool) -> dict:
    """Launch settings for one head dim, key format and input width (plus `TUNING_OVERRIDES`).

    Same table and rules as tq_torch's `store_tiles`, without its default
    register cap (`platform.pallas_kwargs` could set one; not measured for the store).
    """
    rot_n = d_pad if d_pad <= 256 else 128
    if interpret:
        return dict(block_r=_INTERPRET_BLOCK_R, num_warps=4, num_stages=1, rot_n=rot_n, programs_per_sm=1,
                    prefetch=True)
    kind = key_format if key_format in ("mse", "fp8") else "raw"
    if kind == "mse" and rot_mode == ROT_GENERAL:
        kind = "mse_general"
    tiles = dict(dict(num_stages=1, rot_n=min(rot_n, 128)), **_TILES_D128[kind])
    if kind == "mse_general":
        # Three bf16 parts of a [D, rot_n] slice of Pi in shared memory: <= 96 KiB.
        tiles["rot_n"] = min(d_pad, 16384 // d_pad)
        if d_pad > 128:
            tiles.update(num_warps=8, programs_per_sm=1)  # the three key parts of wide heads
    # Same elements per program at other head dims (at least the 16 rows of a dot).
    tiles["block_r"] = max(16, tiles["block_r"] * 128 // d_pad)
    if kind == "mse":
        tiles["rot_n"] = rot_n
        if d_pad > 128 or in_bytes > 2:
            tiles.update(prefetch=False)
        if in_bytes > 2 or d_pad > 256:
            tiles.update(num_warps=8)
        if in_bytes > 2 and d_pad > 128:
            tiles.update(block_r=16)
        if d_pad > 256:
            tiles.update(rot_n=32)
    tiles.update(TUNING_OVERRIDES)
    return tiles


def store_kv_call(key, value, kv_cache, slot_mapping, rotation, midpoints, *, preset_name: str,
                  interpret: bool | None, word_view: bool | None = None, rotation_form=None,
                  midpoint_mode: int | None = None, default_tables: bool = False):
    """The bare `pallas_call` (no validation, no int64 slot narrowing); traced inside `_store_kv`.

    ``rotation``: mse presets: the operand `store_operands` made (``S^T`` in
    the dot dtype for ``rotation_form == (ROT_SIGNS, c)``), or float32 ``Pi``
    for the default ``rotation_form`` None (the general path). ``midpoints``:
    float32 ``[16]`` (`tq_jax._src.params`); ``midpoint_mode`` None is the
    linear count, valid for any midpoints. Slots outside ``[0, N * P)`` are
    not written. `interpret` None falls back to `interpret_default()` (direct
    calls in tests); `word_view` None picks the cache view from its size
    (`needs_word_view`); tests force True/False to run both kernel variants
    on small caches. ``default_tables``: ``rotation`` and ``midpoints`` are the preset's defaults (static;
    the Gluon store on sm_90 writes those only, `gluon_store`).
    """
    t, hkv, d = key.shape
    if t == 0:
        return kv_cache
    if interpret is None:
        interpret = interpret_default()
    n, page = kv_cache.shape[:2]
    if gluon_store.ineligible(preset_name, key_dtype=key.dtype, value_dtype=value.dtype, head_dim=d,
                              num_slots=n * page, default_tables=default_tables, interpret=interpret) is None:
        # The store's kernel on sm_90, shared with tq_torch (`gluon_store`): same bytes as the Pallas store
        # but for key codes at bucket boundaries, as the contract allows.
        return gluon_store.store(key, value, kv_cache, slot_mapping, midpoints, preset_name=preset_name)
    lay = tq_spec.layout(preset_name, d)
    p = lay.preset
    if word_view is None:
        word_view = needs_word_view(kv_cache.shape)
    mse = p.key_format == "mse"
    rot_mode, rot_scale = rotation_form if (mse and rotation_form is not None) else (ROT_GENERAL, 1.0)
    d_pad = max(16, km.next_pow2(d))
    tiles = store_tiles(d_pad, p.key_format, rot_mode, jnp.dtype(key.dtype).itemsize, interpret)
    cfg = StoreConfig(
        lay=lay, fields=WordFields.of(lay), word_view=word_view, num_kv_heads=hkv, block_size=page,
        num_slots=n * page, n_rows=t * hkv, head_dim_padded=d_pad, in_dtype=jnp.dtype(key.dtype).name,
        rot_mode=rot_mode, rot_scale=float(rot_scale), rot_n=tiles["rot_n"],
        mid_mode=MID_ANY if midpoint_mode is None else midpoint_mode, block_r=tiles["block_r"],
        prefetch=bool(tiles["prefetch"]), ptx=not interpret, fp8_convert=fp8_hardware_convert(interpret))
    if cfg.num_slots >= 2**31 or cfg.n_rows >= 2**31:
        raise NotImplementedError(f"kv_cache: {cfg.num_slots} slots / {cfg.n_rows} rows; the store addresses "
                                  "fewer than 2**31")
    programs = 2 if interpret else tiles["programs_per_sm"] * _sm_count()
    cache_in = to_word_view(kv_cache) if word_view else kv_cache
    operands = [key, value, slot_mapping]
    if mse:
        operands += [rotation, midpoints]
    operands.append(cache_in)
    out = pl.pallas_call(
        functools.partial(_store_kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct(cache_in.shape, cache_in.dtype),
        grid=(min(cfg.n_tiles, programs),),
        input_output_aliases={len(operands) - 1: 0},
        **pallas_kwargs(interpret=interpret, name=f"tq_store_kv_{preset_name}", num_warps=tiles["num_warps"],
                        num_stages=tiles["num_stages"]),
    )(*operands)
    return from_word_view(out) if word_view else out


# --------------------------------------------------------------------------- kernel


def _div(x, c: int):
    """``x // c`` for non-negative int32 `x` and a static ``c >= 1`` (a multiply-shift, no sign fix-up)."""
    return lax.div(x, jnp.asarray(c, x.dtype))


def _store_kernel(*refs, cfg: StoreConfig):
    if cfg.lay.preset.key_format == "mse":
        key_ref, value_ref, sm_ref, rot_ref, mid_ref, _cache_in, cache_ref = refs
    else:
        key_ref, value_ref, sm_ref, _cache_in, cache_ref = refs
        rot_ref = mid_ref = None
    pid = pl.program_id(0)
    step = pl.num_programs(0)
    rot = load_rotation(cfg, rot_ref, 0) if cfg.rot_resident else None
    mids = None if mid_ref is None else [mid_ref[j] for j in range((1 << cfg.lay.preset.key_bits) - 1)]
    fetch = functools.partial(fetch_tile, cfg, key_ref, value_ref, sm_ref)
    n_iter = lax.div(cfg.n_tiles - 1 - pid, step) + 1  # the grid has at most n_tiles programs

    def encode(tile):
        any_row, blk, off, head, k, v = tile
        if any_row is None:  # GPU: rows are masked at the stores
            encode_tile(cfg, cache_ref, rot_ref, rot, mids, blk, off, head, k, v)
            return

        @pl.when(any_row)
        def _():
            encode_tile(cfg, cache_ref, rot_ref, rot, mids, blk, off, head, k, v)

    if cfg.prefetch:
        def body(i, cur):
            # The last round re-reads the last tile (in bounds, never written).
            nxt = fetch(jnp.minimum(pid + (i + 1) * step, cfg.n_tiles - 1))
            encode(cur)
            return nxt

        lax.fori_loop(0, n_iter, body, fetch(pid))
    else:
        def body(i, carry):
            encode(fetch(pid + i * step))
            return carry

        lax.fori_loop(0, n_iter, body, jnp.int32(0))


def fetch_tile(cfg: StoreConfig, key_ref, value_ref, sm_ref, tile):
    """Issues the loads of row tile `tile`: (any row written, block, offset, head ``[BR]``, K, V ``[BR, Dp]``).

    Rows whose slot is outside ``[0, N * P)`` (or past the last row) are not written. On the
    GPU their block is -1 and `_store_words` masks them (any row written: None). In interpret
    mode they take the identity of the tile's first written row: same inputs, same slot, same
    bytes (see the module docstring); a tile with no written row is skipped.
    """
    br = cfg.block_r
    r = tile * br + lax.broadcasted_iota(jnp.int32, (br,), 0)
    in_range = r < cfg.n_rows
    r = jnp.minimum(r, cfg.n_rows - 1)
    if cfg.ptx:
        any_row = None  # no cross-row reduction and no branch per tile
        tok = _div(r, cfg.num_kv_heads)
        slot = sm_ref[tok]
        ok = in_range & (slot >= 0) & (slot < cfg.num_slots)
        slot = jnp.where(ok, slot, 0)
    else:
        slot = sm_ref[_div(r, cfg.num_kv_heads)]
        ok = in_range & (slot >= 0) & (slot < cfg.num_slots)
        first = jnp.min(jnp.where(ok, r, cfg.n_rows))
        any_row = first < cfg.n_rows
        r = jnp.where(ok, r, jnp.minimum(first, cfg.n_rows - 1))
        tok = _div(r, cfg.num_kv_heads)
        slot = jnp.clip(sm_ref[tok], 0, cfg.num_slots - 1)  # in range wherever a row is written
    head = r - tok * cfg.num_kv_heads
    blk = _div(slot, cfg.block_size)
    off = slot - blk * cfg.block_size
    if cfg.ptx:
        blk = jnp.where(ok, blk, -1)
    d, dp = cfg.lay.head_dim, cfg.head_dim_padded
    # Padded lanes read the last element again (in bounds); they are never written.
    lane = lax.broadcasted_iota(jnp.int32, (1, dp), 1)
    if dp != d:
        lane = jnp.minimum(lane, d - 1)
    t2, h2 = tok[:, None], head[:, None]
    k = pltriton.load(key_ref.at[t2, h2, lane])
    v = pltriton.load(value_ref.at[t2, h2, lane])
    return any_row, blk, off, head, k, v


def _store_words(cfg: StoreConfig, cache_ref, blk, off, head, word0: int, index, words, count: int | None = None,
                 first: int | None = None):
    """Writes int32 ``words [BR, W]`` (low 16 bits) at word ``word0 + index [W]`` of each row's slot.

    Words ``index >= count`` are padding and not written, nor (GPU) rows whose block is -1
    (`fetch_tile`). ``first``: given when ``index`` is ``first + iota`` (contiguous). Word
    view: one uint16 store; byte view: the little-endian bytes as one uint8 tile.
    """
    contiguous = first is not None
    b2, o2, h2 = blk[:, None], off[:, None], head[:, None]
    words = words.astype(jnp.int32)

    def masked(lanes, shape):
        # lanes [W'] or None; the GPU masks rows too (interpret mode redirects them instead:
        # its masked store is a read-modify-write of every lane).
        m = None if lanes is None else lanes[None, :]
        if cfg.ptx:
            m = (b2 >= 0) if m is None else (b2 >= 0) & m
        return None if m is None else jnp.broadcast_to(m, shape)

    if cfg.word_view:
        idx = word0 + index[None, :]
        mask = masked(None if count is None else index < count, words.shape)
        pltriton.store(cache_ref.at[b2, o2, h2, idx], (words & 0xFFFF).astype(jnp.uint16), mask=mask)
        return
    lo = words & 0xFF
    hi = lax.shift_right_logical(words, 8) & 0xFF
    byte_vals = jnp.stack([lo, hi], axis=-1).reshape(words.shape[0], 2 * words.shape[1])
    # Contiguous word runs (a 16-bit field or a 4/8-bit stream) index their bytes
    # with a plain iota, so Triton sees the contiguity and vectorises the store.
    n = 2 * index.shape[0]
    byte_idx = (jnp.stack([2 * index, 2 * index + 1], axis=-1).reshape(n) if not contiguous
                else 2 * first + lax.broadcasted_iota(jnp.int32, (n,), 0))
    mask = masked(None if count is None else byte_idx < 2 * count, byte_vals.shape)
    pltriton.store(cache_ref.at[b2, o2, h2, 2 * word0 + byte_idx[None, :]], byte_vals.astype(jnp.uint8),
                   mask=mask)


def _pair_up(x, shift: int):
    """``[BR, 2N]`` -> ``[BR, N]``: ``x[:, 2i] | x[:, 2i + 1] << shift`` (a split: registers only)."""
    br, n2 = x.shape
    a, b = jnp.unstack(x.reshape(br, n2 // 2, 2), axis=-1)
    return a | lax.shift_left(b, jnp.int32(shift))


def store_code_words(cfg: StoreConfig, cache_ref, blk, off, head, word0: int, codes, col0: int, bits: int,
                     n_codes: int):
    """Packs ``codes [BR, NC]`` (int32, columns ``col0 ..``) into the LSB-first ``bits``-bit stream.

    Columns at or past ``n_codes`` are padding and not written (``n_codes *
    bits`` is a multiple of 16). Codes are merged pairwise (constant shifts):
    4 and 8 bits reach 16-bit words, 3 bits reach 24-bit halves of a 16-code
    group (3 words).
    """
    if bits == 3:
        halves = _pair_up(_pair_up(_pair_up(codes, 3), 6), 12)
        a, b = jnp.unstack(halves.reshape(halves.shape[0], halves.shape[1] // 2, 2), axis=-1)
        ng = a.shape[1]
        grp = col0 // 16 + lax.broadcasted_iota(jnp.int32, (ng,), 0)
        count = None if col0 // 16 + ng <= n_codes // 16 else n_codes // 16
        for j, w in enumerate((a & 0xFFFF, lax.shift_right_logical(a, 16) | ((b & 0xFF) << 8),
                               lax.shift_right_logical(b, 8))):
            _store_words(cfg, cache_ref, blk, off, head, word0 + j, grp * 3, w,
                         None if count is None else count * 3)
        return
    words = _pair_up(_pair_up(codes, 4), 8) if bits == 4 else _pair_up(codes, 8)
    nw = words.shape[1]
    first = col0 * bits // 16
    total = n_codes * bits // 16
    index = first + lax.broadcasted_iota(jnp.int32, (nw,), 0)
    _store_words(cfg, cache_ref, blk, off, head, word0, index, words, None if first + nw <= total else total,
                 first=first)


def _store_fp16_field(cfg: StoreConfig, cache_ref, blk, off, head, word: int, x):
    """Stores float32 ``x [BR]`` as little-endian fp16 (RNE; `kernel_math.f32_to_half_bits`) at word ``word``."""
    bits = km.f32_to_half_bits(x, use_ptx=cfg.ptx)[:, None]
    _store_words(cfg, cache_ref, blk, off, head, word, jnp.zeros((1,), jnp.int32), bits, first=0)


def _search(y, mids, first: int, levels: int):
    """``#{j < 2**levels - 1 : y >= mids[first + j]}`` by binary search (ascending midpoints)."""
    m = mids[first:]
    w = jnp.where
    if levels == 4:
        b3 = y >= m[7]
        b2 = y >= w(b3, m[11], m[3])
        b1 = y >= w(b3, w(b2, m[13], m[9]), w(b2, m[5], m[1]))
        b0 = y >= w(b3, w(b2, w(b1, m[14], m[12]), w(b1, m[10], m[8])),
                    w(b2, w(b1, m[6], m[4]), w(b1, m[2], m[0])))
        return (b3.astype(jnp.int32) << 3) | (b2.astype(jnp.int32) << 2) | (b1.astype(jnp.int32) << 1) \
            | b0.astype(jnp.int32)
    if levels == 3:
        b2 = y >= m[3]
        b1 = y >= w(b2, m[5], m[1])
        b0 = y >= w(b2, w(b1, m[6], m[4]), w(b1, m[2], m[0]))
        return (b2.astype(jnp.int32) << 2) | (b1.astype(jnp.int32) << 1) | b0.astype(jnp.int32)
    assert levels == 2, levels
    b1 = y >= m[1]
    b0 = y >= w(b1, m[2], m[0])
    return (b1.astype(jnp.int32) << 1) | b0.astype(jnp.int32)


def bucketize(y, mids, bits: int, mid_mode: int):
    """``code = #{j : y >= mids[j]}`` (int32) over the ``2**bits - 1`` scalar midpoints; NaN gets 0.

    MID_SYMMETRIC: ascending, antisymmetric midpoints (``mids[H-1] == 0``,
    ``H = 2**(bits-1)``; every tq_spec codebook): one search over the upper
    half with ``|y|``; for ``y < 0`` the count is ``H - 1 - #{i : |y| > m_i}``
    and ``|y| > m`` is ``pred(|y|) >= m`` (bit pattern - 1), so the result is
    exactly the count. MID_SORTED: a search over all midpoints. MID_ANY: a
    linear count.
    """
    if mid_mode == MID_SYMMETRIC:
        h = 1 << (bits - 1)
        neg = y < 0.0
        nonneg = y >= 0.0  # -0.0 included; NaN is neither
        mag = (lax.bitcast_convert_type(y, jnp.int32) & 0x7FFFFFFF) - neg.astype(jnp.int32)
        cnt = _search(lax.bitcast_convert_type(mag, jnp.float32), mids, h, bits - 1)
        return jnp.where(nonneg, h + cnt, jnp.where(neg, h - 1 - cnt, 0))
    if mid_mode == MID_SORTED:
        return _search(y, mids, 0, bits)
    code = jnp.zeros(y.shape, jnp.int32)
    for m in mids:
        code = code + (y >= m).astype(jnp.int32)
    return code


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _split3(x):
    """float32 ``x`` as three bf16 parts ``hi + mid + lo == x`` (8 significant bits each; exact)."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def rotate_signs(cfg: StoreConfig, k, signs):
    """``K @ S`` for a +-1 matrix ``signs [D, N]`` (the dot dtype): exact products, fp32 sums.

    16-bit keys are dot operands as they are; a float32 key is the exact sum
    of three bf16 parts, dotted smallest first.
    """
    if cfg.in_dtype in ("bfloat16", "float16"):
        return _dot(k, signs)
    hi, mid, lo = _split3(k.astype(jnp.float32))
    return _dot(lo, signs) + _dot(mid, signs) + _dot(hi, signs)


def rotate_general(k, rot):
    """``K @ Pi^T`` for any float32 ``Pi^T = hi + mid + lo`` (`load_rotation`), to about fp32 accuracy.

    The key is split into three exact bf16 parts as well; the six products
    down to relative size 2**-16 are summed smallest first.
    """
    p_hi, p_mid, p_lo = rot
    k_hi, k_mid, k_lo = _split3(k.astype(jnp.float32))
    acc = _dot(k_mid, p_mid) + _dot(k_lo, p_hi)
    acc = acc + _dot(k_hi, p_lo)
    acc = acc + _dot(k_mid, p_hi)
    acc = acc + _dot(k_hi, p_mid)
    return acc + _dot(k_hi, p_hi)


def load_rotation(cfg: StoreConfig, rot_ref, c0: int):
    """Rotation operands ``[D, rot_n]`` for output columns ``c0 ..``.

    ROT_SIGNS: ``rot_ref[j, i] = sign(Pi[i, j])`` in the dot dtype. ROT_GENERAL:
    float32 ``Pi`` read transposed and split into three bf16 parts.
    """
    d = cfg.lay.head_dim
    j = lax.broadcasted_iota(jnp.int32, (d, 1), 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, cfg.rot_n), 1)
    if cfg.rot_mode == ROT_SIGNS:
        return pltriton.load(rot_ref.at[j, cols])
    return _split3(pltriton.load(rot_ref.at[cols, j]))


def _div_rn(a, b, ptx: bool):
    """Correctly rounded float32 ``a / b`` (operands broadcast).

    GPU: PTX ``div.rn.f32`` (`kernel_math.ieee_div`). Interpret mode: XLA
    division, with the divisor behind an optimization barrier: XLA rewrites
    a division by a constant or a broadcast into a multiplication by the
    reciprocal, which is not IEEE division.
    """
    if ptx:
        return km.ieee_div(a, b, use_ptx=True)
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape) / lax.optimization_barrier(jnp.broadcast_to(b, shape))


def rounded_quotient(cfg: StoreConfig, x, s, inv_s):
    """``floor(x / s + 0.5)`` as int32 for ``x [BR, W]``, ``s > 0`` per row, ``inv_s = RN(1/s)``,
    with the correctly rounded fp32 quotient (tq_torch's `div_by_row`, the ``+ 0.5`` and the
    floor in one); NaN -> 0.

    On the GPU one PTX block: ``x * inv_s`` and two FMA residual corrections (the fast path of
    ``div.rn.f32`` without its per-element reciprocal), ``add.rn`` and ``cvt.rmi.s32.f32`` (one
    F2I.FLOOR, saturating, NaN -> 0; `jnp.floor` and an int32 cast cost a round, two clamps and
    a convert per element). Interpret mode divides (XLA's IEEE division).
    """
    if not cfg.ptx:
        return jnp.floor(_div_rn(x, s[:, None], False) + 0.5).astype(jnp.int32)
    shape = x.shape
    neg_s = jnp.broadcast_to((0.0 - jnp.minimum(s, _F32_MAX))[:, None], shape)
    [code] = pltriton.elementwise_inline_asm(
        "{ .reg .f32 q, e;\n"
        " fma.rn.f32 q, $1, $2, 0f00000000;\n"
        " fma.rn.f32 e, q, $3, $1;\n"
        " fma.rn.f32 q, e, $2, q;\n"
        " fma.rn.f32 e, q, $3, $1;\n"
        " fma.rn.f32 q, e, $2, q;\n"
        " add.rn.f32 q, q, 0f3F000000;\n"
        " cvt.rmi.s32.f32 $0, q; }",
        args=[x, jnp.broadcast_to(inv_s[:, None], shape), neg_s], constraints="=r,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)],
    )
    return code


def _half_bits(x, raw_dtype: str, in_dtype: str):
    """16-bit patterns (int32) of ``x`` in the cache's raw dtype: the input's own bits when they match."""
    if in_dtype == raw_dtype:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)
    return km.f32_to_half_bits(x.astype(jnp.float32), raw_dtype)


def encode_tile(cfg: StoreConfig, cache_ref, rot_ref, rot, mids, blk, off, head, k, v):
    """Encodes the rows ``k``, ``v [BR, Dp]`` of one tile and writes them to their slots."""
    lay, f = cfg.lay, cfg.fields
    p = lay.preset
    d, dp = lay.head_dim, cfg.head_dim_padded
    lane = lax.broadcasted_iota(jnp.int32, (dp,), 0)
    dst = functools.partial(_store_words, cfg, cache_ref, blk, off, head, first=0)

    # ---- key part
    if p.key_format == "raw":
        dst(f.key, lane, _half_bits(k, p.raw_dtype, cfg.in_dtype), None if dp == d else d)
    elif p.key_format == "fp8":
        codes = km.fp8_e4m3fn_encode(k.astype(jnp.float32), hardware=cfg.fp8_convert)
        store_code_words(cfg, cache_ref, blk, off, head, f.key, codes, 0, 8, d)
    else:  # rotated Lloyd-Max codes + fp16 norm (D is a power of two: D == Dp)
        kf = k.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(kf * kf, axis=1))
        # y = Pi @ k / (n + eps) = (K @ Pi^T) * (c / (n + eps)); c = 1 for a general Pi.
        row_scale = _div_rn(cfg.rot_scale, norm + NORM_EPS, cfg.ptx)
        for c0 in range(0, d, cfg.rot_n):
            op = rot if cfg.rot_resident else load_rotation(cfg, rot_ref, c0)
            acc = rotate_signs(cfg, k, op) if cfg.rot_mode == ROT_SIGNS else rotate_general(k, op)
            codes = bucketize(acc * row_scale[:, None], mids, p.key_bits, cfg.mid_mode)
            store_code_words(cfg, cache_ref, blk, off, head, f.key, codes, c0, p.key_bits, d)
        _store_fp16_field(cfg, cache_ref, blk, off, head, f.key_norm, norm)

    # ---- value part
    if p.value_format == "raw":
        dst(f.value, lane, _half_bits(v, p.raw_dtype, cfg.in_dtype), None if dp == d else d)
        return
    levels = (1 << p.value_bits) - 1
    vf = v.astype(jnp.float32)
    lo = jnp.min(vf, axis=1)  # padded lanes repeat element D-1: no effect on min/max
    hi = jnp.max(vf, axis=1)
    # The Triton lowering's float min/max skip NaN (minnumf/maxnumf), where the reference's and
    # interpret mode's propagate it: a row holding a NaN must store NaN scale and zero (and code
    # 0), not the range of its other elements. The row's largest magnitude bit pattern above
    # +Inf's marks a NaN: one AND and one integer max per element.
    mag = lax.bitcast_convert_type(vf, jnp.int32) & 0x7FFFFFFF
    has_nan = jnp.max(mag, axis=1) > 0x7F800000
    lo = jnp.where(has_nan, jnp.nan, lo)
    hi = jnp.where(has_nan, jnp.nan, hi)
    span = _div_rn(hi - lo, float(levels), cfg.ptx)
    scale = jnp.where(has_nan, span, jnp.maximum(span, VALUE_SCALE_MIN))
    inv_scale = _div_rn(1.0, scale, cfg.ptx)
    # floor((v - lo) / scale + 0.5): >= 0 and <= levels for finite rows; NaN rows get code 0.
    codes = jnp.clip(rounded_quotient(cfg, vf - lo[:, None], scale, inv_scale), 0, levels)
    store_code_words(cfg, cache_ref, blk, off, head, f.value, codes, 0, p.value_bits, d)
    _store_fp16_field(cfg, cache_ref, blk, off, head, f.value_scale, scale)
    _store_fp16_field(cfg, cache_ref, blk, off, head, f.value_zero, lo)
