"""Test-session set-up shared by every suite.

* On a machine without CUDA the Triton kernels run in the Triton interpreter
  (`TRITON_INTERPRET=1`, CPU tensors) and the Pallas kernels in interpret mode;
  the variable must be set before triton is first imported, hence here.
* Tests marked `gpu` run the same bodies at realistic sizes; they are skipped
  with the reason "needs a GPU" when no CUDA device is visible.
"""

from __future__ import annotations

import os

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
