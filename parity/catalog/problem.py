"""Turns an `AttentionCase` into concrete numpy inputs, reproducibly.

Everything is drawn from a generator seeded by ``(seed, case.id)``, so a case
id plus a seed reproduces the exact arrays (the repro line relies on this).

The cache starts filled with the case's poison pattern (NaN / Inf bytes);
`store_kv` of every token of every sequence fills the used slots. Pages the
block table names past a sequence's end, spare pages, and (after the store)
slots no query of the call may see (outside the window, or every slot of a
sequence without queries) keep or get the poison, so any kernel that reads
them leaks NaN/Inf into its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import ml_dtypes
import numpy as np

import tq_spec

from .cases import POISON_PATTERNS, AttentionCase
from .sweeps import rng_for, stable_seed

SHARP_QUERY_GAIN = 6.0  # logits of a few units: a soft cap of 5..50 changes the answer
VERY_NEGATIVE_LOGIT = 1.2e5  # target |logit|; every visible logit stays below -5e4
FAR_OFFSET_BYTES = 2**31  # far_pages: the first used page starts beyond this byte offset

_NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def np_dtype(name: str):
    """numpy dtype for a float dtype name (bfloat16 via ml_dtypes)."""
    try:
        return np.dtype(_NP_DTYPES[name])
    except KeyError:
        raise ValueError(f"dtype: expected one of {tuple(_NP_DTYPES)}, got {name!r}") from None


def poison_row(pattern: str, slot_bytes: int) -> np.ndarray:
    """One slot's worth of poison bytes, ``uint8[slot_bytes]``."""
    return np.resize(np.array(POISON_PATTERNS[pattern], dtype=np.uint8), slot_bytes)


@dataclass(frozen=True)
class PagedBatch:
    """Block table and per-sequence slots of a batch, independent of the preset.

    ``slots[b]`` is ``int64[seq_len_b]``: the slot of each position of sequence b.
    """

    num_blocks: int
    block_table: np.ndarray
    slots: tuple
    first_used_page: int


