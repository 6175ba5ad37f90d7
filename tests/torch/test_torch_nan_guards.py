"""NaN semantics and the always-on metadata guards of tq_torch.paged_attention, every path.

* NaN in a visible query row propagates to that row's output only; a NaN sink
  makes its head's rows NaN where the reference does (DESIGN.md section 3).
  Before the fix both came back finite: the epilogues tested ``l > 0``.
* Metadata values outside the rules never move a load outside the cache or a
  store outside the output (docs/format.md section 8): a block id outside
  ``[0, N)`` masks its keys, ``seq_lens`` is clamped to what the block table
  can address and ``query_start_loc`` to ``[0, T]``. Rows of well-formed
  sequences are bitwise unchanged by a neighbour's bad metadata.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tq_spec
import tq_torch
from tq_torch._src.api import _paged_attention
from tq_torch_testlib import GARBAGE_UNUSED, AttnCase, build, check_against_reference


CASE = AttnCase("nan_guards", seq_lens=(9, 5, 6), q_lens=(3, 1, 1), num_q_heads=4, num_kv_heads=2,
                head_dim=64, page=4, soft_cap=30.0, sinks=True, window=7)
PATHS = tq_torch.PATH_NAMES


def run_path(built, path, out=None):
    """One path into a NaN-poisoned output, with validation off (the guards are what is tested)."""
    out = torch.full_like(built.query, float("nan")) if out is None else out
    _paged_attention(*built.args(), **built.kwargs(), rotation=None, codebook=None, path=path, out=out,
                     num_splits=0, validate=False)
    return out


def _reference(built, query=None, sinks=None):
    kw = built.kwargs()
    if sinks is not None:
        kw["sinks"] = sinks
    q = built.query if query is None else query
    return tq_spec.reference.paged_attention(
        q.float().cpu().numpy(), built.kv_cache.cpu().numpy(), built.block_table.cpu().numpy(),
        built.seq_lens.cpu().numpy(), built.query_start_loc.cpu().numpy(),
        **{k: (v.cpu().numpy() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
        rotation=built.extras["rotation"], codebook=built.extras["codebook"])


def _check_nan_pattern(got, ref, clean):
    """NaN exactly where the reference has NaN; every other element bitwise as in the clean run."""
    got = got.float().cpu().numpy()
    clean = clean.float().cpu().numpy()
    assert np.isnan(ref).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(got[~np.isnan(ref)], clean[~np.isnan(ref)])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_nan_query_row_propagates(path, preset):
    built = build(CASE, preset)
    clean = run_path(built, path)
    check_against_reference(built, clean)
    query = built.query.clone()
    rows = [(1, 2), (3, 0)]  # a prefill row of sequence 0, the decode row of sequence 1
    for i, (t, h) in enumerate(rows):
        query[t, h, i] = float("nan")
    ref = _reference(built, query)
    assert all(np.isnan(ref[t, h]).all() for t, h in rows)
    _check_nan_pattern(run_path(dataclasses.replace(built, query=query), path), ref, clean)


@pytest.mark.parametrize("path", PATHS)
def test_nan_sink_propagates(path):
    built = build(CASE, "turboquant_4bit_nc")
    clean = run_path(built, path)
    sinks = built.sinks.clone()
    sinks[1] = float("nan")
    ref = _reference(built, sinks=sinks)
    _check_nan_pattern(run_path(dataclasses.replace(built, sinks=sinks), path), ref, clean)


def _rows_of(built, seq):
    qsl = built.query_start_loc.cpu()
    return slice(int(qsl[seq]), int(qsl[seq + 1]))


def _garbage_block_zero(built):
    """`built` with a block of 0xFF bytes (NaN scale, zero and norm bits) put in front as block 0.

    Keys without a block id may read block 0 (`attention_kernel.any_page`, the hand-pipelined
    tiles the interpreter runs): what they read must still reach no row.
    """
    cache = built.kv_cache
    garbage = torch.full_like(cache[:1], GARBAGE_UNUSED)
    table = built.block_table
    table = torch.where((table >= 0) & (table < cache.shape[0]), table + 1, table)
    return dataclasses.replace(built, kv_cache=torch.cat([garbage, cache]), block_table=table)


def test_garbage_block_zero_keeps_the_outputs():
    """The helper moves every page, not the data a query sees."""
    built = build(CASE, "turboquant_4bit_nc")
    for path in PATHS:
        assert torch.equal(run_path(_garbage_block_zero(built), path), run_path(built, path))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad_id", [-5, 2**31 - 1, 10**6])
def test_block_ids_out_of_range_mask_their_keys(path, bad_id):
    """Sequence 1's pages all name a block outside the cache: its rows see no key (sinks only), and
    the other sequences' rows are bitwise unchanged (block 0 holds NaN-decoding bytes)."""
    built = _garbage_block_zero(build(CASE, "turboquant_4bit_nc"))
    clean = run_path(built, path)
    table = built.block_table.clone()
    table[1] = bad_id
    out = run_path(dataclasses.replace(built, block_table=table), path)
    for seq in (0, 2):
        assert torch.equal(out[_rows_of(built, seq)], clean[_rows_of(built, seq)])
    # No visible key: the softmax is over the sink alone, so the output is exactly zero.
    assert torch.equal(out[_rows_of(built, 1)], torch.zeros_like(out[_rows_of(built, 1)]))


