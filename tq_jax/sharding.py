"""tq_jax ops on several devices: the cache and the heads split along kv heads under `shard_map`.

Attention is independent per kv head (query head ``h`` reads kv head
``h // (Hq // Hkv)``), so a mesh axis of ``n`` devices with ``Hkv % n == 0``
gives device ``i`` kv heads ``[i * Hkv/n, (i+1) * Hkv/n)`` and the matching
contiguous block of query heads, and each device runs the ordinary
single-device kernels on its slice with no communication. Tensor-parallel
models already split Q/K/V projections this way.

Layouts (PartitionSpecs over a mesh axis name, or a tuple of names):

* cache ``uint8[N, P, Hkv, slot_bytes]``: `kv_cache_spec` = ``P(None, None, axis, None)``;
  place it with `cache_sharding` (``jax.device_put(cache, cache_sharding(mesh, axis))``)
  so no call reshards it;
* key/value ``[T, Hkv, D]``, query and output ``[T, Hq, D]``: `heads_spec` = ``P(None, axis, None)``;
* sinks ``[Hq]``: ``P(axis)``; metadata, rotation, codebook: replicated.

Other mesh axes (e.g. a data axis) replicate the op. The results are bit for
bit those of the single-device ops: the store is per (token, head); attention
takes its path and its decode split count from the *global* problem (the
automatic split count depends on ``Hkv``, so a shard left to itself would
split the context differently and round differently).

Recipe inside a jitted step (or use these wrappers, which do exactly this)::

    mesh = jax.make_mesh((4,), ("kv",))
    cache = jax.device_put(jnp.zeros((N, P, Hkv, slot), jnp.uint8), sharding.cache_sharding(mesh, "kv"))
    step = jax.jit(lambda k, v, q, cache, meta: ..., donate_argnums=3)   # inside:
        cache = sharding.store_kv(k, v, cache, meta.slot_mapping, mesh=mesh, axis="kv", preset=preset)
        out = sharding.paged_attention(q, cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                       mesh=mesh, axis="kv", preset=preset, sliding_window=W)

With donation each device's cache shard is updated in place (the store's
aliasing holds per shard). `tq_jax.nnx.Attention(..., mesh=mesh, kv_axis="kv")`
and `tq_jax.nnx.init_cache(..., mesh=..., kv_axis=...)` do this inside a
Flax model. `shard_map` here is the version-independent entry point
(``jax.shard_map`` where it exists, else ``jax.experimental.shard_map``).
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

import tq_spec
from tq_spec.dispatch import problem_for, select_path

from ._src import attention as _attention
from ._src import kernel_math as _km
from ._src.inputs import array, index_array, validate_values
from ._src.params import resolve
from ._src.platform import by_lowering_platform, check_interpret
from ._src.store import store_kv as _store_kv

try:  # the split heuristic's home since the kernels' tile table moved there
    from ._src import config as _config
except ImportError:  # pragma: no cover - older kernel internals
    _config = None

__all__ = ["cache_sharding", "heads_spec", "kv_cache_spec", "num_shards", "paged_attention", "shard_map",
           "store_kv"]


# ------------------------------------------------------------------ shard_map across jax versions


@functools.cache
def _shard_map_impl():
    """``(fn, check keyword)``: jax.shard_map (check_vma) or the experimental one (check_rep)."""
    fn = getattr(jax, "shard_map", None)
    if fn is None:  # older jax: only the experimental module
        from jax.experimental.shard_map import shard_map as fn
    params = inspect.signature(fn).parameters
    check = "check_vma" if "check_vma" in params else "check_rep" if "check_rep" in params else None
    return fn, check


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` with replication checking off, on every supported jax (0.10.2 - 0.12).

    ``jax.shard_map`` is used where it exists (keyword ``check_vma``), else
    ``jax.experimental.shard_map.shard_map`` (keyword ``check_rep``). The
    check is off because Pallas calls carry no replication rules; the specs
    below make every output varying along the sharded axis anyway.
    """
    fn, check = _shard_map_impl()
    kw = {check: False} if check else {}
    return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


# ------------------------------------------------------------------ layouts


def kv_cache_spec(axis="kv") -> PartitionSpec:
    """``P(None, None, axis, None)``: a cache ``[N, P, Hkv, slot_bytes]`` split along kv heads."""
    return PartitionSpec(None, None, axis, None)


def heads_spec(axis="kv") -> PartitionSpec:
    """``P(None, axis, None)``: ``[T, H, D]`` (query, key, value, output) split along heads."""
    return PartitionSpec(None, axis, None)


