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
    shared: tuple = ()  # per sequence: leading positions that live in the first sequence's pages

    def shared_positions(self, b: int) -> int:
        return self.shared[b] if self.shared else 0


def _shared_counts(seqs, block_size: int, shared_pages: int) -> list[int]:
    """Full pages each sequence after the first takes from the first sequence (prefix sharing)."""
    if not shared_pages or not seqs:
        return [0] * len(seqs)
    first = seqs[0][0] // block_size
    return [0] + [min(shared_pages, s // block_size, first) for s, _ in seqs[1:]]


def paged_batch(seqs, block_size: int, *, rng: np.random.Generator, page_base: int = 0,
                shared_pages: int = 0) -> PagedBatch:
    """Shuffled pages for `seqs`, plus spare (never written) pages.

    Table columns past a sequence's last page name spare pages (poisoned):
    a kernel that reads past ``seq_lens`` sees NaN. Pages below `page_base`
    are never used (far-offset cases). With `shared_pages`, every later
    sequence's first full pages (up to that many) are the first sequence's
    (a repeated block table, as prefix caching builds).
    """
    if shared_pages:
        return _shared_batch(seqs, block_size, rng, page_base, shared_pages)
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


def _shared_batch(seqs, block_size, rng, page_base, shared_pages) -> PagedBatch:
    share = _shared_counts(seqs, block_size, shared_pages)
    need = [-(-s // block_size) for s, _ in seqs]
    own = [n - k for n, k in zip(need, share)]
    total = sum(own)
    spare = max(2, total // 4)
    pool = page_base + rng.permutation(total + spare)
    used, spare_pages = pool[:total], pool[total:]
    width = max(need, default=0) + 1
    table = np.empty((len(seqs), width), dtype=np.int32)
    slots, first_pages, start = [], None, 0
    for b, (s, _) in enumerate(seqs):
        mine = used[start:start + own[b]]
        start += own[b]
        pages = mine if b == 0 else np.concatenate([first_pages[:share[b]], mine])
        if b == 0:
            first_pages = pages
        table[b, :need[b]] = pages
        table[b, need[b]:] = rng.choice(spare_pages, width - need[b])
        pos = np.arange(s)
        slots.append(pages[pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return PagedBatch(page_base + total + spare, table, tuple(slots), page_base,
                      tuple(k * block_size for k in share))


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


def _hidden_slots(batch: PagedBatch, seqs, window) -> np.ndarray:
    """Slots of the batch that no query of the call may see (a shared slot is visible if any sequence sees it)."""
    hidden = [batch.slots[b][_hidden_positions(s, q, window)] for b, (s, q) in enumerate(seqs)]
    hidden_slots = np.concatenate(hidden) if hidden else np.zeros(0, np.int64)
    if not batch.shared or not hidden_slots.size:
        return hidden_slots
    visible = [np.setdiff1d(batch.slots[b], batch.slots[b][_hidden_positions(s, q, window)])
               for b, (s, q) in enumerate(seqs)]
    return np.setdiff1d(hidden_slots, np.concatenate(visible))


# ------------------------------------------------------------------ data of the regression classes

# Elements a k8v4 key takes in `fp8-saturate` data: the fp8 e4m3fn maximum, its neighbours, the
# value RNE would round up to 480 (not representable: 448 after the clamp), far overflow, infinities.
FP8_SATURATING = np.array([448.0, -448.0, 449.0, 464.0, -464.0, 480.0, 1e4, -1e4, np.inf, -np.inf,
                           447.0, 440.0, 432.0, 416.0], np.float32)


def _ulp_variants(x: np.ndarray, rng) -> np.ndarray:
    """Each value, or its float32 neighbour above or below (one third each)."""
    x = x.astype(np.float32)
    which = rng.integers(0, 3, x.shape)
    up, down = np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf))
    return np.where(which == 1, up, np.where(which == 2, down, x))


def _fp8_midpoints() -> np.ndarray:
    """Every midpoint between adjacent non-negative fp8 e4m3fn values (exact in float32)."""
    codes = np.arange(0x7F, dtype=np.uint8)  # 0x7F is NaN
    vals = np.unique(tq_spec.floats.fp8_e4m3fn_decode(codes).astype(np.float64))
    return ((vals[:-1] + vals[1:]) / 2).astype(np.float32)


def _raw_midpoints(preset: str) -> np.ndarray:
    """Midpoints between adjacent bf16 / fp16 values in [2**-6, 8) (exact in float32)."""
    if preset == "bf16":
        bits = np.arange(0x3C80, 0x4100, dtype=np.uint32) << 16
        vals = bits.view(np.float32).astype(np.float64)
    else:
        vals = np.arange(0x2400, 0x4800, dtype=np.uint16).view(np.float16).astype(np.float64)
    return ((vals[:-1] + vals[1:]) / 2).astype(np.float32)


def _key_ties(rng, shape, preset, rotation, codebook) -> np.ndarray:
    """Keys on quantization boundaries (float32), and one ulp either side.

    mse presets: the rotated unit key ``y`` has a third of its coordinates on codebook midpoints (or
    one float32 ulp off), the rest filling the norm to 1; ``k = n * Pi^T y``. The kernels' float32
    normalization and rotation move ``y`` by ~1e-7 relative, so these land within the store
    tolerance's boundary band rather than exactly on it: the class checks that ties and near-ties
    are the only code differences, and that torch, jax and the reference agree on them.
    fp8 / raw keys: elements exactly on rounding midpoints (round-half-even ties) or one ulp off.
    """
    s, hkv, d = shape
    kind = tq_spec.get_preset(preset).key_format
    if kind == "fp8":
        mids = _fp8_midpoints()
        x = mids[rng.integers(0, len(mids), shape)] * rng.choice(np.array([-1, 1], np.float32), shape)
        return _ulp_variants(x, rng)
    if kind == "raw":
        mids = _raw_midpoints(preset)
        x = mids[rng.integers(0, len(mids), shape)] * rng.choice(np.array([-1, 1], np.float32), shape)
        return _ulp_variants(x, rng)
    params = tq_spec.quant_params(preset, d, rotation=rotation, codebook=codebook)
    mids = params.codebook.midpoints.astype(np.float32)
    rot = params.rotation.astype(np.float64)
    out = np.empty(shape, np.float64)
    for t in range(s):
        for h in range(hkv):
            lanes = rng.permutation(d)
            y = np.zeros(d)
            tie = lanes[: d // 3]
            vals = _ulp_variants(mids[rng.integers(0, len(mids), len(tie))], rng).astype(np.float64)
            while (vals ** 2).sum() >= 0.8:
                vals[np.argmax(np.abs(vals))] = 0.0
            y[tie] = vals
            rest = lanes[d // 3:]
            y[rest] = np.sqrt((1.0 - (vals ** 2).sum()) / len(rest)) * rng.choice([-1.0, 1.0], len(rest))
            out[t, h] = rng.uniform(0.5, 4.0) * (rot.T @ y)
    return out.astype(np.float32)


def _value_ties(rng, shape, preset) -> np.ndarray:
    """Values on the uniform quantizer's half steps (exact ties of floor(x + 0.5)) and one ulp off.

    Per token and head: lane 0 is ``lo``, lane 1 is ``hi = lo + (2**b - 1) * step`` with a power-of-two
    step, so the fp32 scale is exactly ``step`` and ``(v - lo) / scale + 0.5`` is an exact integer
    on the ties. Raw presets (no value quantizer) get rounding midpoints as for keys.
    """
    p = tq_spec.get_preset(preset)
    if p.key_format == "raw":
        return _key_ties(rng, shape, preset, None, None)
    levels = 2 ** p.value_bits - 1
    s, hkv, d = shape
    step = np.ldexp(1.0, rng.integers(-5, 0, (s, hkv, 1))).astype(np.float32)
    lo = (rng.integers(-64, 64, (s, hkv, 1)) * step).astype(np.float32)
    j = rng.integers(0, levels, (s, hkv, d)).astype(np.float32)
    v = _ulp_variants(lo + (j + 0.5) * step, rng)
    v[..., 0:1] = lo
    v[..., 1:2] = lo + levels * step
    return v.astype(np.float32)


def _fp8_saturate(rng, k: np.ndarray) -> np.ndarray:
    """`k` with about one element in eight replaced by a saturating value (`FP8_SATURATING`)."""
    hit = rng.random(k.shape) < 0.125
    return np.where(hit, FP8_SATURATING[rng.integers(0, len(FP8_SATURATING), k.shape)], k).astype(np.float32)


def _value_lanes(rng, shape) -> np.ndarray:
    """Values with the min/max in the last lanes, or constant (per token and head, by turns)."""
    s, hkv, d = shape
    v = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    mode = rng.integers(0, 5, (s, hkv))
    for t in range(s):
        for h in range(hkv):
            m = mode[t, h]
            if m == 0:
                v[t, h, -1], v[t, h, -2] = 3.0, -3.0
            elif m == 1:
                v[t, h, -1], v[t, h, -3] = -2.5, 2.0
            elif m == 2:
                v[t, h, :] = np.float32(rng.uniform(-2, 2))  # constant: scale clamps to 1e-8, codes 0
            elif m == 3:
                v[t, h, :] = np.float32(0.75)
                v[t, h, -1] = 0.5  # constant but the last lane (the min)
    return v


def _poison_queries(queries: list) -> None:
    """A NaN element in the first query row and an Inf element in the last (of the first heads)."""
    rows = [(b, i) for b, q in enumerate(queries) for i in range(len(q))]
    if not rows:
        return
    b, i = rows[0]
    queries[b][i, 0, 3] = np.nan
    b, i = rows[-1]
    if (b, i) != rows[0]:
        queries[b][i, -1, 0] = np.inf


def _poison_values(values: list, seqs, window) -> None:
    """Non-finite value elements on keys some rows of the call may not see (DESIGN.md: masked keys never leak).

    A sequence with several query rows gets NaN (kv head 0, lane 1) on the token in the middle of
    its queries, which earlier rows of the same tile must not see, and +Inf / -Inf (last kv head,
    last two lanes) on the token after it. With a window, each sequence also gets NaN (last kv
    head, lane 0) on the token just out of its last query's window (earlier rows of the
    sequence, if any, see it).
    """
    for v, (s, q) in zip(values, seqs):
        first = s - q
        if q >= 2:
            v[first + q // 2, 0, 1] = np.nan
            v[first + q // 2 + 1, -1, -1] = np.inf
            v[first + q // 2 + 1, -1, -2] = -np.inf
        if window is not None and q >= 1 and s - window - 1 >= 0:
            v[s - window - 1, -1, 0] = np.nan


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
        batch = paged_batch(case.seqs, p, rng=rng, page_base=page_base, shared_pages=case.shared_pages)

    scale = case.scale if case.scale is not None else 1.0 / np.sqrt(d)
    rotation = None
    cb = None
    if case.rotation != "hadamard":
        rotation = tq_spec.rotation(d, case.rotation, seed=stable_seed("rotation", seed, case.id) % 2**32)
    if case.codebook != "vllm":
        cb = tq_spec.codebook(d, tq_spec.get_preset(case.preset).key_bits, flavor=case.codebook)

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
        v = _draw(rng, (s, hkv, d), dtype)
        if case.data == "key-ties":
            k, v = _key_ties(rng, (s, hkv, d), case.preset, rotation, cb), _value_ties(rng, (s, hkv, d), case.preset)
        elif case.data == "fp8-saturate":
            k = _fp8_saturate(rng, k.astype(np.float32))
        elif case.data == "value-lanes":
            v = _value_lanes(rng, (s, hkv, d))
        keys.append(k.astype(dtype))
        values.append(v.astype(dtype))
        queries.append(qq)
    if case.data == "nan-query":
        _poison_queries(queries)
    elif case.data == "nan-values":
        _poison_values(values, case.seqs, case.sliding_window)
    for b in range(1, len(case.seqs)):  # shared pages hold the first sequence's tokens
        n = batch.shared_positions(b)
        if n:
            keys[b][:n], values[b][:n] = keys[0][:n], values[0][:n]

    # One-shot store: every token, shuffled, plus -1 rows that must be skipped. A shared page is
    # written once (by the first sequence).
    pad = 1 + sum(s for s, _ in case.seqs) // 8
    own = [slice(batch.shared_positions(b), None) for b in range(len(case.seqs))]
    key = np.concatenate([k[o] for k, o in zip(keys, own)] + [_draw(rng, (pad, hkv, d), dtype)])
    value = np.concatenate([v[o] for v, o in zip(values, own)] + [_draw(rng, (pad, hkv, d), dtype)])
    slots = np.concatenate([sl[o] for sl, o in zip(batch.slots, own)] + [np.full(pad, -1, np.int64)])
    order = rng.permutation(len(slots))
    key, value, slots = key[order], value[order], slots[order].astype(case.slot_dtype)

    cache = np.empty((batch.num_blocks, p, hkv, lay.slot_bytes), dtype=np.uint8)
    cache[...] = poison_row(case.poison, lay.slot_bytes)

    q_lens = [q for _, q in case.seqs]
    query = (np.concatenate(queries) if queries else np.zeros((0, hq, d), dtype)).astype(dtype)
    if case.pad_rows:
        # Rows past query_start_loc[B]: NaN, so a kernel that attends them (or leaves them unwritten) shows.
        query = np.concatenate([query, np.full((case.pad_rows, hq, d), np.nan, np.float32).astype(dtype)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.array([s for s, _ in case.seqs], dtype=np.int32)
    sinks = rng.normal(0.5, 1.0, hq).astype(np.float32) if case.sinks else None
    if sinks is not None and case.data == "nan-sinks":
        special = np.array([np.nan, np.inf, -np.inf, 1e4], np.float32)[:hq]
        sinks[:len(special)] = special

    hidden_slots = _hidden_slots(batch, case.seqs, case.sliding_window)
    return Problem(
        case=case, seed=seed, layout=lay, batch=batch, seq_keys=keys, seq_values=values,
        seq_queries=queries, key=key, value=value, slot_mapping=slots, cache_before=cache,
        query=query, seq_lens=seq_lens, query_start_loc=qsl, sinks=sinks, rotation=rotation,
        codebook=cb, hidden_slots=hidden_slots.astype(np.int64),
    )
