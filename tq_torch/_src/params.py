"""Rotation and codebook tensors on the kernels' device, cached.

The kernels take the rotation ``Pi`` (float32 ``[D, D]``), the key centroids
(float32 ``[2**bits]``) and midpoints (float32 ``[2**bits - 1]``) as data,
generated once in `tq_spec`. Defaults are cached per (preset, head_dim,
device); user-given numpy arrays are cached by content; user-given torch
tensors are used as they are (moved/cast only if needed).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import NamedTuple, Optional

import numpy as np
import torch

import tq_spec

_CACHE_SIZE = 64
_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


class KeyParams(NamedTuple):
    """Optional kernel inputs resolved for one call; None means "the default"."""

    rotation: Optional[torch.Tensor]
    centroids: Optional[torch.Tensor]
    midpoints: Optional[torch.Tensor]


def _cached(key: tuple, make) -> torch.Tensor:
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    value = make()
    _cache[key] = value
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return value


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True)).to(device)


def _digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a, dtype=np.float32).tobytes(), digest_size=16).hexdigest()


# The default tables are looked up per call (host time matters at B=1 decode):
# `tq_spec.quant_params` runs only on a cache miss.
def default_rotation(preset_name: str, head_dim: int, device: torch.device) -> torch.Tensor:
    return _cached(("rotation", preset_name, head_dim, str(device)),
                   lambda: _to_device(tq_spec.quant_params(preset_name, head_dim).rotation, device))


def identity_rows(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``[D, D]`` identity in ``dtype``: the signs a kernel that rotates its query takes for a query rotated
    already (exact: one product by 1 per output)."""
    return _cached(("identity", head_dim, str(dtype), str(device)),
                   lambda: torch.eye(head_dim, dtype=dtype, device=device))


def default_centroids(preset_name: str, head_dim: int, device: torch.device) -> torch.Tensor:
    return _cached(("centroids", preset_name, head_dim, str(device)),
                   lambda: _to_device(tq_spec.quant_params(preset_name, head_dim).codebook.centroids, device))


def default_midpoints(preset_name: str, head_dim: int, device: torch.device) -> torch.Tensor:
    return _cached(("midpoints", preset_name, head_dim, str(device)),
                   lambda: _to_device(tq_spec.quant_params(preset_name, head_dim).codebook.midpoints, device))


def resolve_user_params(preset: tq_spec.Preset, head_dim: int, device: torch.device,
                        rotation, codebook) -> KeyParams:
    """Validates user-given ``rotation`` / ``codebook`` and turns them into device tensors.

    ``rotation``: None, a torch tensor or an array-like ``[D, D]`` (float).
    ``codebook``: None or a `tq_spec.Codebook` for the preset's key bits and D.
    Raises ValueError/TypeError naming the argument (via `tq_spec.quant_params`).
    """
    if rotation is None and codebook is None:
        return KeyParams(None, None, None)
    rot_t = None
    if isinstance(rotation, torch.Tensor):
        if preset.key_format != "mse":
            raise ValueError(f"rotation: preset {preset.name!r} does not rotate keys; pass rotation=None")
        if tuple(rotation.shape) != (head_dim, head_dim):
            raise ValueError(
                f"rotation: expected shape ({head_dim}, {head_dim}), got {tuple(rotation.shape)}")
        if not rotation.is_floating_point():
            raise TypeError(f"rotation: expected a float tensor, got dtype {rotation.dtype}")
        rot_t = rotation.to(device=device, dtype=torch.float32).contiguous()
        rotation = None
    qp = tq_spec.quant_params(preset, head_dim, rotation=rotation, codebook=codebook)
    if rotation is not None:
        rot = qp.rotation
        rot_t = _cached(("user_rotation", head_dim, str(device), _digest(rot)), lambda: _to_device(rot, device))
    cent_t = mid_t = None
    if codebook is not None:
        cb = qp.codebook
        tag = (_digest(cb.centroids), _digest(cb.midpoints))
        cent_t = _cached(("user_centroids", str(device)) + tag, lambda: _to_device(cb.centroids, device))
        mid_t = _cached(("user_midpoints", str(device)) + tag, lambda: _to_device(cb.midpoints, device))
    return KeyParams(rot_t, cent_t, mid_t)