def cache_sharding(mesh, axis="kv", *, ndim: int = 4) -> NamedSharding:
    """`NamedSharding` of a cache split along dim 2 (kv heads); ``ndim`` for other ranks (e.g. 5)."""
    return NamedSharding(mesh, PartitionSpec(None, None, axis, *([None] * (ndim - 3))))


def num_shards(mesh, axis) -> int:
    """Devices along ``axis`` (a mesh axis name or a tuple of names)."""
    names = axis if isinstance(axis, tuple) else (axis,)
    for a in names:
        if a not in mesh.shape:
            raise ValueError(f"axis: expected a mesh axis name from {tuple(mesh.shape)}, got {a!r}")
    return math.prod(mesh.shape[a] for a in names)


def _check_heads(mesh, axis, hkv: int, hq: int | None = None) -> int:
    n = num_shards(mesh, axis)
    if hkv % n:
        raise ValueError(f"kv_cache: expected num_kv_heads divisible by the {n} devices of mesh axis {axis!r}, "
                         f"got {hkv}")
    if hq is not None and hq % hkv:
        raise ValueError(f"query: expected num_q_heads a multiple of num_kv_heads={hkv}, got {hq}")
    return n


# ------------------------------------------------------------------ ops


def store_kv(key, value, kv_cache, slot_mapping, *, mesh, axis="kv", preset, rotation=None, codebook=None,
             interpret=None, validate=None):
    """`tq_jax.store_kv` with key/value and the cache split along kv heads over ``mesh[axis]``.

    Args:
      key, value: ``[T, Hkv, D]`` (global shapes); kv_cache: ``uint8[N, P, Hkv, slot_bytes]``,
        best placed with `cache_sharding` (an array laid out otherwise is resharded first);
      slot_mapping: ``int32[T]`` (replicated); mesh: a `jax.sharding.Mesh`; axis: the
        mesh axis name (or tuple of names) to split kv heads over, ``Hkv % devices == 0``;
      preset, rotation, codebook, interpret, validate: as in `tq_jax.store_kv`.

    Returns:
      The new cache, sharded like `kv_cache_spec`; bytes identical to the single-device
      store. Donate the cache at the enclosing ``jax.jit`` to update each shard in place.
    """
    key, value, kv_cache = (array(n, x) for n, x in (("key", key), ("value", value), ("kv_cache", kv_cache)))
    slot_mapping = index_array("slot_mapping", slot_mapping)
    lay = tq_spec.validation.check_store_kv(key, value, kv_cache, slot_mapping, preset=preset)
    check_interpret(interpret)
    _check_heads(mesh, axis, int(kv_cache.shape[2]))
    if tq_spec.validation.validate_enabled(validate):
        validate_values(tq_spec.validation.check_store_kv_values, dict(slot_mapping=slot_mapping),
                        key=key, value=value, kv_cache=kv_cache, preset=preset)
    rot = resolve(lay.preset, lay.head_dim, rotation, codebook).rotation
    heads, rep = heads_spec(axis), PartitionSpec()

    def local(k, v, c, sm, rot):
        return _store_kv(k, v, c, sm, preset=lay.preset.name, rotation=rot, codebook=codebook,
                         interpret=interpret, validate=False)

    args, specs = [key, value, kv_cache, slot_mapping], [heads, heads, kv_cache_spec(axis), rep]
    if rot is None:
        fn = lambda k, v, c, sm: local(k, v, c, sm, None)  # noqa: E731
    else:
        fn, args, specs = local, args + [rot], specs + [rep]
    return shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=kv_cache_spec(axis))(*args)


