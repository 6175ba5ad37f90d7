"""tq_torch's launcher of the Gluon store (`tq_gluon.store`): the store's kernel on sm_90 where `ineligible`
allows it; other calls keep `store._store_kv_kernel`.

The kernel and its launch facts are framework-free and shared with tq_jax (`tq_gluon.store`); this module adds
torch's facts (device, dtypes), the sign operand on the device, the kernel site and the launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from tq_gluon import store as _shared
from tq_gluon.store import (HEAD_DIM, NW, PRESETS, ROWS_PER_TILE, _lane_dims, _rotated_dims,  # noqa: F401 (tests)
                            _sign_operand, gluon_store_kernel, ineligible_shape, kernel_constexprs)

from . import config, params
from .launcher import KernelSite, kernel_site


def ineligible(preset_name: str, *, key_dtype: torch.dtype, value_dtype: torch.dtype, head_dim: int,
               device: torch.device, default_tables: bool) -> Optional[str]:
    """None where `store_kv` may run this kernel, else why not (static facts of the call)."""
    why = ineligible_shape(preset_name, head_dim=head_dim)
    if why is not None:
        return why
    if device.type != "cuda" or config.interpreted(device):
        return "needs a CUDA device (no interpreter)"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "built and measured for sm_90 (H100/H200) only"
    if key_dtype != torch.bfloat16 or value_dtype != torch.bfloat16:
        return "needs bfloat16 keys and values"
    if not default_tables:
        return "needs the preset's default rotation and codebook"
    return None


class StorePlan(NamedTuple):
    site: KernelSite
    rotation: torch.Tensor  # `_sign_operand`, bf16 [128, 128]
    rotation_scale: float
    midpoints: torch.Tensor
    max_programs: int


@functools.lru_cache(maxsize=64)
def store_plan(preset_name: str, num_kv_heads: int, page_size: int, device: torch.device) -> StorePlan:
    """The launch plan of a cache's preset, kv heads and page size (the preset's default rotation and codebook)."""
    from .store import _default_forms

    signs_t, c, mid_mode = _default_forms(preset_name, HEAD_DIM)
    assert mid_mode == 0, "tq_spec's codebooks are symmetric"
    constexprs = kernel_constexprs(preset_name, num_kv_heads=num_kv_heads, page_size=page_size)
    rot = params._cached(("gluon_store_signs", preset_name, HEAD_DIM, str(device)),
                         lambda: torch.from_numpy(_sign_operand(signs_t, constexprs["KEY_BITS"])).to(
                             device=device, dtype=torch.bfloat16))
    site = kernel_site(gluon_store_kernel, constexprs)
    return StorePlan(site, rot, c, params.default_midpoints(preset_name, HEAD_DIM, device),
                     _shared.PROGRAMS_PER_SM * config.sm_count(device))


def launch(plan: StorePlan, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    """Runs the kernel (``key``/``value`` with unit stride along D; checked by the caller)."""
    t, hkv, _ = key.shape
    n, p = kv_cache.shape[:2]
    strides = kv_cache.stride()
    n_rows = t * hkv
    n_tiles = -(-n_rows // ROWS_PER_TILE)
    plan.site((min(n_tiles, plan.max_programs),),
              (key, value, kv_cache.view(torch.int16), slot_mapping, plan.rotation, plan.midpoints),
              (key.stride(0), key.stride(1), value.stride(0), value.stride(1), strides[0] // 2, strides[1] // 2,
               strides[2] // 2, n_rows, n * p, n_tiles, plan.rotation_scale))