# Long enough for whole key tiles every row sees (the loop without visibility checks).
LONG_CASE = AttnCase("long", seq_lens=(40, 37, 45), q_lens=(1, 1, 2), num_q_heads=4, num_kv_heads=2,
                     head_dim=64, page=4)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", [CASE, LONG_CASE], ids=str)
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_one_bad_block_id_masks_only_that_page(path, case, preset):
    """One page id out of range in the middle of a sequence: its rows change but stay finite (the
    reference has no way to express a masked page), the other sequences are unchanged (block 0
    holds NaN-decoding bytes)."""
    built = _garbage_block_zero(build(case, preset))
    clean = run_path(built, path)
    table = built.block_table.clone()
    table[0, 1] = 10**6  # positions 4..7 of sequence 0
    out = run_path(dataclasses.replace(built, block_table=table), path)
    assert torch.isfinite(out).all()
    assert not torch.equal(out[_rows_of(built, 0)], clean[_rows_of(built, 0)])
    for seq in (1, 2):
        assert torch.equal(out[_rows_of(built, seq)], clean[_rows_of(built, seq)])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seq_len", [10**6, 2**31 - 1, -7])
def test_seq_lens_out_of_range_are_clamped(path, seq_len):
    """seq_lens beyond the block table (would read past its row) or negative: clamped, no crash,
    neighbours unchanged."""
    built = build(CASE, "turboquant_4bit_nc")
    clean = run_path(built, path)
    seq_lens = built.seq_lens.clone()
    seq_lens[1] = seq_len
    out = run_path(dataclasses.replace(built, seq_lens=seq_lens), path)
    for seq in (0, 2):
        assert torch.equal(out[_rows_of(built, seq)], clean[_rows_of(built, seq)])
    # (Sequence 1's row itself is garbage in, garbage out: a clamped length of 12 makes the row
    # see never-written slots of its last page, which hold NaN-decoding bytes.)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qsl", [[0, 6, 5, 5], [0, 3, 4, 10**6], [-4, 3, 4, 5], [0, 3, 2**31 - 1, 5]])
def test_query_start_loc_out_of_rule_stays_in_bounds(path, qsl):
    """Decreasing, negative or past-T query_start_loc: no crash, no write outside `out` (a canary
    region around it stays intact), and the rows of sequences left well-formed are unchanged."""
    built = build(CASE, "turboquant_4bit_nc")
    clean = run_path(built, path)
    t = built.query.shape[0]
    bad = dataclasses.replace(built, query_start_loc=torch.tensor(qsl, dtype=torch.int32,
                                                                   device=built.query.device))
    canary = torch.full((t + 8,) + built.query.shape[1:], 7.0, dtype=built.query.dtype, device=built.query.device)
    out = canary[4:4 + t]
    run_path(bad, path, out=out)
    assert torch.equal(canary[:4], torch.full_like(canary[:4], 7.0))
    assert torch.equal(canary[4 + t:], torch.full_like(canary[4 + t:], 7.0))
    if qsl[:2] == [0, 3]:  # sequence 0 untouched by the bad entries after it
        assert torch.equal(out[0:3], clean[0:3])


# Bad query_start_loc -> the layout the kernels give it (each row one owner; `_find_sequence`).
LAID_OUT_QSL = [([0, 3, 1, 5], [0, 3, 3, 5]), ([0, 2**31 - 1, -2**31, 5], [0, 5, 5, 5]),
                ([0, 4, 2, 5], [0, 4, 4, 5])]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qsl,laid_out", LAID_OUT_QSL)
def test_decreasing_query_start_loc_gives_each_row_one_owner(path, qsl, laid_out):
    """A decreasing query_start_loc must not give two sequences the same row (on a GPU that is a
    write race: parity's errors op saw outputs change between identical calls). Sequence lengths
    are ``max(qsl[b+1] - qsl[b], 0)``, laid out from ``qsl[0]``: the output equals the one for that
    valid layout. (The interpreter runs programs in order, so before the fix the later sequence's
    rows overwrote the earlier one's here.)"""
    built = build(CASE, "turboquant_4bit_nc")
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=built.query.device)
    expected = run_path(dataclasses.replace(built, query_start_loc=as_tensor(laid_out)), path)
    got = run_path(dataclasses.replace(built, query_start_loc=as_tensor(qsl)), path)
    assert not torch.isnan(expected).any()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("path", PATHS)
def test_q_len_beyond_seq_len_sees_nothing(path):
    """q_len 3 over seq_len 1: rows at negative positions see no key (zeros with no sinks)."""
    case = dataclasses.replace(CASE, sinks=False, window=None)
    built = build(case, "turboquant_4bit_nc")
    clean = run_path(built, path)
    seq_lens = built.seq_lens.clone()
    seq_lens[0] = 1
    out = run_path(dataclasses.replace(built, seq_lens=seq_lens), path)
    assert torch.equal(out[0:2], torch.zeros_like(out[0:2]))  # positions -2, -1
    assert torch.isfinite(out[2]).all()
    for seq in (1, 2):
        assert torch.equal(out[_rows_of(built, seq)], clean[_rows_of(built, seq)])