def _auto_num_splits(lay, query_shape, cache_shape, block_table_shape, *, interpret: bool,
                     key_entries=None) -> int:
    """The decode split count `tq_jax.paged_attention` picks automatically for these shapes.

    Mirrors the kernels' own choice (``tq_jax._src.attention._attend``) so that
    every shard can be given the count of the *global* problem;
    ``tests/jax/test_jax_sharding.py`` checks the mirror against the count the
    op actually uses, for the Triton and the interpret settings. ``key_entries``:
    what the op passes (`_global_key_entries`); the packed-operand tiles take
    their own settings on the GPU.
    """
    t, hq, d = (int(v) for v in query_shape)
    _, page, hkv, _ = (int(v) for v in cache_shape)
    b, cols = (int(v) for v in block_table_shape)
    if _config is not None:
        tiles = _config.attention_tiles(_config.padded_head_dim(d), interpret, "decode", _config.key_kind(lay.preset))
        tiles = _config.decode_tiles(tiles, hq // hkv, packed=key_entries is not None and not interpret)
        return int(_config.decode_num_splits(
            num_seqs=b, num_kv_heads=hkv, num_tokens=t, num_q_heads=hq, head_dim=d, max_context=cols * page,
            block_n=tiles["block_n"], interpret=interpret, programs_per_sm=tiles["programs_per_sm"]))
    rows = max(16, _km.next_pow2(hq // hkv))  # pragma: no cover - older kernel internals
    spec = _attention.tile_spec(lay, cache_shape, word_view=False, interpret=interpret)
    return int(_attention.default_num_splits(b, hkv, cols * page, spec.block_n,
                                             partial_bytes_per_split=t * hkv * rows * (spec.head_dim_padded + 2) * 4))


def _global_key_entries(lay, query, block_table, path: str, rotation, codebook):
    """The constant key-table entries `tq_jax.paged_attention` passes for the global problem
    (``attention._default_key_entries``: the block table is replicated, so every shard sees
    the global batch)."""
    return _attention._default_key_entries(lay.preset, int(query.shape[2]), query.dtype, path, rotation, codebook,
                                           num_seqs=int(block_table.shape[0]))


def _global_path(lay, query, kv_cache, block_table, *, sliding_window, path) -> str:
    """The path `tq_jax.paged_attention` runs for these (global) arrays: its dispatch problem, mirrored.

    ``tests/jax/test_jax_sharding.py`` checks the mirror against the path the op launches.
    """
    return select_path(problem_for(query, kv_cache, block_table, preset=lay.preset,
                                   sliding_window=sliding_window), path)


def paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, mesh, axis="kv", preset,
                    scale=None, sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None,
                    codebook=None, path="auto", interpret=None, validate=None):
    """`tq_jax.paged_attention` with query, sinks and the cache split along kv heads over ``mesh[axis]``.

    Args:
      query: ``[T, Hq, D]`` (global shape); kv_cache: ``uint8[N, P, Hkv, slot_bytes]``
        (``Hkv`` divisible by the devices of ``axis``); block_table ``int32[B, max_blocks]``,
        seq_lens ``int32[B]``, query_start_loc ``int32[B + 1]``: replicated;
      sinks: None or float32 ``[Hq]`` (split with the query heads);
      mesh, axis: as in `store_kv`; the other arguments as in `tq_jax.paged_attention`.

    Returns:
      ``[T, Hq, D]`` in the query dtype, sharded like `heads_spec`; bit for bit the
      single-device result (the path and the decode split count are chosen from
      the global shapes, then forced on every shard).
    """
    lay, (query, kv_cache, block_table, seq_lens, query_start_loc, sinks) = _attention.checked_arguments(
        query, kv_cache, block_table, seq_lens, query_start_loc, sinks, preset=preset, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, interpret=interpret, validate=validate)
    hq, d = (int(s) for s in query.shape[1:])
    _check_heads(mesh, axis, int(kv_cache.shape[2]), hq)
    # The path and the decode split count of the *global* problem, as the single-device op picks them.
    chosen = _global_path(lay, query, kv_cache, block_table, sliding_window=sliding_window, path=path)
    kp = resolve(lay.preset, d, rotation, codebook)
    shapes = (query.shape, kv_cache.shape, block_table.shape)
    entries = _global_key_entries(lay, query, block_table, chosen, rotation, codebook)
    launch = functools.partial(
        _attention._paged_attention, preset_name=lay.preset.name,
        scale=float(1.0 / math.sqrt(d) if scale is None else scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), path=chosen,
        key_entries=entries)

    def call(*arrays, interpret):
        # Per lowering platform: the split count depends on the Triton vs interpret tile settings.
        splits = (_auto_num_splits(lay, *shapes, interpret=interpret, key_entries=entries)
                  if chosen == "decode" else None)
        return launch(*arrays, num_splits=splits, interpret=interpret)

    heads, rep = heads_spec(axis), PartitionSpec()
    # Optional arrays (sinks, rotation, centroids) travel only when present.
    optional = [(sinks, PartitionSpec(axis)), (kp.rotation, rep), (kp.centroids, rep)]
    present = [i for i, (a, _) in enumerate(optional) if a is not None]

    def local(q, c, bt, sl, qsl, *opt):
        full = [None, None, None]
        for i, a in zip(present, opt):
            full[i] = a
        return by_lowering_platform(call, q, c, bt, sl, qsl, *full, interpret=interpret)

    args = [query, kv_cache, block_table, seq_lens, query_start_loc] + [optional[i][0] for i in present]
    specs = [heads, kv_cache_spec(axis), rep, rep, rep] + [optional[i][1] for i in present]
    return shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=heads)(*args)
