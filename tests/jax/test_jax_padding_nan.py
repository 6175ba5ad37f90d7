"""Padding rows and NaN semantics of tq_jax.paged_attention (DESIGN.md section 3), every path.

* Rows past ``query_start_loc[B]`` (T bucketed for compiled sizes or CUDA
  graphs) are padding: exactly zeros, even when their query rows are NaN and
  the kernels write into NaN-poisoned buffers. Requests with q_len 0 and
  seq_len 0 (padded batch entries) are valid. Before the fix these rows came
  back as NaN.
* NaN in a visible query row propagates to that row's output only (it came
  back as zeros before); a NaN sink makes its head's rows NaN; a NaN key or
  value in a visible slot makes the rows that see it NaN: all as the float64
  reference does. Garbage in slots no query may see never leaks (the
  garbage-filled caches of `tqjax_cases` check that on every case).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec
from tqjax_cases import attend, attention_failure, build_attention_case, skip_if_ineligible

PATHS = tq_spec.dispatch.PATH_NAMES


def _case(seed, *, preset="turboquant_4bit_nc", seq_lens=(9, 0, 5, 4, 6, 0), q_lens=(3, 0, 1, 0, 6, 0), **kw):
    """A mixed batch (continuation, decode, prefill) with q_len-0/seq_len-0 padding requests and an
    unscheduled sequence (q_len 0, seq_len 4)."""
    return build_attention_case(np.random.default_rng(seed), preset=preset, head_dim=64, num_q_heads=4,
                                num_kv_heads=2, block_size=4, seq_lens=list(seq_lens), q_lens=list(q_lens),
                                **kw)


def _with_padding_rows(case, extra):
    """`case` with `extra` NaN query rows appended past query_start_loc[B]."""
    pad = np.full((extra,) + case.query.shape[1:], np.nan, case.query.dtype)
    return dataclasses.replace(case, query=np.concatenate([case.query, pad]))


def _check_padded(case, padded, out):
    out = np.asarray(out)
    t = case.query.shape[0]
    assert out.shape == padded.query.shape and out.dtype == case.query.dtype
    assert np.all(out[t:] == 0), "padding rows must be exactly zero"
    failure = attention_failure(case, out[:t])
    assert failure is None, failure


def check_padding_rows(case, path, extra):
    """`extra` NaN padding rows after `case`'s rows: zeros, poisoned kernels and public API alike."""
    padded = _with_padding_rows(case, extra)
    _check_padded(case, padded, attend(padded, path))  # NaN-poisoned kernel outputs
    out = tq_jax.paged_attention(*padded.jax_args(), preset=padded.preset, path=path, **padded.jax_kwargs())
    _check_padded(case, padded, out)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
def test_padding_rows_are_zeros(path, q_dtype):
    case = _case(1, q_dtype=q_dtype, sliding_window=4, sinks=True)
    skip_if_ineligible(case, path)
    check_padding_rows(case, path, 5)


@pytest.mark.parametrize("path", PATHS)
def test_padding_only_batch(path):
    """Every request padding (q_len 0, seq_len 0): the whole output is zeros."""
    case = _case(2, preset="fp16", seq_lens=[0, 0], q_lens=[0, 0])
    skip_if_ineligible(case, path)
    padded = _with_padding_rows(case, 3)
    out = tq_jax.paged_attention(*padded.jax_args(), preset="fp16", path=path)
    assert out.shape == (3, 4, 64) and np.all(np.asarray(out) == 0)


def test_padding_under_jit_with_a_fixed_bucket():
    """Bucketed T: one compilation serves different real token counts; padding stays zero."""
    traces = []

    @jax.jit
    def step(q, cache, bt, sl, qsl):
        traces.append(1)
        return tq_jax.paged_attention(q, cache, bt, sl, qsl, preset="turboquant_4bit_nc")

    for seed, (seq_lens, q_lens) in enumerate((([9, 5], [3, 1]), ([10, 6], [1, 1]))):
        case = _case(10 + seed, seq_lens=seq_lens, q_lens=q_lens)
        padded = _with_padding_rows(case, 8 - case.query.shape[0])
        _check_padded(case, padded, step(*padded.jax_args()))
    assert len(traces) == 1


def _reference(case, query, **kwargs):
    kw = dict(case.kwargs, **kwargs)
    return tq_spec.reference.paged_attention(query, case.kv_cache, case.block_table, case.seq_lens,
                                             case.query_start_loc, preset=case.preset, rotation=case.rotation, **kw)


