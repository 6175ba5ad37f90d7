"""tq_jax's launcher of the Gluon store (`tq_gluon.store`): the store's kernel on sm_90 where `ineligible`
allows it, as tq_torch's store runs it; other calls keep the Pallas store (`store`).

The kernel and its launch facts are shared with tq_torch (`tq_gluon.store`), launched here by jaxlib's
Triton kernel call inside the XLA program (`launcher`), the cache aliased from operand to result as the
Pallas store aliases it (in place under donation). Why (steps.md, forty-fourth session): on an H200 the
Pallas 4bit_nc store of T = 32k tokens wrote 837 GB/s of bf16 input, tq_torch's with this kernel 1030.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import tq_spec
from tq_gluon import store as shared

from .launcher import kernel_call, unavailable


def ineligible(preset_name: str, *, key_dtype, value_dtype, head_dim: int, num_slots: int, default_tables: bool,
               interpret: bool) -> Optional[str]:
    """None where `store_kv` may run this kernel, else why not (static facts of the call)."""
    if interpret:
        return "needs a CUDA device (no interpreter)"
    why = shared.ineligible_shape(preset_name, head_dim=head_dim)
    if why is not None:
        return why
    if jnp.dtype(key_dtype) != jnp.bfloat16 or jnp.dtype(value_dtype) != jnp.bfloat16:
        return "needs bfloat16 keys and values"
    if not default_tables:
        return "needs the preset's default rotation and codebook"
    if num_slots >= 2**31:
        return "addresses fewer than 2**31 slots"
    return unavailable()


@functools.lru_cache(maxsize=8)
def _sign_operand(preset_name: str) -> tuple:
    """(`tq_gluon.store._sign_operand` of the preset's default rotation ``c * S`` as float32 numpy, ``c``)."""
    from .store import host_sign_form

    signs_t, c = host_sign_form(preset_name, shared.HEAD_DIM, None)
    op = shared._sign_operand(np.asarray(signs_t), tq_spec.get_preset(preset_name).key_bits).astype(np.float32)
    op.setflags(write=False)
    return op, float(c)


def store(key, value, kv_cache, slot_mapping, midpoints, *, preset_name: str):
    """Quantises ``key, value [T, Hkv, 128]`` (bfloat16) into their slots -> the updated cache (aliased).

    ``slot_mapping``: int32 ``[T]`` (slots outside ``[0, N * P)`` are skipped); ``midpoints``: the preset's
    default fp32 key midpoints; static shapes `ineligible` accepts.
    """
    from .config import sm_count

    t, hkv, d = key.shape
    n, page, _, slot_bytes = kv_cache.shape
    n_rows = t * hkv
    n_tiles = -(-n_rows // shared.ROWS_PER_TILE)
    signs, c = _sign_operand(preset_name)
    constexprs = shared.kernel_constexprs(preset_name, num_kv_heads=hkv, page_size=page)
    scalars = (hkv * d, d, hkv * d, d, page * hkv * slot_bytes // 2, hkv * slot_bytes // 2, slot_bytes // 2,
               n_rows, n * page, n_tiles, c)
    operands = (key, value, kv_cache, slot_mapping.astype(jnp.int32), jnp.asarray(signs, jnp.bfloat16),
                midpoints.astype(jnp.float32))
    (out,) = kernel_call(shared.gluon_store_kernel, grid=(min(n_tiles, shared.PROGRAMS_PER_SM * sm_count()), 1, 1),
                         signature=shared.kernel_signature("*i32"), constexprs=constexprs, operands=operands,
                         results=(jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),), scalars=scalars,
                         input_output_aliases={2: 0})
    return out
