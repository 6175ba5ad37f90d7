import ml_dtypes
import numpy as np
import pytest

import tq_spec


def _ml_fp8(x):
    # ml_dtypes turns overflow into NaN; the format saturates, so clamp first (DESIGN.md section 7).
    with np.errstate(invalid="ignore"):
        return np.clip(np.asarray(x, np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def test_fp8_encode_every_fp16_pattern():
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    got = tq_spec.fp8_e4m3fn_encode(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], _ml_fp8(x[~nan]))
    assert np.all(got[nan] & 0x7F == 0x7F)


def test_fp8_encode_random_fp32():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-12, 8, 200_000))).astype(np.float32)
    np.testing.assert_array_equal(tq_spec.fp8_e4m3fn_encode(x), _ml_fp8(x))


def test_fp8_carry_saturation_and_specials():
    got = tq_spec.fp8_e4m3fn_decode(tq_spec.fp8_e4m3fn_encode(
        np.array([1.9747, 1000.0, -1000.0, np.inf, 464.0, 0.0, -0.0, 2.0**-10], np.float32)))
    np.testing.assert_array_equal(got[:5], [2.0, 448.0, -448.0, 448.0, 448.0])
    assert got[5] == 0 and not np.signbit(got[5]) and np.signbit(got[6])
    assert got[7] == 0  # below half the smallest subnormal (2**-9) rounds to zero
    assert np.isnan(tq_spec.fp8_e4m3fn_decode(tq_spec.fp8_e4m3fn_encode(np.array([np.nan])))).all()


def test_fp8_decode_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = tq_spec.fp8_e4m3fn_decode(codes)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


def test_bf16_and_fp16_fields():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * 100).astype(np.float32)
    np.testing.assert_array_equal(tq_spec.round_to_bf16(x), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    b = tq_spec.bf16_bytes(x)
    assert b.shape == (100_000, 2)
    np.testing.assert_array_equal(b.reshape(-1).view("<u2"), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(tq_spec.bf16_from_bytes(b), tq_spec.round_to_bf16(x))
    h = tq_spec.fp16_bytes(x)
    np.testing.assert_array_equal(h.reshape(-1).view("<f2"), x.astype(np.float16))
    np.testing.assert_array_equal(tq_spec.fp16_from_bytes(h), x.astype(np.float16).astype(np.float32))
