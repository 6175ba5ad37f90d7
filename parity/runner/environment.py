"""Process set-up that must happen before torch/triton/jax kernels are imported.

* No CUDA: Triton kernels run in the interpreter, which Triton decides when a
  kernel is *decorated* (module import), so ``TRITON_INTERPRET=1`` has to be
  in the environment before `tq_torch` is imported.
* JAX next to torch on one GPU: ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so
  XLA does not grab most of the memory up front (DESIGN.md section 7).
* Full metadata validation (``TQ_VALIDATE``, the ops' ``validate=`` default):
  on for the parity suite, which checks correctness; off for the benchmarks,
  whose timings must not include its host sync. An explicit setting in the
  environment wins for the suite; the benchmarks always turn it off.
"""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache


@lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when torch sees a CUDA device (importing torch does not import triton)."""
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver counts as no GPU
        return False


def configure(has_gpu: bool | None = None, *, validate: bool = True) -> bool:
    """Sets the environment for this process; returns whether a GPU is used."""
    gpu = cuda_available() if has_gpu is None else has_gpu
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if validate:
        os.environ.setdefault("TQ_VALIDATE", "1")
    else:
        os.environ["TQ_VALIDATE"] = "0"
    return gpu


def triton_interpreter_ready() -> str | None:
    """None when Triton kernels can run here, else the reason they cannot."""
    if cuda_available():
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device and TRITON_INTERPRET is not 1 (set it before importing triton)"
    return None


def versions() -> dict[str, str]:
    """Versions of the interpreter and every framework already imported."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in ("numpy", "torch", "triton", "jax", "jaxlib", "ml_dtypes"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = str(getattr(mod, "__version__", "?"))
    if "torch" in sys.modules and cuda_available():
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
    return out
