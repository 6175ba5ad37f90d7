"""Every argument check raises a clear error that names the argument."""

import numpy as np
import pytest

import tq_spec
from tq_spec import reference

D, P, HKV = 64, 4, 2
PRESET = "turboquant_4bit_nc"
SLOT = tq_spec.layout(PRESET, D).slot_bytes


def good_attention_args():
    rng = np.random.default_rng(0)
    return dict(
        query=rng.standard_normal((3, 4, D)).astype(np.float32),
        kv_cache=rng.integers(0, 255, (5, P, HKV, SLOT), dtype=np.uint8),
        block_table=np.array([[0, 1], [2, 3]], np.int32),
        seq_lens=np.array([5, 2], np.int32),
        query_start_loc=np.array([0, 1, 3], np.int32),
    )


def good_store_args():
    rng = np.random.default_rng(1)
    return dict(
        key=rng.standard_normal((3, HKV, D)).astype(np.float32),
        value=rng.standard_normal((3, HKV, D)).astype(np.float32),
        kv_cache=np.zeros((5, P, HKV, SLOT), np.uint8),
        slot_mapping=np.array([0, -1, 7], np.int64),
    )


def test_good_arguments_pass():
    reference.paged_attention(**good_attention_args(), preset=PRESET)
    reference.store_kv(**good_store_args(), preset=PRESET)


ATTENTION_ERRORS = [
    ("query", lambda a: a["query"].astype(np.int32), TypeError, "query: expected dtype float16 or bfloat16 or float32, got int32"),
    ("query", lambda a: a["query"][0], ValueError, r"query: expected shape \[T, Hq, D\], got \[4, 64\]"),
    ("query", lambda a: np.zeros((3, 3, D), np.float32), ValueError, r"query: num_q_heads \(Hq=3\) must be a positive multiple of num_kv_heads \(Hkv=2"),
    ("query", lambda a: np.zeros((3, 4, 96), np.float32), ValueError, "head_dim: preset 'turboquant_4bit_nc'.*got 96"),
    ("kv_cache", lambda a: a["kv_cache"].astype(np.int8), TypeError, "kv_cache: expected dtype uint8, got int8"),
    ("kv_cache", lambda a: a["kv_cache"][..., :-2], ValueError, r"kv_cache: preset 'turboquant_4bit_nc' at head_dim 64 needs slot_bytes 70"),
    ("block_table", lambda a: a["block_table"].astype(np.int64), TypeError, "block_table: expected dtype int32, got int64"),
    ("block_table", lambda a: np.array([[0, 9], [2, 3]], np.int32), ValueError, r"block_table: entry \[0, 1\] = 9 is outside \[0, 5\)"),
    ("block_table", lambda a: np.array([[0, 1], [-3, 3]], np.int32), ValueError, r"block_table: entry \[1, 0\] = -3 is outside \[0, 5\)"),
    ("seq_lens", lambda a: np.array([9, 2], np.int32), ValueError, "seq_lens: sequence 0 has 9 tokens but block_table holds at most 2 blocks x 4 = 8"),
    ("seq_lens", lambda a: np.array([5, -1], np.int32), ValueError, "seq_lens: expected entries >= 0"),
    ("seq_lens", lambda a: np.array([5], np.int32), ValueError, r"seq_lens: expected shape \[2\]"),
    ("query_start_loc", lambda a: np.array([0, 2, 1], np.int32), ValueError, "query_start_loc: expected non-decreasing entries, got 2 then 1"),
    ("query_start_loc", lambda a: np.array([0, 2, 4], np.int32), ValueError, r"query_start_loc: expected to end at most at T=3 \(the query rows\), got 4"),
    ("query_start_loc", lambda a: np.array([0, 3, 3, 3], np.int32), ValueError, r"query_start_loc: expected shape \[3\]"),
    ("query_start_loc", lambda a: np.array([1, 2, 3], np.int32), ValueError, "query_start_loc: expected to start at 0"),
    ("query_start_loc", lambda a: np.array([0, 0, 3], np.int32), ValueError, "query_start_loc: sequence 1 has q_len 3 > seq_lens"),
]


@pytest.mark.parametrize("arg,mutate,exc,message", ATTENTION_ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(ATTENTION_ERRORS)])
def test_attention_argument_errors(arg, mutate, exc, message):
    args = good_attention_args()
    args[arg] = mutate(args)
    with pytest.raises(exc, match=message):
        reference.paged_attention(**args, preset=PRESET)


def test_unused_block_table_entries_are_not_checked():
    args = good_attention_args()
    args["block_table"] = np.array([[0, 1], [2, -1]], np.int32)  # sequence 1 uses one block only
    reference.paged_attention(**args, preset=PRESET)


def test_padding_rows_past_query_start_loc_are_zero():
    args = good_attention_args()
    full = reference.paged_attention(**args, preset=PRESET)
    args["query"] = np.concatenate([args["query"], np.full((2, 4, D), np.nan, np.float32)])
    padded = reference.paged_attention(**args, preset=PRESET)  # T = 5 > query_start_loc[B] = 3
    np.testing.assert_array_equal(padded[:3], full)
    np.testing.assert_array_equal(padded[3:], 0.0)


def test_validate_flag_and_environment(monkeypatch):
    from tq_spec import validation

    monkeypatch.delenv(validation.VALIDATE_ENV, raising=False)
    assert validation.validate_enabled() is False
    assert validation.validate_enabled(True) is True
    monkeypatch.setenv(validation.VALIDATE_ENV, "1")
    assert validation.validate_enabled() is True and validation.validate_enabled(False) is False
    monkeypatch.setenv(validation.VALIDATE_ENV, "0")
    assert validation.validate_enabled() is False
    with pytest.raises(TypeError, match="validate: expected True, False or None, got 1"):
        validation.validate_enabled(1)


