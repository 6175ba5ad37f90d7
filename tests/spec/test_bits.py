import numpy as np
import pytest

import tq_spec


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("n", [1, 3, 7, 8, 13, 64, 127])
def test_pack_unpack_round_trip(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 1 << bits, size=(5, n)).astype(np.uint8)
    packed = tq_spec.pack_bits(codes, bits)
    assert packed.shape == (5, -(-n * bits // 8)) and packed.dtype == np.uint8
    np.testing.assert_array_equal(tq_spec.unpack_bits(packed, bits, n), codes)


def _bit_stream_by_hand(codes, bits):
    stream = []
    for c in codes:
        stream += [(int(c) >> i) & 1 for i in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return np.array([sum(b << i for i, b in enumerate(stream[j:j + 8])) for j in range(0, len(stream), 8)],
                    np.uint8)


@pytest.mark.parametrize("bits", range(2, 9))
def test_lsb_first_stream(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=11).astype(np.uint8)
    np.testing.assert_array_equal(tq_spec.pack_bits(codes, bits), _bit_stream_by_hand(codes, bits))


def test_known_patterns():
    # 4-bit: the low nibble holds the even element.
    np.testing.assert_array_equal(tq_spec.pack_bits(np.array([0x1, 0xA], np.uint8), 4), [0xA1])
    # 3-bit: 8 codes in 3 bytes; codes 0..7 give bits 000 100 010 110 001 101 011 111 (LSB first).
    np.testing.assert_array_equal(tq_spec.pack_bits(np.arange(8, dtype=np.uint8), 3), [0x88, 0xC6, 0xFA])


def test_bad_codes_and_bits():
    with pytest.raises(ValueError, match=r"codes: expected values in \[0, 8\)"):
        tq_spec.pack_bits(np.array([8], np.uint8), 3)
    with pytest.raises(ValueError, match="bits: expected an int in"):
        tq_spec.pack_bits(np.array([1], np.uint8), 9)
    with pytest.raises(ValueError, match="packed: 10 codes of 4 bits need 5 bytes, got 4"):
        tq_spec.unpack_bits(np.zeros(4, np.uint8), 4, 10)