def paged_batch(seqs, block_size: int, *, rng: np.random.Generator, page_base: int = 0) -> PagedBatch:
    """Shuffled pages for `seqs`, plus spare (never written) pages.

    Table columns past a sequence's last page name spare pages (poisoned):
    a kernel that reads past ``seq_lens`` sees NaN. Pages below `page_base`
    are never used (far-offset cases).
    """
    need = [-(-s // block_size) for s, _ in seqs]
    total = sum(need)
    spare = max(2, total // 4)
    pool = page_base + rng.permutation(total + spare)
    used, spare_pages = pool[:total], pool[total:]
    width = max(need, default=0) + 1
    table = np.empty((len(seqs), width), dtype=np.int32)
    slots = []
    start = 0
    for b, (s, _) in enumerate(seqs):
        pages = used[start : start + need[b]]
        start += need[b]
        table[b, : need[b]] = pages
        table[b, need[b] :] = rng.choice(spare_pages, width - need[b])
        pos = np.arange(s)
        slots.append(pages[pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return PagedBatch(page_base + total + spare, table, tuple(slots), page_base)


def _draw(rng, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@dataclass
class Problem:
    """Concrete inputs of one attention case (numpy arrays).

    Per sequence ``b`` (positions ``0..seq_len-1``): ``seq_keys[b]``,
    ``seq_values[b]`` ``[seq_len, Hkv, D]`` and ``seq_queries[b]``
    ``[q_len, Hq, D]`` (the last q_len positions), all in the case dtype.
    The one-shot store writes every token of every sequence: ``key``,
    ``value`` ``[Ts, Hkv, D]`` and ``slot_mapping [Ts]`` in shuffled order,
    with a few extra ``-1`` rows that must not be written.
    """

    case: AttentionCase
    seed: int
    layout: tq_spec.Layout
    batch: PagedBatch
    seq_keys: list
    seq_values: list
    seq_queries: list
    key: np.ndarray
    value: np.ndarray
    slot_mapping: np.ndarray
    cache_before: np.ndarray
    query: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    sinks: Optional[np.ndarray]
    rotation: Optional[np.ndarray]
    codebook: Optional[tq_spec.Codebook]
    hidden_slots: np.ndarray
    extra: dict = field(default_factory=dict)

    @property
    def block_table(self) -> np.ndarray:
        return self.batch.block_table

    @property
    def preset(self) -> str:
        return self.case.preset

    def store_kwargs(self) -> dict:
        return dict(preset=self.case.preset, rotation=self.rotation, codebook=self.codebook)

    def attention_kwargs(self) -> dict:
        c = self.case
        return dict(preset=c.preset, scale=c.scale, sliding_window=c.sliding_window,
                    logits_soft_cap=c.logits_soft_cap, sinks=self.sinks, rotation=self.rotation,
                    codebook=self.codebook)

    def attention_args(self) -> tuple:
        """``(query, block_table, seq_lens, query_start_loc)``; the cache goes in between."""
        return self.query, self.block_table, self.seq_lens, self.query_start_loc

    def hide(self, cache: np.ndarray) -> np.ndarray:
        """A copy of `cache` with every slot no query may see overwritten by poison."""
        out = np.array(cache, dtype=np.uint8, copy=True)
        if self.hidden_slots.size:
            p = out.shape[1]
            out[self.hidden_slots // p, self.hidden_slots % p] = poison_row(self.case.poison, out.shape[-1])
        return out


def _hidden_positions(seq_len: int, q_len: int, window) -> np.ndarray:
    """Positions no query of the sequence can see in this call."""
    if q_len == 0:
        return np.arange(seq_len)
    if window is None:
        return np.arange(0)
    first_query = seq_len - q_len
    return np.arange(max(0, first_query - window + 1))


def _very_negative(rng, s, q, hq, hkv, d, dtype, scale):
    """Keys anti-aligned with the queries of their head: every logit ~ -VERY_NEGATIVE_LOGIT."""
    amp = np.sqrt(VERY_NEGATIVE_LOGIT / scale)
    u = rng.standard_normal((hkv, d))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    noise_k = rng.standard_normal((s, hkv, d)) * (0.05 / np.sqrt(d))
    k = (-amp * (u[None] + noise_k)).astype(np.float32).astype(dtype)
    g = hq // hkv
    uq = np.repeat(u, g, axis=0)
    noise_q = rng.standard_normal((q, hq, d)) * (0.01 / np.sqrt(d))
    qq = (amp * (uq[None] + noise_q)).astype(np.float32).astype(dtype)
    return k, qq


def build_problem(case: AttentionCase, seed: int, *, batch: Optional[PagedBatch] = None,
                  stream: str = "") -> Problem:
    """Concrete inputs for `case` (deterministic in ``(seed, case.id, stream)``).

    `batch` reuses a block table (layers of one model share it); `stream`
    separates the random streams of problems built from the same case.
    """
    rng = rng_for("problem", seed, case.id, stream)
    lay = tq_spec.layout(case.preset, case.head_dim)
    dtype = np_dtype(case.dtype)
    d, hq, hkv, p = case.head_dim, case.num_q_heads, case.num_kv_heads, case.block_size
    page_base = 0
    if case.far_pages:
        page_bytes = p * hkv * lay.slot_bytes
        page_base = FAR_OFFSET_BYTES // page_bytes + 1
    if batch is None:
        batch = paged_batch(case.seqs, p, rng=rng, page_base=page_base)

    scale = case.scale if case.scale is not None else 1.0 / np.sqrt(d)
    keys, values, queries = [], [], []
    for s, q in case.seqs:
        if case.data == "very-negative":
            k, qq = _very_negative(rng, s, q, hq, hkv, d, dtype, scale)
        else:
            k = _draw(rng, (s, hkv, d), dtype)
            qq = _draw(rng, (q, hq, d), np.float32)
            if case.data == "sharp":
                qq = qq * SHARP_QUERY_GAIN
            qq = qq.astype(dtype)
        keys.append(k)
        values.append(_draw(rng, (s, hkv, d), dtype))
        queries.append(qq)

    # One-shot store: every token, shuffled, plus -1 rows that must be skipped.
    pad = 1 + sum(s for s, _ in case.seqs) // 8
    key = np.concatenate(keys + [_draw(rng, (pad, hkv, d), dtype)])
    value = np.concatenate(values + [_draw(rng, (pad, hkv, d), dtype)])
    slots = np.concatenate(list(batch.slots) + [np.full(pad, -1, np.int64)])
    order = rng.permutation(len(slots))
    key, value, slots = key[order], value[order], slots[order].astype(case.slot_dtype)

    cache = np.empty((batch.num_blocks, p, hkv, lay.slot_bytes), dtype=np.uint8)
    cache[...] = poison_row(case.poison, lay.slot_bytes)

    q_lens = [q for _, q in case.seqs]
    query = (np.concatenate(queries) if queries else np.zeros((0, hq, d), dtype)).astype(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.array([s for s, _ in case.seqs], dtype=np.int32)
    sinks = rng.normal(0.5, 1.0, hq).astype(np.float32) if case.sinks else None

    rotation = None
    cb = None
    if case.rotation != "hadamard":
        rotation = tq_spec.rotation(d, case.rotation, seed=stable_seed("rotation", seed, case.id) % 2**32)
    if case.codebook != "vllm":
        cb = tq_spec.codebook(d, tq_spec.get_preset(case.preset).key_bits, flavor=case.codebook)

    hidden = [
        batch.slots[b][_hidden_positions(s, q, case.sliding_window)] for b, (s, q) in enumerate(case.seqs)
    ]
    hidden_slots = np.concatenate(hidden) if hidden else np.zeros(0, np.int64)
    return Problem(
        case=case, seed=seed, layout=lay, batch=batch, seq_keys=keys, seq_values=values,
        seq_queries=queries, key=key, value=value, slot_mapping=slots, cache_before=cache,
        query=query, seq_lens=seq_lens, query_start_loc=qsl, sinks=sinks, rotation=rotation,
        codebook=cb, hidden_slots=hidden_slots.astype(np.int64),
    )
