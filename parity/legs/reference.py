"""The float64 reference leg (`tq_spec.reference`), the oracle of every check."""

from __future__ import annotations

import numpy as np


from tq_spec import reference

from .base import Leg


class ReferenceLeg(Leg):
    """`tq_spec.reference` as a leg: float64 outputs, one path named ``reference``.

    As the oracle it is not compared with itself; it runs the end-to-end
    (expected distortion) and chunking checks, which are meaningful for it.
    """

    name = "reference"
    oracle = True

    def paths(self, problem) -> tuple[str, ...]:
        return ("reference",)

    def compute_dtype(self, query_dtype: str):
        return "float32"  # only used when a check asks; the reference's own error is ~0

    def describe(self) -> str:
        return f"reference: tq_spec float64 (numpy {np.__version__})"

    def put(self, array):
        return np.array(array, copy=True)

    def get(self, x):
        return np.array(x, copy=True)

    def store_kv(self, key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None):
        return reference.store_kv(key, value, kv_cache, slot_mapping, preset=preset,
                                  rotation=rotation, codebook=codebook)

    def paged_attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
                        scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                        rotation=None, codebook=None, path="auto"):
        if path not in ("auto", "reference"):
            # Paths are a kernel concept; asking the oracle for one is a harness bug.
            raise ValueError(f"path: the reference has only 'reference', got {path!r}")
        return reference.paged_attention(
            query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
            rotation=rotation, codebook=codebook,
        )


