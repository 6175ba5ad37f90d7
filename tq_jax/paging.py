"""Paging on device: a jittable page allocator and the per-step op metadata.

Everything here is plain jnp on int32 arrays, so it runs inside `jax.jit`,
`lax.while_loop` sampler loops and `nnx.jit` steps, never reads device values
on the host, and never changes a shape (no recompilation as sequences grow).

* `PageState`: the allocator state, a pytree. ``free_pages[:num_free]`` is a
  stack of free page ids; ``page_table[s, :num_pages[s]]`` are the pages of
  sequence slot ``s`` in order; ``seq_lens[s]`` its tokens; ``ref_counts[p]``
  how many sequences hold page ``p`` (prefix sharing).
* `init_pages`, `reserve`, `append`, `release`, `share_prefix`,
  `release_out_of_window`: pure functions ``state -> state`` (plus an ``ok``
  flag where allocation can fail: then the state is returned unchanged, all
  or nothing).
* `step_metadata`: a step's (sequences, new token counts) -> `StepMetadata`,
  the arguments of `tq_jax.store_kv` / `tq_jax.paged_attention` plus positions
  and last-token indices, padded to a bucketed token count ``T``: padding
  rows get slot -1 (not written) and position 0, and attention returns zeros
  there.
* `PageAllocator`: a host-side convenience wrapper for simple scripts.

A step looks like::

    state, ok = paging.append(state, seq_ids, new_tokens)      # reserve pages, grow seq_lens
    meta = paging.step_metadata(state, seq_ids, new_tokens, num_tokens=T)
    cache = tq_jax.store_kv(k, v, cache, meta.slot_mapping, preset=...)
    out = tq_jax.paged_attention(q, cache, meta.block_table, meta.seq_lens, meta.query_start_loc, preset=...)
    logits_rows = out[meta.last_token_index]

Batch padding: a ``seq_ids`` entry of -1 is an empty request (q_len 0,
seq_len 0); its ``new_tokens`` are ignored. Sequence ids in one call must be
unique.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "PageAllocator", "PageState", "StepMetadata", "append", "init_pages", "release", "release_out_of_window",
    "reserve", "share_prefix", "step_metadata",
]


@dataclass(frozen=True)
class PageState:
    """Allocator state (int32 arrays; `page_size` is static).

    Attributes:
      free_pages: ``int32[N]``; entries ``[0, num_free)`` are the free page ids (a stack).
      num_free: ``int32[]``.
      ref_counts: ``int32[N]``: sequences holding each page (0 for free pages).
      page_table: ``int32[S, max_pages]``: pages of each sequence slot (column
        ``c`` holds positions ``[c * P, (c + 1) * P)``); entries past
        ``num_pages[s]`` are 0 and entries before ``first_page[s]`` are stale
        ids (valid, so reads stay inside the cache; the kernels mask them).
      num_pages: ``int32[S]``: columns in use; seq_lens: ``int32[S]`` (tokens).
      first_page: ``int32[S]``: columns before it were released by
        `release_out_of_window`; the sequence holds columns ``[first_page, num_pages)``.
      page_size: P, tokens per page (static).
    """

    free_pages: jax.Array
    num_free: jax.Array
    ref_counts: jax.Array
    page_table: jax.Array
    num_pages: jax.Array
    seq_lens: jax.Array
    first_page: jax.Array
    page_size: int

    @property
    def max_pages(self) -> int:
        return int(self.page_table.shape[1])


jax.tree_util.register_dataclass(
    PageState, data_fields=["free_pages", "num_free", "ref_counts", "page_table", "num_pages", "seq_lens",
                            "first_page"], meta_fields=["page_size"])


@dataclass(frozen=True)
class StepMetadata:
    """The op metadata of one step (all int32), for a batch of ``B`` requests and ``T`` token rows.

    Attributes:
      block_table: ``[B, max_pages]``; seq_lens: ``[B]`` (after the step's tokens);
      query_start_loc: ``[B + 1]`` (ends at the real token count, <= T).
      slot_mapping: ``[T]`` (-1 on padding rows).
      positions: ``[T]`` token positions in their sequence (0 on padding rows), for RoPE.
      last_token_index: ``[B]``: row of each request's last new token (0 for
        requests without new tokens), to gather next-token logits.
    """

    block_table: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    slot_mapping: jax.Array
    positions: jax.Array
    last_token_index: jax.Array


jax.tree_util.register_dataclass(
    StepMetadata, data_fields=["block_table", "seq_lens", "query_start_loc", "slot_mapping", "positions",
                               "last_token_index"], meta_fields=[])


def init_pages(num_pages: int, max_seqs: int, max_pages_per_seq: int, page_size: int) -> PageState:
    """An empty allocator: every page free, every sequence slot empty.

    Args:
      num_pages: N, the cache's ``num_blocks``; max_seqs: S sequence slots;
      max_pages_per_seq: columns of the block table (capacity ``* page_size`` tokens);
      page_size: the cache's ``block_size``.
    """
    for name, v in (("num_pages", num_pages), ("max_seqs", max_seqs), ("max_pages_per_seq", max_pages_per_seq),
                    ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    return PageState(
        # Popped from the end: page 0 is handed out first.
        free_pages=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
        num_free=jnp.int32(num_pages),
        ref_counts=jnp.zeros((num_pages,), jnp.int32),
        page_table=jnp.zeros((max_seqs, max_pages_per_seq), jnp.int32),
        num_pages=jnp.zeros((max_seqs,), jnp.int32),
        seq_lens=jnp.zeros((max_seqs,), jnp.int32),
        first_page=jnp.zeros((max_seqs,), jnp.int32),
        page_size=int(page_size),
    )


def _requests(seq_ids, new_tokens):
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    valid = seq_ids >= 0
    return seq_ids, jnp.where(valid, seq_ids, 0), valid, jnp.where(valid, jnp.asarray(new_tokens, jnp.int32), 0)


def reserve(state: PageState, seq_ids, new_tokens) -> tuple[PageState, jax.Array]:
    """Allocates the pages sequences need to grow by `new_tokens` (lengths unchanged).

    Args:
      seq_ids: ``int32[B]`` sequence slots (unique; -1 = padding, ignored).
      new_tokens: ``int32[B]`` tokens each sequence will add (>= 0).

    Returns:
      ``(state, ok)``: ok is a bool scalar; False (not enough free pages, or a
      sequence would outgrow its block table) leaves the state unchanged.
    """
    _, sid, valid, n = _requests(seq_ids, new_tokens)
    p = state.page_size
    want = (state.seq_lens[sid] + n + p - 1) // p
    need = jnp.where(valid, jnp.maximum(want - state.num_pages[sid], 0), 0)
    total = jnp.sum(need)
    ok = (total <= state.num_free) & jnp.all(jnp.where(valid, want <= state.max_pages, True)) & jnp.all(n >= 0)
    first = jnp.cumsum(need) - need  # this request's offset into the pages being popped
    k = jnp.arange(state.max_pages, dtype=jnp.int32)[None, :]
    take = (k < need[:, None]) & ok
    src = jnp.clip(state.num_free - 1 - (first[:, None] + k), 0, state.free_pages.shape[0] - 1)
    pages = state.free_pages[src]
    # Invalid lanes scatter out of bounds and are dropped.
    row = jnp.where(take, sid[:, None], state.page_table.shape[0])
    col = state.num_pages[sid][:, None] + k
    table = state.page_table.at[row, col].set(pages, mode="drop")
    refs = state.ref_counts.at[jnp.where(take, pages, state.ref_counts.shape[0])].add(1, mode="drop")
    grown = jnp.where(valid & ok, state.num_pages[sid] + need, state.num_pages[sid])
    num_pages = state.num_pages.at[jnp.where(valid, sid, state.num_pages.shape[0])].set(grown, mode="drop")
    new = dataclasses.replace(state, num_free=state.num_free - jnp.where(ok, total, 0), ref_counts=refs,
                              page_table=table, num_pages=num_pages)
    return new, ok


def append(state: PageState, seq_ids, new_tokens) -> tuple[PageState, jax.Array]:
    """`reserve`, then grow ``seq_lens`` by `new_tokens` (all or nothing, see `reserve`)."""
    state, ok = reserve(state, seq_ids, new_tokens)
    _, sid, valid, n = _requests(seq_ids, new_tokens)
    lens = state.seq_lens.at[jnp.where(valid & ok, sid, state.seq_lens.shape[0])].add(n, mode="drop")
    return dataclasses.replace(state, seq_lens=lens), ok


def _drop_pages(state: PageState, sid, valid, lo, hi) -> PageState:
    """Columns ``[lo[b], hi[b])`` of sequences ``sid[b]`` (where `valid`) lose one reference each.

    Pages nobody holds any more go back on the free stack, each once (even if
    several of the sequences shared it), in increasing id order.
    """
    n_pages = state.ref_counts.shape[0]
    k = jnp.arange(state.max_pages, dtype=jnp.int32)[None, :]
    held = valid[:, None] & (k >= lo[:, None]) & (k < hi[:, None])
    pages = jnp.where(held, state.page_table[sid], n_pages)  # n_pages: out of bounds, dropped
    refs = state.ref_counts.at[pages].add(-1, mode="drop")
    touched = jnp.zeros((n_pages,), bool).at[pages].set(True, mode="drop")
    freed = touched & (refs == 0)
    slot = state.num_free + jnp.cumsum(freed) - 1
    ids = jnp.arange(n_pages, dtype=jnp.int32)
    free_pages = state.free_pages.at[jnp.where(freed, slot, n_pages)].set(ids, mode="drop")
    return dataclasses.replace(state, free_pages=free_pages, ref_counts=refs,
                               num_free=state.num_free + jnp.sum(freed).astype(jnp.int32))


def release(state: PageState, seq_ids) -> PageState:
    """Ends sequences: their pages lose one reference; pages nobody holds return to the free stack.

    Args:
      seq_ids: ``int32[B]`` sequence slots to empty (unique; -1 ignored).
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    valid = seq_ids >= 0
    sid = jnp.where(valid, seq_ids, 0)
    state = _drop_pages(state, sid, valid, state.first_page[sid], state.num_pages[sid])
    rows = jnp.where(valid, sid, state.page_table.shape[0])
    return dataclasses.replace(
        state, page_table=state.page_table.at[rows].set(0, mode="drop"),
        num_pages=state.num_pages.at[rows].set(0, mode="drop"), seq_lens=state.seq_lens.at[rows].set(0, mode="drop"),
        first_page=state.first_page.at[rows].set(0, mode="drop"))


