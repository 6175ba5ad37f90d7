"""Case builders shared by the tq_torch tests (CPU interpreter and GPU).

A case is a varlen batch over a paged cache built the way a serving engine
would leave it: a shuffled block table, every sequence's tokens stored with
`tq_torch.store_kv`, and everything else garbage that must never reach an
output:

* unused pages and the tail of each sequence's last page hold 0xFF bytes
  (NaN for fp8 / fp16 / bf16 fields and for fp16 norms, scales and zeros);
* slots that no query of the batch can see (before every query's window, or
  the whole context of a q_len = 0 sequence) are overwritten with 0x7F bytes
  (NaN fp16 fields, huge bf16 values) after the store;
* block-table columns past a sequence's last page hold an out-of-range block id.

Attention is then checked against the float64 reference evaluated on the very
same cache bytes (`parity.tolerances.check_attention`), so these tests isolate
attention from quantisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import tq_spec
import tq_torch
from parity.tolerances import check_attention
from tq_spec import dispatch
from tq_torch._src.api import _paged_attention

GARBAGE_UNUSED = 0xFF
GARBAGE_INVISIBLE = 0x7F
BAD_BLOCK_ID = 2**31 - 1


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def supports(preset: str, head_dim: int) -> bool:
    try:
        tq_spec.layout(preset, head_dim)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AttnCase:
    """One varlen attention problem (sizes only; data is drawn per test)."""

    name: str
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page: int = 4
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    dtype: torch.dtype = torch.bfloat16
    scale: float | None = None
    presets: tuple[str, ...] = tq_spec.PRESET_NAMES
    extra_blocks: int = 3
    far_end: bool = False  # place the used pages at the end of a big cache

    def __str__(self) -> str:
        return self.name

    def preset_params(self):
        """(case, preset) pairs for every preset of this case that supports its head_dim."""
        return [(self, p) for p in self.presets if supports(p, self.head_dim)]


@dataclass
class Built:
    case: AttnCase
    preset: str
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    sinks: torch.Tensor | None
    extras: dict = field(default_factory=dict)

    def args(self):
        return (self.query, self.kv_cache, self.block_table, self.seq_lens, self.query_start_loc)

    def kwargs(self):
        c = self.case
        return dict(preset=self.preset, scale=c.scale, sliding_window=c.window,
                    logits_soft_cap=c.soft_cap, sinks=self.sinks)


def build(case: AttnCase, preset: str, *, seed: int = 0, dev: torch.device | None = None,
          num_blocks: int | None = None, rotation=None, codebook=None) -> Built:
    """Draws data for `case` and fills a garbage-laden cache through `tq_torch.store_kv`."""
    dev = dev or device()
    gen = torch.Generator().manual_seed(seed)
    lay = tq_spec.layout(preset, case.head_dim)
    b = len(case.seq_lens)
    p = case.page
    pages = [-(-s // p) for s in case.seq_lens]
    max_blocks = max(pages + [1])
    used = sum(pages)
    n = num_blocks or (used + case.extra_blocks)
    cache = torch.full((n, p, case.num_kv_heads, lay.slot_bytes), GARBAGE_UNUSED, dtype=torch.uint8,
                       device=dev)
    # Shuffled page ids (at the far end of the cache when asked).
    if n < used + case.extra_blocks:
        raise ValueError(f"num_blocks: {n} is too small for {used} used pages + {case.extra_blocks} spare")
    pool = torch.randperm(used + case.extra_blocks, generator=gen)[:used]
    if case.far_end:
        pool = n - 1 - pool
    table = torch.full((b, max_blocks), BAD_BLOCK_ID, dtype=torch.int32)
    slots_all, keys_all, values_all = [], [], []
    at = 0
    for i, s in enumerate(case.seq_lens):
        table[i, :pages[i]] = pool[at:at + pages[i]].to(torch.int32)
        at += pages[i]
        pos = torch.arange(s)
        slots_all.append(table[i, pos // p].long() * p + pos % p)
        # Scale and offset vary per token so value ranges and key norms differ.
        keys_all.append(torch.randn(s, case.num_kv_heads, case.head_dim, generator=gen)
                        * (0.5 + torch.rand(s, case.num_kv_heads, 1, generator=gen) * 3))
        values_all.append(torch.randn(s, case.num_kv_heads, case.head_dim, generator=gen)
                          + torch.randn(s, case.num_kv_heads, 1, generator=gen))
    slots = torch.cat(slots_all) if slots_all else torch.zeros(0, dtype=torch.long)
    if slots.numel():
        tq_torch.store_kv(torch.cat(keys_all).to(dev, case.dtype), torch.cat(values_all).to(dev, case.dtype),
                          cache, slots.to(dev), preset=preset, rotation=rotation, codebook=codebook)
    # Poison every slot no query can see.
    for i, s in enumerate(case.seq_lens):
        q_len = case.q_lens[i]
        first = s - q_len
        if q_len == 0:
            hidden = torch.arange(s)
        elif case.window is not None:
            hidden = torch.arange(max(0, first - case.window + 1))
        else:
            continue
        if hidden.numel():
            blk = table[i, hidden // p].long().to(dev)
            cache[blk, (hidden % p).to(dev)] = GARBAGE_INVISIBLE
    qsl = torch.tensor([0] + list(np.cumsum(case.q_lens)), dtype=torch.int32)
    t = int(qsl[-1])
    query = torch.randn(t, case.num_q_heads, case.head_dim, generator=gen).to(dev, case.dtype)
    sinks = (torch.randn(case.num_q_heads, generator=gen) * 2).to(dev) if case.sinks else None
    return Built(case, preset, query, cache, table.to(dev), torch.tensor(case.seq_lens, dtype=torch.int32).to(dev),
                 qsl.to(dev), sinks, dict(rotation=rotation, codebook=codebook))


def eligible_paths(built: Built) -> tuple[str, ...]:
    problem = dispatch.problem_for(built.query, built.kv_cache, built.block_table, preset=built.preset,
                                   sliding_window=built.case.window)
    return dispatch.eligible_paths(problem)


def run_path(built: Built, path: str, *, num_splits: int = 0) -> torch.Tensor:
    """Runs one path into a NaN-poisoned output and returns it."""
    out = torch.full_like(built.query, float("nan"))
    got = _paged_attention(*built.args(), **built.kwargs(), rotation=built.extras["rotation"],
                           codebook=built.extras["codebook"], path=path, out=out, num_splits=num_splits)
    assert got is out
    return out


def compact_for_reference(built: Built):
    """(cache, block_table) holding only the pages the batch names, same bytes.

    Lets the numpy reference run on a small copy of a huge (e.g. > 2 GiB) cache.
    """
    table = built.block_table.cpu().long()
    pages = -(-built.seq_lens.cpu().long() // built.case.page)
    cols = torch.arange(table.shape[1])[None, :]
    used_mask = cols < pages[:, None]
    used_ids = torch.unique(table[used_mask])
    remap = {int(b): i for i, b in enumerate(used_ids)}
    compact_table = torch.zeros_like(table)
    for (r, c) in used_mask.nonzero().tolist():
        compact_table[r, c] = remap[int(table[r, c])]
    cache = built.kv_cache[used_ids.to(built.kv_cache.device)].cpu()
    return cache, compact_table.to(torch.int32)


def check_against_reference(built: Built, out: torch.Tensor, *, compact: bool = False, reference_out=None):
    """Asserts every element written, finite, and within the parity tolerance; returns the reference."""
    assert not torch.isnan(out).any(), "some output elements were not written (NaN poison survived) or are NaN"
    if compact:
        cache, table = compact_for_reference(built)
    else:
        cache, table = built.kv_cache, built.block_table
    cmp = check_attention(out, built.query, cache, table, built.seq_lens, built.query_start_loc,
                          **built.kwargs(), rotation=built.extras["rotation"],
                          codebook=built.extras["codebook"], reference_out=reference_out)
    assert cmp.ok, f"{built.case.name} / {built.preset}: {cmp.describe()}"
    return cmp
