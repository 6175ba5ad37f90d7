"""What a leg is: one implementation of the two ops, driven with numpy data.

A leg converts numpy inputs to its own arrays (`put`), runs the contract ops
(`store_kv`, `paged_attention`) and converts results back (`get`). Keeping
arrays on the device between calls is the leg's business; the checks only
hold what `put` and the ops return.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import numpy as np

import tq_spec

OPS = ("store_kv", "paged_attention")


class Leg(ABC):
    """One implementation of `store_kv` and `paged_attention`.

    Attributes:
      name: the leg name used by ``--legs`` and in reports.
      oracle: True for the float64 reference (its store/attention records
        would compare it with itself, so only end-to-end and chunking run).
      interpreted: kernels run in an interpreter (CPU); fp8 casts may be off
        by one ulp there (DESIGN.md section 7).
    """

    name: str = "leg"
    oracle: bool = False
    interpreted: bool = False

    @property
    def ops(self) -> tuple[str, ...]:
        """The contract ops this leg provides (a subset of `OPS`)."""
        return OPS

    def paths(self, problem: tq_spec.dispatch.DispatchProblem) -> tuple[str, ...]:
        """Paths to force on a problem: ``auto`` plus every eligible table path."""
        return ("auto",) + tq_spec.dispatch.eligible_paths(problem)

    def compute_dtype(self, query_dtype: str) -> Optional[str]:
        """Dtype of the leg's dot operands for `check_attention` (None: the query dtype)."""
        return None

    def describe(self) -> str:
        """One line: what runs where (versions, device)."""
        return self.name

    @abstractmethod
    def put(self, array: np.ndarray) -> Any:
        """A fresh leg-side copy of `array` (kernels may write into it)."""

    @abstractmethod
    def get(self, x: Any) -> np.ndarray:
        """A numpy copy of a leg-side array (same dtype; bfloat16 via ml_dtypes)."""

    @abstractmethod
    def store_kv(self, key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None) -> Any:
        """The contract op; returns the updated cache (leg-side)."""

    @abstractmethod
    def paged_attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
                        scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                        rotation=None, codebook=None, path="auto") -> Any:
        """The contract op; returns ``[T, Hq, D]`` (leg-side)."""

    # Whether `paged_attention_splits` can force the decode path's split count.
    supports_splits: bool = False

    def paged_attention_splits(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, num_splits: int,
                               **kwargs) -> Any:
        """The decode path with `num_splits` splits (a test hook of the kernels, not their public API)."""
        raise NotImplementedError(f"{self.name} leg cannot force a decode split count")

    def synchronize(self) -> None:
        """Waits for queued device work (so timings and errors land in the right record)."""


class KernelModuleLeg(Leg):
    """A leg backed by a kernel package (`tq_torch`, `tq_jax`) that provides `ops`."""

    def __init__(self, module, ops):
        self._mod = module
        self._ops = tuple(ops)

    @property
    def ops(self) -> tuple[str, ...]:
        return self._ops

    def compute_dtype(self, query_dtype: str) -> Optional[str]:
        """The package's own answer (``attention_compute_dtype``), else the query dtype."""
        fn = getattr(self._mod, "attention_compute_dtype", None)
        if callable(fn):
            return fn(query_dtype)
        return getattr(self._mod, "ATTENTION_COMPUTE_DTYPE", None)


class Unavailable:
    """A leg that cannot run here; every record it would produce is ``unavailable``."""

    oracle = False

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def describe(self) -> str:
        return f"{self.name}: unavailable ({self.reason})"


def missing_ops(module, names=OPS) -> list[str]:
    """Contract ops a kernel module does not (yet) provide."""
    return [n for n in names if not callable(getattr(module, n, None))]