def release_out_of_window(state: PageState, seq_ids, window: int) -> PageState:
    """Sliding-window layers: releases the pages no future query of the sequences can see.

    The next query sits at position ``seq_len`` and sees keys ``> seq_len - window``;
    every page wholly before that is dropped (one reference). Call it after the
    step's attention (the step's own queries may look further back). The
    block table keeps the stale ids of released columns: the kernels clamp and
    mask out-of-window reads, so those pages may be reused meanwhile.

    Args:
      seq_ids: ``int32[B]`` (unique; -1 ignored); window: W >= 1 (static or traced int).
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    valid = seq_ids >= 0
    sid = jnp.where(valid, seq_ids, 0)
    first = state.first_page[sid]
    needed_from = jnp.maximum(state.seq_lens[sid] - window + 1, 0)  # first position a future query sees
    new_first = jnp.clip(needed_from // state.page_size, first, state.num_pages[sid])
    state = _drop_pages(state, sid, valid, first, new_first)
    rows = jnp.where(valid, sid, state.first_page.shape[0])
    return dataclasses.replace(state, first_page=state.first_page.at[rows].set(new_first, mode="drop"))


def share_prefix(state: PageState, src_seq, dst_seq, num_tokens) -> PageState:
    """Prefix sharing: empty sequence `dst_seq` starts with the first whole pages of `src_seq`.

    Shares ``min(num_tokens, seq_lens[src]) // page_size`` full pages by
    reference (no copy) and sets ``seq_lens[dst]`` to that many tokens; the
    caller appends the rest of the prompt (a partly filled page is never
    shared, so no sequence writes into a page another one reads). Columns
    `src_seq` already released (`release_out_of_window`) are released for
    `dst_seq` too.

    Args:
      src_seq, dst_seq: int32 scalars (distinct; `dst_seq` must be empty, e.g. just released).
      num_tokens: int32 scalar, the shared prompt length.
    """
    src_seq, dst_seq = jnp.int32(src_seq), jnp.int32(dst_seq)
    p = state.page_size
    shared = jnp.minimum(jnp.int32(num_tokens), state.seq_lens[src_seq]) // p
    first = jnp.minimum(state.first_page[src_seq], shared)
    k = jnp.arange(state.max_pages, dtype=jnp.int32)
    pages = jnp.where(k < shared, state.page_table[src_seq], 0)
    take = (k >= first) & (k < shared)
    refs = state.ref_counts.at[jnp.where(take, pages, state.ref_counts.shape[0])].add(1, mode="drop")
    return dataclasses.replace(
        state, ref_counts=refs, page_table=state.page_table.at[dst_seq].set(pages),
        num_pages=state.num_pages.at[dst_seq].set(shared), seq_lens=state.seq_lens.at[dst_seq].set(shared * p),
        first_page=state.first_page.at[dst_seq].set(first))


def step_metadata(state: PageState, seq_ids, new_tokens, *, num_tokens: int) -> StepMetadata:
    """The op metadata of a step whose `new_tokens` were already `append`-ed.

    Args:
      seq_ids: ``int32[B]`` (-1 = padding request); new_tokens: ``int32[B]``:
        request ``b`` owns the next ``new_tokens[b]`` rows, its sequence's last tokens.
      num_tokens: T (static), the bucketed row count, ``>= sum(new_tokens)``;
        rows past the real tokens are padding (slot -1, position 0).

    Returns:
      `StepMetadata` (see there). ``sum(new_tokens)`` must not exceed T (not
      checked on device: pick the bucket on the host, where the counts are
      known; `PageAllocator.step` checks it).
    """
    _, sid, valid, n = _requests(seq_ids, new_tokens)
    p = state.page_size
    table = jnp.where(valid[:, None], state.page_table[sid], 0)
    lens = jnp.where(valid, state.seq_lens[sid], 0)
    qsl = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n, dtype=jnp.int32)])
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    # The request owning each row: the last b with qsl[b] <= row (empty requests are skipped over).
    b = jnp.clip(jnp.searchsorted(qsl, rows, side="right").astype(jnp.int32) - 1, 0, sid.shape[0] - 1)
    real = rows < qsl[-1]
    pos = lens[b] - n[b] + (rows - qsl[b])
    pos = jnp.where(real, pos, 0)
    page = table[b, jnp.clip(pos // p, 0, state.max_pages - 1)]
    slots = jnp.where(real, page * p + pos % p, -1)
    last = jnp.where(n > 0, qsl[1:] - 1, 0)
    return StepMetadata(table, lens, qsl, slots, pos, last)


class PageAllocator:
    """Host-side convenience over `PageState` for simple scripts (one jitted call per method).

    Example::

        alloc = PageAllocator(num_pages=64, max_seqs=4, max_pages_per_seq=16, page_size=16)
        meta = alloc.step([0, 1], [7, 12], num_tokens=32)   # prefill two prompts
        meta = alloc.step([0, 1], [1, 1], num_tokens=8)     # one decode step
        alloc.release([0])
    """

    def __init__(self, *, num_pages: int, max_seqs: int, max_pages_per_seq: int, page_size: int):
        self.state = init_pages(num_pages, max_seqs, max_pages_per_seq, page_size)

    def step(self, seq_ids, new_tokens, *, num_tokens: int) -> StepMetadata:
        """`append` then `step_metadata`; RuntimeError (state unchanged) when pages run out.

        Raises:
          ValueError: mismatched lengths, or more new tokens than ``num_tokens`` rows.
        """
        seq_ids, new_tokens = np.asarray(seq_ids, np.int32), np.asarray(new_tokens, np.int32)
        if seq_ids.shape != new_tokens.shape or seq_ids.ndim != 1:
            raise ValueError(f"new_tokens: expected one count per sequence id {list(seq_ids)}, got {list(new_tokens)}")
        real = int(new_tokens[seq_ids >= 0].sum())
        if real > num_tokens:
            raise ValueError(f"num_tokens: the step has {real} new tokens, more than the {num_tokens} rows")
        state, ok, meta = _step(self.state, seq_ids, new_tokens, num_tokens=int(num_tokens))
        if not bool(ok):
            raise RuntimeError(
                f"PageAllocator: not enough free pages ({int(self.state.num_free)} free) or block-table "
                f"columns for new_tokens {list(np.asarray(new_tokens))} of sequences {list(np.asarray(seq_ids))}")
        self.state = state
        return meta

    def release(self, seq_ids) -> None:
        self.state = _release(self.state, np.asarray(seq_ids, np.int32))

    def share_prefix(self, src_seq: int, dst_seq: int, num_tokens: int) -> None:
        self.state = _share(self.state, src_seq, dst_seq, num_tokens)

    def release_out_of_window(self, seq_ids, window: int) -> None:
        self.state = _release_window(self.state, np.asarray(seq_ids, np.int32), int(window))

    @property
    def num_free(self) -> int:
        return int(self.state.num_free)


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def _step(state, seq_ids, new_tokens, *, num_tokens):
    state, ok = append(state, seq_ids, new_tokens)
    return state, ok, step_metadata(state, seq_ids, new_tokens, num_tokens=num_tokens)


_release = jax.jit(release)
_share = jax.jit(share_prefix)
_release_window = jax.jit(release_out_of_window)