def _run(case, path, query=None, sinks=None):
    args = list(case.jax_args())
    if query is not None:
        args[0] = jnp.asarray(query)
    kw = case.jax_kwargs()
    if sinks is not None:
        kw["sinks"] = jnp.asarray(sinks)
    return np.asarray(tq_jax.paged_attention(*args, preset=case.preset, path=path, **kw)).astype(np.float32)


def _check_nan_pattern(case, path, got, ref, clean):
    """NaN exactly where the reference has NaN; every other element as in the clean run."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(ref).any()
    np.testing.assert_array_equal(got[~np.isnan(ref)], clean[~np.isnan(ref)])


def check_nan_query(case, path, rows):
    """NaN in one lane of each query row ``(t, h)`` of `rows`: those output rows NaN, the rest unchanged."""
    clean = _run(case, path)
    assert attention_failure(case, clean.astype(case.query.dtype)) is None
    query = case.query.copy()
    for i, (t, h) in enumerate(rows):
        query[t, h, i % query.shape[2]] = np.nan
    ref = _reference(case, query)
    assert all(np.isnan(ref[t, h]).all() for t, h in rows)
    _check_nan_pattern(case, path, _run(case, path, query=query), ref, clean)


def check_nan_sink(case, path, head):
    """A NaN sink for `head`: as the reference (NaN rows where the head sees a key, zeros elsewhere)."""
    clean = _run(case, path)
    sinks = case.kwargs["sinks"].copy()
    sinks[head] = np.nan
    ref = _reference(case, case.query, sinks=sinks)
    _check_nan_pattern(case, path, _run(case, path, sinks=sinks), ref, clean)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("preset,q_dtype", [("turboquant_4bit_nc", "bfloat16"), ("turboquant_k8v4", "float32")])
def test_nan_query_row_propagates(path, preset, q_dtype):
    case = _case(3, preset=preset, q_dtype=q_dtype, logits_soft_cap=30.0)
    skip_if_ineligible(case, path)
    check_nan_query(case, path, [(1, 2), (3, 0)])  # a prefill row of sequence 0, the decode row of sequence 2


@pytest.mark.parametrize("path", PATHS)
def test_nan_sink_propagates(path):
    case = _case(4, sinks=True, sliding_window=3)
    skip_if_ineligible(case, path)
    check_nan_sink(case, path, head=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field", ["key", "value"])
def test_nan_in_a_visible_slot_propagates(path, field):
    """A NaN key or value in a slot a decode row sees (fp16 preset: stored as NaN bits)."""
    case = _case(5, preset="fp16", seq_lens=[9, 5, 6], q_lens=[1, 1, 1], q_dtype="float16")
    clean = _run(case, path)
    lay = tq_spec.layout("fp16", 64)
    slot = case.block_table[1, 1] * 4 + 0  # sequence 1, position 4
    offset = lay.key_offset if field == "key" else lay.value_offset
    cache = case.kv_cache.copy()
    nan16 = np.tile(np.array([0x00, 0x7E], np.uint8), 64)  # fp16 quiet NaN (little-endian) x D
    cache[slot // 4, slot % 4, 0, offset:offset + 128] = nan16
    case = dataclasses.replace(case, kv_cache=cache, _reference=None)
    ref = _reference(case, case.query)
    assert np.isnan(ref[1, :2]).all() and not np.isnan(ref[[0, 2]]).any()
    _check_nan_pattern(case, path, _run(case, path), ref, clean)


# ---------------------------------------------------------------- metadata guards
# Always on, as in tq_torch: no value of block_table, seq_lens or query_start_loc
# moves a load outside the cache or a store outside the output. A block id
# outside [0, N) masks its keys, seq_lens is clamped to what the block table can
# address, query_start_loc to [0, T]. Rows of well-formed sequences are bitwise
# unchanged by a neighbour's bad metadata.

_GUARD_PATHS = ("decode", "extend")


def _guard_case(preset="turboquant_4bit_nc"):
    return _case(6, preset=preset, seq_lens=(9, 5, 6), q_lens=(3, 1, 1), sinks=True, sliding_window=7,
                 logits_soft_cap=30.0)


def _run_raw(case, path, **replace):
    """The jitted op with validation off (the guards are what is tested), NaN-poisoned outputs."""
    return np.asarray(attend(dataclasses.replace(case, **replace), path)).astype(np.float32)


def _rows(case, seq):
    return slice(int(case.query_start_loc[seq]), int(case.query_start_loc[seq + 1]))


def _garbage_block_zero(case):
    """`case` with a block of 0xFF bytes (NaN scale, zero and norm bits) put in front as block 0.

    Keys without a block id may read block 0 (`kv_tiles.attend_key_range`'s ``any_page``): what
    they read must still reach no row.
    """
    cache, table = case.kv_cache, case.block_table
    table = np.where((table >= 0) & (table < cache.shape[0]), table + 1, table).astype(table.dtype)
    return dataclasses.replace(case, kv_cache=np.concatenate([np.full_like(cache[:1], 0xFF), cache]),
                               block_table=table)


def _long_case(preset):
    """Long enough for whole key tiles every row sees (tq_torch's loop without visibility checks)."""
    return _case(7, preset=preset, seq_lens=(40, 37, 45), q_lens=(1, 1, 2))


def test_garbage_block_zero_keeps_the_outputs():
    """The helper moves every page, not the data a query sees."""
    case = _guard_case()
    for path in _GUARD_PATHS:
        np.testing.assert_array_equal(_run_raw(_garbage_block_zero(case), path), _run_raw(case, path))


@pytest.mark.parametrize("path", _GUARD_PATHS)
@pytest.mark.parametrize("bad_id", [-5, 2**31 - 1, 10**6])
def test_block_ids_out_of_range_mask_their_keys(path, bad_id):
    case = _garbage_block_zero(_guard_case())
    clean = _run_raw(case, path)
    table = case.block_table.copy()
    table[1] = bad_id
    out = _run_raw(case, path, block_table=table)
    for seq in (0, 2):
        np.testing.assert_array_equal(out[_rows(case, seq)], clean[_rows(case, seq)])
    assert np.all(out[_rows(case, 1)] == 0)  # no visible key: the softmax is over the sink alone


@pytest.mark.parametrize("path", _GUARD_PATHS)
@pytest.mark.parametrize("which", ["guard", "long"])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_one_bad_block_id_masks_only_that_page(path, which, preset):
    case = _garbage_block_zero(_guard_case(preset) if which == "guard" else _long_case(preset))
    clean = _run_raw(case, path)
    table = case.block_table.copy()
    table[0, 1] = 10**6  # positions 4..7 of sequence 0
    out = _run_raw(case, path, block_table=table)
    assert np.isfinite(out).all()
    assert not np.array_equal(out[_rows(case, 0)], clean[_rows(case, 0)])
    for seq in (1, 2):
        np.testing.assert_array_equal(out[_rows(case, seq)], clean[_rows(case, seq)])


@pytest.mark.parametrize("path", _GUARD_PATHS)
@pytest.mark.parametrize("seq_len", [10**6, 2**31 - 1, -7])
def test_seq_lens_out_of_range_are_clamped(path, seq_len):
    case = _guard_case()
    clean = _run_raw(case, path)
    seq_lens = case.seq_lens.copy()
    seq_lens[1] = seq_len
    out = _run_raw(case, path, seq_lens=seq_lens)
    for seq in (0, 2):
        np.testing.assert_array_equal(out[_rows(case, seq)], clean[_rows(case, seq)])


@pytest.mark.parametrize("path", _GUARD_PATHS)
@pytest.mark.parametrize("qsl", [[0, 6, 5, 5], [0, 3, 4, 10**6], [0, 3, 2**31 - 1, 5]])
def test_query_start_loc_out_of_rule_stays_in_bounds(path, qsl):
    case = _guard_case()
    clean = _run_raw(case, path)
    out = _run_raw(case, path, query_start_loc=np.asarray(qsl, np.int32))
    assert out.shape == clean.shape
    if qsl[:2] == [0, 3]:  # sequence 0 untouched by the bad entries after it
        np.testing.assert_array_equal(out[0:3], clean[0:3])


# Bad query_start_loc -> the layout the kernels give it (each row one owner; `_find_sequence`).
LAID_OUT_QSL = [([0, 3, 1, 5], [0, 3, 3, 5]), ([0, 2**31 - 1, -2**31, 5], [0, 5, 5, 5]),
                ([0, 4, 2, 5], [0, 4, 4, 5])]


@pytest.mark.parametrize("path", _GUARD_PATHS)
@pytest.mark.parametrize("qsl,laid_out", LAID_OUT_QSL)
def test_decreasing_query_start_loc_gives_each_row_one_owner(path, qsl, laid_out):
    """tq_torch's twin: sequence lengths ``max(qsl[b+1] - qsl[b], 0)`` laid out from ``qsl[0]``,
    so no row has two writers (a GPU write race otherwise); the output equals the valid layout's."""
    case = _guard_case()
    expected = _run_raw(case, path, query_start_loc=np.asarray(laid_out, np.int32))
    got = _run_raw(case, path, query_start_loc=np.asarray(qsl, np.int32))
    assert not np.isnan(expected).any()
    np.testing.assert_array_equal(got, expected)
