"""The query rotation of the mse presets: ``q_rot = q @ Pi^T`` once per call, on tensor cores.

Scores are taken in the rotated space (DESIGN.md section 2), so every
attention path gets ``Pi @ q`` per query row. The kernel reuses the store's
rotation (`store.rotate_signs`, `store.rotate_general`): for tq_spec's
rotations (``Pi = c * S``, ``S = +-1``) the products of a 16-bit query with
``S`` are exact and the 128 of a row add up in fp32, exactly unless their
magnitudes span more than 2**16, so after the one multiply by ``c`` the
result is the correctly rounded fp32 ``Pi @ q`` (what an fp64 GEMM rounded to
fp32 gives). fp32 queries are split into three exact bf16 parts; any other
rotation is split into bf16 parts as well (six dots, about fp32 accuracy,
the precision tq_jax's fp32 ``HIGHEST`` einsum has).

The result is written in the query's dtype, the dtype of the attention dots,
so the rounding is the one the attention kernels would apply to an fp32
query. (Before: a float64 cast and GEMM, about 0.37 ms for an 8k-token
prefill on an H100, against a few microseconds here.)
tq_jax needs no kernel for this: XLA runs its einsum.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import config, params
from .kernel_math import to_dtype_rne
from .launcher import KernelSite, Launch, kernel_site
from .store import ROT_SIGNS, load_rotation, rotate_general, rotate_signs, rotation_operand

_BLOCK_R = 64
_INTERPRET_BLOCK_R = 16


@triton.jit
def _rotate_query_kernel(q_ptr, out_ptr, rot_ptr, n_rows, num_q_heads, stride_qt, stride_qh, rot_scale,
                         D: tl.constexpr, ROT_N: tl.constexpr, BLOCK_R: tl.constexpr, ROT_MODE: tl.constexpr,
                         IN_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows ``r = t * Hq + h`` of ``q [T, Hq, D]`` (any row strides) rotated into ``out [T * Hq, D]``.

    ``ROT_N`` output columns per rotation operand (``D`` or less for wide heads).
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n_rows
    t = (r // num_q_heads).to(tl.int64)
    h = (r % num_q_heads).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :], mask=ok[:, None], other=0.0)
    qf = q.to(tl.float32)
    for c0 in tl.static_range(0, D, ROT_N):
        rot_0, rot_1, rot_2 = load_rotation(rot_ptr, c0, ROT_MODE, D, ROT_N, IN_DTYPE, INTERPRET)
        if ROT_MODE == 0:  # ROT_SIGNS
            y = rotate_signs(q, qf, rot_0, IN_DTYPE, INTERPRET) * rot_scale
        else:
            y = rotate_general(qf, rot_0, rot_1, rot_2, INTERPRET)
        cols = c0 + tl.arange(0, ROT_N)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * D + cols[None, :], to_dtype_rne(y, IN_DTYPE, INTERPRET),
                 mask=ok[:, None])


class QueryRotation(NamedTuple):
    """The launch facts of one query rotation (`query_rotation`); the default one is cached per plan."""

    site: KernelSite  # `_rotate_query_kernel` with its constexprs
    operand: torch.Tensor  # S^T (+-1, 16-bit) or Pi's parts (`store.rotation_operand`)
    scale: float  # c of Pi = c * S (1.0 on the general path)
    block_r: int  # query rows per program
    # Pi = scale * S with S = +-1 (the sign path): S row-major in the operand's dtype, for kernels that rotate the
    # query themselves (`gluon_decode`); None for a general rotation.
    sign_rows: Optional[torch.Tensor]


def query_rotation(preset_name: str, head_dim: int, rotation: torch.Tensor | None, query_dtype: torch.dtype,
                   device: torch.device) -> QueryRotation:
    """The `QueryRotation` of ``rotation`` (float32 ``[D, D]`` on ``device``; None: the preset's default,
    recognised without a device sync, so the default takes the exact sign path)."""
    d = head_dim
    rot = rotation if rotation is not None else params.default_rotation(preset_name, d, device)
    rot_op, rot_scale, rot_mode = rotation_operand(preset_name, d, rot, query_dtype)
    # Three bf16 parts of a [D, ROT_N] slice of a general Pi stay within 96 KiB of shared memory.
    rot_n = min(d, 128) if rot_mode == ROT_SIGNS else min(d, 16384 // d)
    interpret = config.interpreted(device)
    block_r = _INTERPRET_BLOCK_R if interpret else _BLOCK_R
    site = kernel_site(_rotate_query_kernel, dict(
        D=d, ROT_N=rot_n, BLOCK_R=block_r, ROT_MODE=rot_mode, IN_DTYPE=config.TORCH_TO_TL[query_dtype],
        INTERPRET=interpret, num_warps=4))
    sign_rows = rot_op.t().contiguous() if rot_mode == ROT_SIGNS else None
    return QueryRotation(site, rot_op, rot_scale, block_r, sign_rows)


def rotate_query(query: torch.Tensor, rotation: QueryRotation) -> torch.Tensor:
    """``query [T, Hq, D]`` (float16/bfloat16/float32, any strides) rotated: ``[T, Hq, D]``, same dtype.

    ``rotation``: `query_rotation` of the query's dtype and device.
    """
    out, launch = rotation_launch(query, rotation)
    if launch is not None:
        launch()
    return out


def rotation_launch(query: torch.Tensor, rotation: QueryRotation) -> tuple:
    """`rotate_query` not yet issued: ``(out, launch)``, the rotated query's buffer ``[T, Hq, D]`` and the
    `launcher.Launch` that fills it (None for ``T = 0``), for a caller that issues it next to its own launches."""
    t, hq, _ = query.shape
    strides = query.stride()
    if strides[-1] != 1:
        query = query.contiguous()
        strides = query.stride()
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if t == 0:
        return out, None
    n_rows = t * hq
    # Plain int division: `triton.cdiv` is a constexpr function in Triton 3.9, microseconds of host time.
    return out, Launch(rotation.site, (-(-n_rows // rotation.block_r),), (query, out, rotation.operand),
                       (n_rows, hq, strides[0], strides[1], rotation.scale))
