"""The query rotation (`tq_torch._src.rotation.rotate_query`) against float64 numpy (CPU interpreter or GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tq_spec
from tq_torch._src.rotation import query_rotation, rotate_query

from tq_torch_testlib import device

_PRESET = "turboquant_4bit_nc"


def _reference(query: torch.Tensor, rotation: np.ndarray) -> np.ndarray:
    """float64 ``q @ Pi^T`` of the query's exact values."""
    return query.detach().cpu().to(torch.float64).numpy() @ rotation.astype(np.float64).T


def _rotate(query: torch.Tensor, rotation=None) -> torch.Tensor:
    return rotate_query(query, query_rotation(_PRESET, query.shape[-1], rotation, query.dtype, query.device))


def _query(t, hq, d, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over several binades, both signs: the sums must not lean on cancellation luck.
    q = torch.randn(t, hq, d, generator=g) * torch.exp2(torch.randint(-3, 4, (t, hq, d), generator=g).float())
    return q.to(dtype).to(dev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_default_rotation_is_the_rounded_exact_product(dtype, d):
    # tq_spec's Hadamard rotation is c * (+-1): the kernel's products are exact and its fp32 sums
    # exact for these magnitudes, so the result is float64 Pi @ q rounded to fp32, then to the
    # query's dtype (the two roundings the attention kernels applied to the old float64 query).
    dev = device()
    q = _query(5, 3, d, dtype, dev, seed=d)
    got = _rotate(q)
    assert got.dtype == dtype and got.shape == q.shape
    want = torch.from_numpy(_reference(q, tq_spec.rotation(d)).astype(np.float32)).to(dtype)
    assert torch.equal(got.cpu(), want)


def test_fp32_query_and_general_rotation_reach_fp32_accuracy():
    # A rotation that is not +-c takes the six-dot path; fp32 queries are split in three bf16
    # parts. Both must stay within a few fp32 roundings of the float64 product.
    dev = device()
    d = 64
    rng = np.random.default_rng(7)
    rot = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    q = _query(4, 2, d, torch.float32, dev, seed=11)
    for rotation in (None, torch.from_numpy(rot).to(dev)):
        got = _rotate(q, rotation).cpu().to(torch.float64).numpy()
        pi = tq_spec.rotation(d) if rotation is None else rot
        want = _reference(q, pi)
        bound = 8 * 2.0**-24 * (np.abs(q.cpu().to(torch.float64).numpy()) @ np.abs(pi.astype(np.float64)).T)
        assert np.all(np.abs(got - want) <= bound)


def test_strided_query_view_and_empty_query():
    # vLLM hands the query over as a view of a fused qkv tensor (row strides > Hq * D).
    dev = device()
    d, hq = 64, 4
    fused = _query(3, hq + 2, d, torch.bfloat16, dev, seed=3)
    view = fused[:, :hq]
    got = _rotate(view)
    assert torch.equal(got, _rotate(view.contiguous()))
    assert _rotate(view[:0]).shape == (0, hq, d)
