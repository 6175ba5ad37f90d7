"""Test-session set-up shared by every suite.

* On a machine without CUDA the Triton kernels run in the Triton interpreter
  (`TRITON_INTERPRET=1`, CPU tensors) and the Pallas kernels in interpret mode;
  the variable must be set before triton is first imported, hence here.
* Tests marked `gpu` run the same bodies at realistic sizes; they are skipped
  with the reason "needs a GPU" when no CUDA device is visible.
"""

from __future__ import annotations

import os

import numpy as np
import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


# JAX and torch share the GPU in one test session: without this JAX would
# preallocate most of the device memory at its first use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

HAS_GPU = _cuda_available()

if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU (CUDA device not visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fp8_encode_inputs():
    """float32 inputs of the fp8 e4m3fn encode tests (both frameworks): every float16 value
    (infinities and both NaN signs included), 65536 random values of wide range, float32
    subnormals and the rounding and saturation edges."""
    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(1 << 16) * np.exp2(rng.integers(-20, 12, 1 << 16))).astype(np.float32)
    special = np.array([1.9747, -1.9747, 448.0, 449.0, 464.0, 465.0, 480.0, 1000.0, -1e30, 2.0**-9, 2.0**-10,
                        1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-6 - 2.0**-12, 0.0, -0.0, 1e-40, -3e-45,
                        np.inf, -np.inf, np.nan, -np.nan], np.float32)
    return np.concatenate([every_half, wide, special])
