"""The PyTorch/Triton leg (`tq_torch`): CUDA tensors on a GPU, CPU tensors under the interpreter."""

from __future__ import annotations

import numpy as np

from ..runner.environment import cuda_available, triton_interpreter_ready
from .base import OPS, KernelModuleLeg, Unavailable, missing_ops

_LOCAL_DTYPES = ("bfloat16",)  # numpy holds these via ml_dtypes; torch.from_numpy cannot


class TorchLeg(KernelModuleLeg):
    """Drives `tq_torch.store_kv` / `tq_torch.paged_attention`."""

    name = "torch"

    def __init__(self, module, ops):
        import torch

        self._torch = torch
        super().__init__(module, ops)
        self.device = torch.device("cuda" if cuda_available() else "cpu")
        self.interpreted = self.device.type == "cpu"

    def describe(self) -> str:
        import triton

        mode = "Triton interpreter (TRITON_INTERPRET=1)" if self.interpreted else "CUDA"
        return f"torch: tq_torch on torch {self._torch.__version__}, triton {triton.__version__}, {self.device} ({mode})"

    def put(self, array):
        torch = self._torch
        a = np.ascontiguousarray(array)
        if str(a.dtype) == "bfloat16":
            t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a.copy())
        return t.to(self.device)

    def get(self, x):
        torch = self._torch
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"torch leg: expected a torch.Tensor result, got {type(x).__name__}")
        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
        return t.numpy().copy()

    def store_kv(self, key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None):
        out = self._mod.store_kv(key, value, kv_cache, slot_mapping, preset=preset,
                                 rotation=rotation, codebook=codebook)
        # The contract: torch updates the cache in place (and may return it).
        return kv_cache if out is None else out

    def paged_attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
                        scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                        rotation=None, codebook=None, path="auto"):
        # out= filled with NaN (DESIGN.md section 6): an element the kernel leaves unwritten (a padding
        # row, a row of an empty request) shows as NaN instead of whatever torch.empty held.
        out = self._torch.full_like(query, float("nan"), memory_format=self._torch.contiguous_format)
        return self._mod.paged_attention(
            query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
            rotation=rotation, codebook=codebook, path=path, out=out,
        )

    supports_splits = True

    def paged_attention_splits(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, num_splits: int,
                               preset, scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                               rotation=None, codebook=None):
        # tq_torch's public op picks the split count from shapes; its private entry takes a count
        # (the hook tq_torch's own tests use). Validation follows TQ_VALIDATE, as the public op's.
        from tq_torch._src.api import _paged_attention

        out = self._torch.full_like(query, float("nan"), memory_format=self._torch.contiguous_format)
        return _paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                                rotation=rotation, codebook=codebook, path="decode", out=out,
                                num_splits=int(num_splits))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.synchronize()


def load():
    """A `TorchLeg`, or `Unavailable` with the reason."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # pragma: no cover - torch is a dependency
        return Unavailable("torch", f"torch not importable: {e}")
    reason = triton_interpreter_ready()
    if reason is not None:
        return Unavailable("torch", reason)
    try:
        import triton  # noqa: F401
    except Exception as e:
        return Unavailable("torch", f"triton not importable: {type(e).__name__}: {e}")
    try:
        import tq_torch
    except Exception as e:
        return Unavailable("torch", f"tq_torch not importable: {type(e).__name__}: {e}")
    missing = missing_ops(tq_torch)
    if len(missing) == len(OPS):
        return Unavailable("torch", "tq_torch provides none of " + ", ".join(OPS) + " (not built yet)")
    return TorchLeg(tq_torch, [op for op in OPS if op not in missing])