def test_non_monotone_query_start_loc():
    args = good_attention_args()
    args["query_start_loc"] = np.array([0, 3, 3], np.int32)
    reference.paged_attention(**args, preset=PRESET)  # q_len 0 for the second sequence is fine
    args["query_start_loc"] = np.array([0, 4, 3], np.int32)
    with pytest.raises(ValueError, match="query_start_loc: expected non-decreasing entries, got 4 then 3"):
        reference.paged_attention(**args, preset=PRESET)


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(sliding_window=0), ValueError, "sliding_window: expected an int >= 1 or None, got 0"),
    (dict(sliding_window=2.5), TypeError, "sliding_window: expected an int >= 1 or None"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap: expected a value > 0"),
    (dict(scale=float("nan")), TypeError, "scale: expected a finite float"),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, r"sinks: expected shape \[4\]"),
    (dict(sinks=np.zeros(4, np.float16)), TypeError, "sinks: expected dtype float32"),
    (dict(preset="int4"), ValueError, "preset: unknown preset 'int4'"),
])
def test_attention_option_errors(kwargs, exc, message):
    kwargs = {"preset": PRESET, **kwargs}
    with pytest.raises(exc, match=message):
        reference.paged_attention(**good_attention_args(), **kwargs)


STORE_ERRORS = [
    ("key", lambda a: a["key"].astype(np.float64), TypeError, "key: expected dtype float16 or bfloat16 or float32, got float64"),
    ("value", lambda a: a["value"][:2], ValueError, r"value: expected the shape of key \[3, 2, 64\]"),
    ("value", lambda a: a["value"].astype(np.float16), TypeError, r"value: expected the dtype of key \(float32\)"),
    ("kv_cache", lambda a: np.zeros((5, P, 3, SLOT), np.uint8), ValueError, "kv_cache: expected num_kv_heads 2"),
    ("slot_mapping", lambda a: np.array([0, 1], np.int64), ValueError, r"slot_mapping: expected shape \[3\]"),
    ("slot_mapping", lambda a: np.array([0, 1, 2], np.float32), TypeError, "slot_mapping: expected dtype int32 or int64"),
    ("slot_mapping", lambda a: np.array([0, 20, 1], np.int64), ValueError, r"slot_mapping: expected entries in \[-1, 20\)"),
    ("slot_mapping", lambda a: np.array([0, -2, 1], np.int64), ValueError, r"slot_mapping: expected entries in \[-1, 20\).*got -2"),
    ("slot_mapping", lambda a: np.array([4, 1, 4], np.int64), ValueError, "slot_mapping: expected each slot at most once, got slot 4"),
]


@pytest.mark.parametrize("arg,mutate,exc,message", STORE_ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(STORE_ERRORS)])
def test_store_argument_errors(arg, mutate, exc, message):
    args = good_store_args()
    args[arg] = mutate(args)
    with pytest.raises(exc, match=message):
        reference.store_kv(**args, preset=PRESET)


def test_quant_params_errors():
    with pytest.raises(ValueError, match=r"rotation: expected shape \(64, 64\)"):
        tq_spec.quant_params(PRESET, 64, rotation=np.eye(32))
    with pytest.raises(ValueError, match="rotation: preset 'bf16' does not rotate keys"):
        tq_spec.quant_params("bf16", 64, rotation=np.eye(64))
    with pytest.raises(ValueError, match="codebook: preset 'turboquant_4bit_nc' at head_dim 64 needs a 4-bit"):
        tq_spec.quant_params(PRESET, 64, codebook=tq_spec.codebook(64, 3))


def test_dispatch_table():
    from tq_spec import dispatch

    decode = dispatch.DispatchProblem(4, 4, 8, 2, 128, 16, PRESET)
    prefill = dispatch.DispatchProblem(40, 4, 8, 2, 128, 16, PRESET)
    assert dispatch.select_path(decode) == "decode"
    assert dispatch.select_path(prefill) == "extend"
    # Without the query dtype and block-table width, the dequant workspace cannot be sized.
    assert dispatch.eligible_paths(prefill) == ("decode", "extend")
    full = dispatch.DispatchProblem(40, 4, 8, 2, 128, 16, PRESET, query_dtype="bfloat16", max_blocks=4)
    assert dispatch.eligible_paths(full) == dispatch.PATH_NAMES
    assert dispatch.select_path(full) == "extend"  # 10 rows per sequence: below the dequant threshold
    huge = dispatch.DispatchProblem(4096, 4, 8, 2, 128, 16, PRESET, query_dtype="bfloat16", max_blocks=1 << 16)
    assert dispatch.select_path(huge) == "extend"
    with pytest.raises(NotImplementedError, match="path 'dequant' cannot run this problem: the workspace would take"):
        dispatch.select_path(huge, "dequant")
    fp32 = dispatch.DispatchProblem(4096, 4, 8, 2, 128, 16, PRESET, query_dtype="float32", max_blocks=8)
    with pytest.raises(NotImplementedError, match="query must be bfloat16 or float16"):
        dispatch.select_path(fp32, "dequant")
    assert dispatch.select_path(prefill, "decode") == "decode"
    with pytest.raises(ValueError, match="path: expected 'auto' or one of"):
        dispatch.select_path(decode, "flash")
    with pytest.raises(TypeError, match="path: expected a str .* got int"):
        dispatch.select_path(decode, 1)
