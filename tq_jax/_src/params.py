"""Kernel inputs derived from a preset: rotation matrix and padded codebook tables.

The rotation and codebook are data (DESIGN.md section 2), generated once in
`tq_spec`; this module turns them into the device arrays the kernels index:

* ``rotation``: float32 ``[D, D]`` with ``y = rotation @ u`` (mse presets only).
* ``centroids``: float32 ``[16]`` (the ``2**bits`` centroids, zero padded).
* ``midpoints``: float32 ``[16]`` (the ``2**bits - 1`` midpoints, padded with
  +inf so a padded lane never counts as "at or above").

The tables are padded to 16 entries because kernel tiles must have a power of
two element count; 16 covers every key width up to 4 bits.

Only numpy arrays are cached (`_default_tables`); they become jax arrays per
call. Caching ``jnp.asarray(...)`` instead would cache a tracer whenever the
first call happens under a trace (`jit`, `eval_shape`, `export`, `nnx.scan`)
and leak it into every later call (`UnexpectedTracerError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

import tq_spec

TABLE_SIZE = 16


@dataclass(frozen=True)
class KernelParams:
    """Device arrays for one (preset, head_dim); all None for non-mse presets."""

    rotation: jax.Array | None
    centroids: jax.Array | None
    midpoints: jax.Array | None


def _pad(values: np.ndarray, fill: float) -> np.ndarray:
    out = np.full(TABLE_SIZE, fill, np.float32)
    out[: values.shape[0]] = values.astype(np.float32)
    return out


@lru_cache(maxsize=64)
def _default_tables(preset_name: str, head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy ``(centroids [16], midpoints [16], rotation [D, D])`` float32 (read-only)."""
    qp = tq_spec.quant_params(preset_name, head_dim)
    tables = _tables_of(qp.codebook) + (np.asarray(qp.rotation, np.float32),)
    for t in tables:
        t.setflags(write=False)  # shared by every caller: nobody may mutate the cache
    return tables


def _tables_of(cb: tq_spec.Codebook) -> tuple[np.ndarray, np.ndarray]:
    """numpy float32 ``(centroids, midpoints)`` padded to `TABLE_SIZE`."""
    if cb.centroids.shape[0] > TABLE_SIZE:
        raise NotImplementedError(
            f"codebook: tq_jax kernels support up to {TABLE_SIZE} levels, got {cb.centroids.shape[0]}"
        )
    return _pad(cb.centroids, 0.0), _pad(cb.midpoints, np.inf)


def resolve(preset, head_dim: int, rotation=None, codebook=None) -> KernelParams:
    """Validates and converts the optional ``rotation=``/``codebook=`` kernel kwargs.

    `rotation` may be None (tq_spec's default Hadamard), an array-like
    ``[D, D]``, or a jax array (also a tracer under `jax.jit`, which is passed
    through after a shape/dtype check). `codebook` is None or a `tq_spec.Codebook`.

    Raises:
      ValueError/TypeError naming the argument (via `tq_spec.quant_params`).
    """
    p = tq_spec.get_preset(preset)
    if p.key_format != "mse":
        tq_spec.quant_params(p, head_dim, rotation=rotation, codebook=codebook)  # raises on misuse
        return KernelParams(None, None, None)
    if isinstance(rotation, jax.Array):
        if tuple(rotation.shape) != (head_dim, head_dim):
            raise ValueError(
                f"rotation: expected shape ({head_dim}, {head_dim}), got {tuple(rotation.shape)}"
            )
        if not jnp.issubdtype(rotation.dtype, jnp.floating):
            raise TypeError(f"rotation: expected a float array, got dtype {rotation.dtype}")
        qp = tq_spec.quant_params(p, head_dim, codebook=codebook)
        rot = rotation.astype(jnp.float32)
    elif rotation is None and codebook is None:
        cents, mids, rot = _default_tables(p.name, head_dim)
        # Fresh jax arrays per call (constants of the current trace, if any).
        return KernelParams(jnp.asarray(rot), jnp.asarray(cents), jnp.asarray(mids))
    else:
        qp = tq_spec.quant_params(p, head_dim, rotation=rotation, codebook=codebook)
        rot = jnp.asarray(qp.rotation, jnp.float32)
    cents, mids = _tables_of(qp.codebook)
    return KernelParams(rot, jnp.asarray(cents), jnp.asarray(mids))
