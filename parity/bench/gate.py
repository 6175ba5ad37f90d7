"""The correctness gate: a configuration is timed only after it matched the float64 reference.

The reference cannot evaluate a B=32 x 8k decode or an 8k causal prefill in
numpy within the benchmark's time, so it checks a sample of sub-problems that
are exact restrictions of the full one: the first and last sequences of the
batch (their block-table rows and seq_lens), and for long queries only their
first and last query rows. Query rows ``[a, a+k)`` of a sequence equal a
sequence with ``seq_len' = seq_len - q_len + a + k`` and ``q_len' = k`` over
the same cache (queries are its last tokens). The sampled pages are gathered into a small cache and the
block table is remapped onto it (still in permuted order). The comparison is
`parity.tolerances.check_attention` on those bytes; the whole output must in
addition be finite (the torch output buffer is poisoned with NaN first, so an
unwritten row shows; jax outputs are allocated by XLA and cannot be poisoned
from outside). Inputs are standard-normal bf16, never zeros, and unwritten
cache slots hold NaN bytes, so a read past seq_lens shows too. Stores compare the bytes of a few whole pages with
`parity.tolerances.compare_store`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tq_spec import reference

from .. import tolerances
from .inputs import POISON_BYTE, RowInputs, host

FIRST_ROWS = 8
LAST_ROWS = 32
STORE_SAMPLE_PAGES = 4


@dataclass
class Verdict:
    """Outcome of one gate check."""

    ok: bool
    detail: str
    max_err: float = 0.0
    bound: float = 0.0


def _host_blocks(cache, ids: np.ndarray) -> np.ndarray:
    """``cache[ids]`` as a numpy uint8 array (gathered on the device first: only the sample moves)."""
    return host(cache.index_select(0, _torch_index(ids, cache.device)))


class AttentionGate:
    """The sampled reference of one (row, preset) on one cache; checks any leg's output.

    Args:
      inputs: the row's inputs; cache: the torch ``uint8[N, P, Hkv, S]`` both legs read.
    """

    def __init__(self, inputs: RowInputs, cache, preset: str):
        row = inputs.row
        seqs = row.seqs()
        bt = inputs.batch.block_table
        # The first and the last sequence (in a mixed batch: a decode and the chunk); of a long
        # query its first rows (few keys) and its last rows (every key). Each sampled sequence
        # costs the reference a full decode of its pages, so the sample stays this small.
        samples = []  # (b, a, e): query rows [a, e) of sequence b
        for b in sorted({0, len(seqs) - 1}):
            _, q = seqs[b]
            if q <= LAST_ROWS:
                samples.append((b, 0, q))
            else:
                samples += [(b, 0, FIRST_ROWS), (b, q - LAST_ROWS, q)]
        page = row.page
        lens = [seqs[b][0] - seqs[b][1] + e for b, _, e in samples]
        need = [-(-s // page) for s in lens]
        ids = np.unique(np.concatenate([bt[b, :n] for (b, _, _), n in zip(samples, need)]))
        table = np.zeros((len(samples), max(need)), np.int32)
        for i, ((b, _, _), n) in enumerate(zip(samples, need)):
            table[i, :n] = np.searchsorted(ids, bt[b, :n])
        self.rows = np.concatenate([np.arange(inputs.qsl_np[b] + a, inputs.qsl_np[b] + e) for b, a, e in samples])
        self.preset = preset
        self.kw = dict(preset=preset, sliding_window=row.window)
        self.query = host(inputs.query.index_select(0, _torch_index(self.rows, inputs.query.device)))
        self.args = (self.query, _host_blocks(cache, ids), table, np.array(lens, np.int32),
                     np.concatenate([[0], np.cumsum([e - a for _, a, e in samples])]).astype(np.int32))
        self.what = f"{len(samples)} sampled sub-sequences, {len(self.rows)} query rows, {len(ids)} pages"
        with np.errstate(all="ignore"):
            self.ref = reference.paged_attention(*self.args, **self.kw)
        self._emulations: dict[str, tolerances.Emulation] = {}

    def check(self, sampled_out: np.ndarray, all_finite: bool, compute_dtype: str | None) -> Verdict:
        """`sampled_out`: the leg's output rows `self.rows` (numpy); `all_finite`: of the whole output."""
        cd = compute_dtype or "bfloat16"
        if cd not in self._emulations:
            with np.errstate(all="ignore"):
                self._emulations[cd] = tolerances.emulate(*self.args, compute_dtype=cd, **self.kw)
        with np.errstate(all="ignore"):
            cmp = tolerances.check_attention(sampled_out, *self.args, compute_dtype=cd, reference_out=self.ref,
                                             emulation=self._emulations[cd], **self.kw)
        ok = cmp.ok and all_finite
        detail = cmp.describe() + f" on {self.what}"
        if not all_finite:
            detail = "non-finite values in the full output (unwritten or NaN rows); " + detail
        return Verdict(ok, detail, cmp.max_err, cmp.bound)


def _torch_index(rows: np.ndarray, device):
    import torch

    return torch.from_numpy(rows.astype(np.int64)).to(device)


class StoreGate:
    """Checks a store's cache bytes on a few whole pages against `tq_spec.reference.store_kv`.

    Args:
      key, value: the ``[T, Hkv, D]`` torch inputs of the store; slots: ``int[T]`` numpy.
    """

    def __init__(self, key, value, slots: np.ndarray, page: int, preset: str, seed: int):
        pages = np.unique(slots // page)
        rng = np.random.default_rng(seed)
        chosen = np.sort(rng.choice(pages, min(STORE_SAMPLE_PAGES, len(pages)), replace=False))
        tokens = np.nonzero(np.isin(slots // page, chosen))[0]
        idx = _torch_index(tokens, key.device)
        self.key = host(key.index_select(0, idx))
        self.value = host(value.index_select(0, idx))
        self.slot_mapping = (np.searchsorted(chosen, slots[tokens] // page) * page + slots[tokens] % page)
        self.pages = chosen
        self.preset = preset

    def check(self, sampled_cache: np.ndarray) -> Verdict:
        """`sampled_cache`: the leg's cache pages `self.pages` after the store (numpy uint8)."""
        before = np.full_like(sampled_cache, POISON_BYTE)
        cmp = tolerances.compare_store(sampled_cache, self.key, self.value, before, self.slot_mapping,
                                       preset=self.preset)
        return Verdict(cmp.ok, cmp.describe().replace("\n", " ") + f" (pages sampled: {len(self.pages)})")
