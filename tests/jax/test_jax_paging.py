"""tq_jax.paging: the jittable page allocator and step metadata.

The allocator is checked op by op against a plain-Python model (a stack of
free pages, page lists, reference counts) on a seeded random schedule; the
metadata against hand-built arrays; and the whole loop (prefill, prefix
sharing, decode steps inside one jitted `lax.fori_loop`) against the float64
reference through the real kernels, with bucketed padding rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec
from parity.tolerances import check_attention
from tq_jax import paging

N, S, MAX_PAGES, P = 12, 4, 5, 4


class Model:
    """The allocator in plain Python: what `tq_jax.paging` must compute."""

    def __init__(self):
        self.free = list(range(N - 1, -1, -1))
        self.pages = {s: [] for s in range(S)}  # every column in use, released ones included
        self.first = dict.fromkeys(range(S), 0)  # columns before it were released (window)
        self.lens = dict.fromkeys(range(S), 0)
        self.refs = [0] * N

    def append(self, seq_ids, new_tokens):
        need = {}
        for s, n in zip(seq_ids, new_tokens):
            if s >= 0:
                want = -(-(self.lens[s] + n) // P)
                if want > MAX_PAGES:
                    return False
                need[s] = max(0, want - len(self.pages[s]))
        if sum(need.values()) > len(self.free):
            return False
        for s, n in zip(seq_ids, new_tokens):
            if s >= 0:
                for _ in range(need[s]):
                    page = self.free.pop()
                    self.pages[s].append(page)
                    self.refs[page] += 1
                self.lens[s] += n
        return True

    def _drop(self, columns):
        """`columns`: (sequence, first column, end column) ranges losing one reference."""
        touched = set()
        for s, lo, hi in columns:
            for page in self.pages[s][lo:hi]:
                self.refs[page] -= 1
                touched.add(page)
        self.free += sorted(p for p in touched if self.refs[p] == 0)

    def release(self, seq_ids):
        self._drop([(s, self.first[s], len(self.pages[s])) for s in seq_ids if s >= 0])
        for s in seq_ids:
            if s >= 0:
                self.pages[s], self.lens[s], self.first[s] = [], 0, 0

    def release_window(self, seq_ids, window):
        ranges = []
        for s in seq_ids:
            if s >= 0:
                new_first = min(max(max(self.lens[s] - window + 1, 0) // P, self.first[s]), len(self.pages[s]))
                ranges.append((s, self.first[s], new_first))
        self._drop(ranges)
        for s, _, new_first in ranges:
            self.first[s] = new_first

    def share(self, src, dst, num_tokens):
        shared = min(num_tokens, self.lens[src]) // P
        self.pages[dst] = self.pages[src][:shared]
        self.first[dst] = min(self.first[src], shared)
        for page in self.pages[dst][self.first[dst]:]:
            self.refs[page] += 1
        self.lens[dst] = shared * P

    def assert_matches(self, state):
        nf = int(state.num_free)
        assert list(np.asarray(state.free_pages)[:nf]) == self.free
        assert list(np.asarray(state.ref_counts)) == self.refs
        for s in range(S):
            n, first = int(state.num_pages[s]), int(state.first_page[s])
            assert first == self.first[s], s
            assert list(np.asarray(state.page_table[s, first:n])) == self.pages[s][first:], s
            assert int(state.seq_lens[s]) == self.lens[s], s
        held = {p for s, pages in self.pages.items() for p in pages[self.first[s]:]}
        assert held.isdisjoint(self.free) and len(held) + nf == N  # every page free xor held


_append = jax.jit(paging.append)
_release = jax.jit(paging.release)
_share = jax.jit(paging.share_prefix)
_release_window = jax.jit(paging.release_out_of_window)


def test_allocator_matches_a_python_model():
    rng = np.random.default_rng(0)
    state, model = paging.init_pages(N, S, MAX_PAGES, P), Model()
    model.assert_matches(state)
    for _ in range(80):
        op = rng.choice(["append", "append", "release", "share", "window"])
        if op == "append":
            seq_ids = rng.permutation(S)[:3].astype(np.int32)
            seq_ids[rng.random(3) < 0.2] = -1  # batch padding
            new_tokens = rng.integers(0, 7, 3).astype(np.int32)
            state, ok = _append(state, seq_ids, new_tokens)
            assert bool(ok) == model.append(list(seq_ids), list(new_tokens))
        elif op == "window":
            seq_ids = np.array([rng.integers(0, S), -1, rng.integers(0, S)], np.int32)
            if seq_ids[0] == seq_ids[2]:
                seq_ids[2] = -1
            window = int(rng.integers(1, 9))
            state = _release_window(state, seq_ids, window)
            model.release_window(list(seq_ids), window)
        elif op == "release":
            seq_ids = np.array([rng.integers(0, S), -1], np.int32)
            state = _release(state, seq_ids)
            model.release(list(seq_ids))
        else:
            empty = [s for s in range(S) if model.lens[s] == 0]
            full = [s for s in range(S) if model.lens[s] > 0]
            if not empty or not full:
                continue
            src, dst, num = int(rng.choice(full)), int(rng.choice(empty)), int(rng.integers(0, 12))
            state = _share(state, src, dst, num)
            model.share(src, dst, num)
        model.assert_matches(state)


def test_failed_allocation_leaves_the_state_unchanged():
    state, ok = paging.append(paging.init_pages(4, 2, 3, P), np.array([0], np.int32), np.array([9], np.int32))
    assert bool(ok)
    for seq_ids, new_tokens in (([1], [9]), ([0], [4]), ([1, 0], [1, -1])):  # no pages; > block table; n < 0
        after, ok = paging.append(state, np.array(seq_ids, np.int32), np.array(new_tokens, np.int32))
        assert not bool(ok)
        jax.tree.map(np.testing.assert_array_equal, after, state)


def test_step_metadata_with_padding_rows_and_requests():
    state = paging.init_pages(N, S, MAX_PAGES, P)
    state, _ = paging.append(state, np.array([2], np.int32), np.array([6], np.int32))  # pages 0, 1
    seq_ids, new = np.array([1, -1, 2], np.int32), np.array([5, 3, 2], np.int32)
    state, ok = paging.append(state, seq_ids, new)  # seq 1: pages 2, 3; seq 2 grows to 8 on its pages
    assert bool(ok)
    meta = jax.jit(functools.partial(paging.step_metadata, num_tokens=10))(state, seq_ids, new)
    np.testing.assert_array_equal(meta.block_table, [[2, 3, 0, 0, 0], [0] * 5, [0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(meta.seq_lens, [5, 0, 8])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 5, 5, 7])
    np.testing.assert_array_equal(meta.slot_mapping, [8, 9, 10, 11, 12, 6, 7, -1, -1, -1])
    np.testing.assert_array_equal(meta.positions, [0, 1, 2, 3, 4, 6, 7, 0, 0, 0])
    np.testing.assert_array_equal(meta.last_token_index, [4, 0, 6])


def test_page_allocator_host_wrapper():
    alloc = paging.PageAllocator(num_pages=3, max_seqs=2, max_pages_per_seq=3, page_size=P)
    alloc.step([0], [5], num_tokens=8)
    assert alloc.num_free == 1
    with pytest.raises(RuntimeError, match="not enough free pages"):
        alloc.step([1], [8], num_tokens=8)
    assert alloc.num_free == 1
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.step([1], [9], num_tokens=8)
    alloc.share_prefix(0, 1, 5)  # one whole page shared
    alloc.release([0])
    assert alloc.num_free == 2 and list(np.asarray(alloc.state.ref_counts)) == [1, 0, 0]
    alloc.release([1])
    assert alloc.num_free == 3


# ----------------------------------------------------------- with the kernels

PRESET, D, HQ, HKV = "turboquant_4bit_nc", 64, 4, 2
_TOKENS = np.random.default_rng(1).standard_normal((32, HQ + 2 * HKV, D)).astype(np.float32)


def _qkv(positions):
    """Query, key and value of a token, a function of its position only (same prompt everywhere)."""
    x = jnp.asarray(_TOKENS)[positions]
    return x[:, :HQ], x[:, HQ:HQ + HKV], x[:, HQ + HKV:]


def _attend_step(state, cache, seq_ids, new_tokens, num_tokens):
    state, ok = paging.append(state, seq_ids, new_tokens)
    meta = paging.step_metadata(state, seq_ids, new_tokens, num_tokens=num_tokens)
    q, k, v = _qkv(meta.positions)
    cache = tq_jax.store_kv(k, v, cache, meta.slot_mapping, preset=PRESET)
    out = tq_jax.paged_attention(q, cache, meta.block_table, meta.seq_lens, meta.query_start_loc, preset=PRESET)
    return state, cache, out, meta, ok


def _check(out, cache, meta):
    t = int(meta.query_start_loc[-1])
    q = np.asarray(_qkv(meta.positions)[0])[:t]
    assert np.all(np.asarray(out)[t:] == 0)
    res = check_attention(np.asarray(out)[:t], q, np.asarray(cache), np.asarray(meta.block_table),
                          np.asarray(meta.seq_lens), np.asarray(meta.query_start_loc), preset=PRESET)
    assert res.ok, res.describe()


def test_prefill_share_and_jitted_decode_loop_through_the_kernels():
    lay = tq_spec.layout(PRESET, D)
    cache = jnp.zeros((N, P, HKV, lay.slot_bytes), jnp.uint8)
    state = paging.init_pages(N, S, MAX_PAGES, P)
    step = jax.jit(_attend_step, static_argnums=(4,))
    # Prefill two ragged prompts into a 16-row bucket.
    seq_ids = np.array([0, 1, -1], np.int32)
    state, cache, out, meta, ok = step(state, cache, seq_ids, np.array([7, 3, 0], np.int32), 16)
    assert bool(ok)
    _check(out, cache, meta)
    prefill0 = np.asarray(out)[:7]
    # Sequence 2 shares sequence 0's first page and computes only the rest of the same prompt.
    state = paging.share_prefix(state, 0, 2, 7)
    assert int(state.seq_lens[2]) == P
    state, cache, out, meta, ok = step(state, cache, np.array([2, -1, -1], np.int32), np.array([3, 0, 0], np.int32), 16)
    _check(out, cache, meta)
    np.testing.assert_array_equal(np.asarray(out)[:3], prefill0[P:7])  # same tokens, same pages: same rows

    @jax.jit
    def decode_loop(state, cache):
        def body(_, carry):
            state, cache, _, _ = carry
            state, cache, out, meta, _ = _attend_step(state, cache, np.array([0, 1, 2], np.int32),
                                                      np.array([1, 1, 1], np.int32), 4)
            return state, cache, out, meta

        out0 = jnp.zeros((4, HQ, D), jnp.float32)
        meta0 = paging.step_metadata(state, np.array([0, 1, 2], np.int32), np.array([1, 1, 1], np.int32),
                                     num_tokens=4)
        return jax.lax.fori_loop(0, 3, body, (state, cache, out0, meta0))

    state, cache, out, meta = decode_loop(state, cache)
    np.testing.assert_array_equal(state.seq_lens[:3], [10, 6, 10])
    _check(out, cache, meta)
    np.testing.assert_array_equal(np.asarray(out)[0], np.asarray(out)[2])  # seq 0 and its prefix-sharing twin


def test_sliding_window_pages_are_released_and_reused():
    """A window layer frees the pages behind its window; another sequence reuses them while the
    first keeps decoding, and every step still matches the reference (released columns keep stale
    ids that the kernels mask)."""
    window, num_pages = 5, 5
    lay = tq_spec.layout(PRESET, D)
    cache = jnp.zeros((num_pages, P, HKV, lay.slot_bytes), jnp.uint8)
    state = paging.init_pages(num_pages, 2, 8, P)

    @functools.partial(jax.jit, static_argnums=(4,))
    def step(state, cache, seq_ids, new_tokens, num_tokens):
        state, ok = paging.append(state, seq_ids, new_tokens)
        meta = paging.step_metadata(state, seq_ids, new_tokens, num_tokens=num_tokens)
        q, k, v = _qkv(meta.positions)
        cache = tq_jax.store_kv(k, v, cache, meta.slot_mapping, preset=PRESET)
        out = tq_jax.paged_attention(q, cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                     preset=PRESET, sliding_window=window)
        return paging.release_out_of_window(state, seq_ids, window), cache, out, meta, ok

    schedule = [([0, -1], [6, 0])] + [([0, 1], [1, 3 if i == 0 else 1]) for i in range(8)]
    held_by_0 = set()
    for seq_ids, new_tokens in schedule:
        state, cache, out, meta, ok = step(state, cache, np.array(seq_ids, np.int32),
                                           np.array(new_tokens, np.int32), 8)
        assert bool(ok)
        t = int(meta.query_start_loc[-1])
        res = check_attention(np.asarray(out)[:t], np.asarray(_qkv(meta.positions)[0])[:t], np.asarray(cache),
                              np.asarray(meta.block_table), np.asarray(meta.seq_lens),
                              np.asarray(meta.query_start_loc), preset=PRESET, sliding_window=window)
        assert res.ok, res.describe()
        held_by_0 |= set(np.asarray(meta.block_table[0, :int(state.num_pages[0])]).tolist())
    # 14 + 10 tokens (7 pages without release) on 5 pages of 4: pages behind the window came back.
    assert int(state.seq_lens[0]) == 14 and int(state.seq_lens[1]) == 10
    held_by_1 = set(np.asarray(state.page_table[1, :int(state.num_pages[1])]).tolist())
    assert held_by_0 & held_by_1, "no page of sequence 0 was reused by sequence 1"
