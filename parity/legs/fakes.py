"""Self-test legs: a correct numpy leg and deliberately broken variants.

They exist to prove the suite itself works (unit tests, and
``python -m parity --legs numpy,broken-window-extend`` as a demo): the numpy
leg must pass every comparison, and each broken variant must be caught by
the comparison named in `BROKEN_KINDS`.

`NumpyLeg` is `tq_spec.reference` behind the kernel interface: outputs
rounded to the query dtype, the dispatch table's paths accepted (and
ignored: every path is the same float64 math).
"""

from __future__ import annotations

import numpy as np

import tq_spec
from tq_spec import reference

from .base import Leg

# kind -> what is broken (and which comparison is expected to catch it)
BROKEN_KINDS = {
    "window-extend": "sliding window dropped on the extend path (attention, paths)",
    "window-off-by-one": "window W treated as W + 1 (attention, window-edge cases)",
    "gqa-modulo": "query head h reads kv head h % Hkv instead of h // (Hq / Hkv) (attention, gqa)",
    "store-canary": "store_kv also writes one byte of an unnamed slot (store canary)",
    "inf-output": "one output element of every call is +inf (attention: an infinite error the reports must survive)",
}


class NumpyLeg(Leg):
    """The float64 reference, shaped like a kernel leg (see module docstring)."""

    name = "numpy"

    def describe(self) -> str:
        return "numpy: tq_spec.reference behind the kernel interface (self-test leg)"

    def put(self, array):
        return np.array(array, copy=True)

    def get(self, x):
        return np.array(x, copy=True)

    def store_kv(self, key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None):
        return reference.store_kv(key, value, kv_cache, slot_mapping, preset=preset, rotation=rotation,
                                  codebook=codebook)

    supports_splits = True

    def paged_attention_splits(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, num_splits: int,
                               **kwargs):
        # Every path (and split count) is the same float64 math here; this keeps the plumbing tested.
        return self.paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, path="decode",
                                    **kwargs)

    def paged_attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
                        scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                        rotation=None, codebook=None, path="auto"):
        problem = tq_spec.dispatch.problem_for(query, kv_cache, block_table, preset=preset,
                                               sliding_window=sliding_window)
        tq_spec.dispatch.select_path(problem, path)  # unknown / ineligible paths raise like a kernel
        out = reference.paged_attention(
            query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
            rotation=rotation, codebook=codebook)
        return out.astype(query.dtype)


class BrokenLeg(NumpyLeg):
    """`NumpyLeg` with one deliberate defect (`BROKEN_KINDS`)."""

    def __init__(self, kind: str):
        if kind not in BROKEN_KINDS:
            raise ValueError(f"kind: expected one of {tuple(BROKEN_KINDS)}, got {kind!r}")
        self.kind = kind
        self.name = f"broken-{kind}"

    def describe(self) -> str:
        return f"{self.name}: deliberately broken self-test leg ({BROKEN_KINDS[self.kind]})"

    @staticmethod
    def _resolve(query, kv_cache, block_table, preset, sliding_window, path) -> str:
        """The path a kernel would run (auto resolved through the shared table)."""
        return tq_spec.dispatch.select_path(tq_spec.dispatch.problem_for(
            query, kv_cache, block_table, preset=preset, sliding_window=sliding_window), path)

    def store_kv(self, key, value, kv_cache, slot_mapping, **kw):
        out = super().store_kv(key, value, kv_cache, slot_mapping, **kw)
        if self.kind == "store-canary":
            sm = np.asarray(slot_mapping).astype(np.int64)
            p = out.shape[1]
            named = np.zeros(out.shape[0] * p, bool)
            named[sm[sm >= 0]] = True
            free = np.flatnonzero(~named)
            if free.size:
                s = free[len(free) // 2]
                out[s // p, s % p, 0, 0] ^= 0x01
        return out

    def paged_attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
                        sliding_window=None, sinks=None, path="auto", **kw):
        if self.kind == "window-extend" and self._resolve(query, kv_cache, block_table, preset, sliding_window,
                                                          path) == "extend":
            sliding_window = None
        if self.kind == "window-off-by-one" and sliding_window is not None:
            sliding_window = sliding_window + 1
        if self.kind == "inf-output":
            out = super().paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset,
                                          sliding_window=sliding_window, sinks=sinks, path=path, **kw)
            if out.size:
                out = out.copy()
                out.reshape(-1)[0] = np.inf
            return out
        if self.kind == "gqa-modulo":
            hq, hkv = query.shape[1], kv_cache.shape[2]
            g = hq // hkv
            h = np.arange(hq)
            perm = (h % hkv) * g + h // hkv  # the correct head whose kv head is h % hkv
            q2 = np.empty_like(query)
            q2[:, perm] = query
            s2 = None
            if sinks is not None:
                s2 = np.empty_like(sinks)
                s2[perm] = sinks
            out = super().paged_attention(q2, kv_cache, block_table, seq_lens, query_start_loc, preset=preset,
                                          sliding_window=sliding_window, sinks=s2, path=path, **kw)
            return out[:, perm]
        return super().paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset,
                                       sliding_window=sliding_window, sinks=sinks, path=path, **kw)
