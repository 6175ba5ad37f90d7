"""Device helpers of `tq_torch._src.kernel_math` on their own (CPU interpreter or GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import tq_spec
from tq_torch._src import config
from tq_torch._src.kernel_math import (biased_code_operand, biased_nibble_operand, fp8_e4m3fn_encode,
                                      table_lookup, table_lookup_with_squares)

from tq_torch_testlib import device

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _biased_codes_kernel(codes_ptr, out_ptr, bias_ptr, N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         INTERPRET: tl.constexpr):
    i = tl.arange(0, N)
    x, bias = biased_code_operand(tl.load(codes_ptr + i), DOT_DTYPE, INTERPRET)
    tl.store(out_ptr + i, x.to(tl.float32))
    tl.store(bias_ptr + i, tl.full([N], bias, tl.float32))


@pytest.mark.parametrize("dtype", list(_DTYPES), ids=str)
def test_biased_code_operand_is_code_plus_bias(dtype):
    # Every code a uniform value field can hold (3 or 4 bits), in a shuffled order; the
    # operand must hold code + bias exactly, in the dot dtype the kernels use for `dtype`.
    dev = device()
    codes = torch.randperm(128, device=dev).to(torch.int32)
    out = torch.full((128,), float("nan"), device=dev)
    bias = torch.full((128,), float("nan"), device=dev)
    _biased_codes_kernel[(1,)](codes, out, bias, N=128, DOT_DTYPE=_DTYPES[dtype],
                               INTERPRET=config.interpreted(dev))
    expected_bias = {torch.bfloat16: 128.0, torch.float16: 1024.0, torch.float32: 0.0}[dtype]
    assert torch.all(bias == expected_bias)
    assert torch.equal(out, codes.to(torch.float32) + expected_bias)
    # representable exactly in the operand dtype, so the dot multiplies the exact value
    assert torch.equal(out.to(dtype).to(torch.float32), out)


@triton.jit
def _table_lookup_kernel(table_ptr, index_ptr, out_ptr, sq_ptr, square_scale, SIZE: tl.constexpr,
                         BN: tl.constexpr, D: tl.constexpr, DOT_DTYPE: tl.constexpr, SQUARES: tl.constexpr,
                         INTERPRET: tl.constexpr):
    offs = tl.arange(0, BN)[:, None] * D + tl.arange(0, D)[None, :]
    index = tl.load(index_ptr + offs)
    if SQUARES:
        k, sq = table_lookup_with_squares(table_ptr, index, square_scale, SIZE, DOT_DTYPE, INTERPRET)
        tl.store(out_ptr + offs, k.to(tl.float32))
        tl.store(sq_ptr + offs, sq.to(tl.float32))
    else:
        tl.store(out_ptr + offs, table_lookup(table_ptr, index, SIZE, INTERPRET))


def _lookup_inputs(size, dev, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(size, generator=g).to(dev)
    codes = torch.randint(0, size, (64, 128), generator=g, dtype=torch.int32)
    index = codes
    if not config.interpreted(dev):
        # On the GPU only the code's bits are read (`kv_tiles.decode_field(CLEAN=False)` leaves
        # the neighbouring codes' bits above them): garbage up there must not matter.
        index = codes + size * torch.randint(0, 1 << 20, codes.shape, generator=g, dtype=torch.int32)
    return table, codes.to(dev), index.to(dev)


@pytest.mark.parametrize("size", [8, 16])
def test_table_lookup_is_an_exact_gather(size):
    dev = device()
    table, codes, index = _lookup_inputs(size, dev, seed=size)
    out = torch.full(codes.shape, float("nan"), device=dev)
    _table_lookup_kernel[(1,)](table, index, out, out, 1.0, SIZE=size, BN=64, D=128, DOT_DTYPE=tl.float32,
                               SQUARES=False, INTERPRET=config.interpreted(dev), num_warps=4)
    assert torch.equal(out, table[codes.long()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("size", [8, 16])
def test_table_lookup_with_squares_rounds_like_the_fp32_path(size, dtype):
    # The operand must be the dot dtype's rounding of the gathered fp32 entry, and the square
    # the fp16 rounding of (scale * c)**2 taken in fp32: what the kernels computed before the
    # packed lookup (bit for bit), for a scale that moves the squares far from 1.
    dev = device()
    table, codes, index = _lookup_inputs(size, dev, seed=100 + size)
    table = table * 2.0**-9
    scale = 2.0**8
    out = torch.full(codes.shape, float("nan"), device=dev)
    sq = torch.full(codes.shape, float("nan"), device=dev)
    _table_lookup_kernel[(1,)](table, index, out, sq, scale, SIZE=size, BN=64, D=128, DOT_DTYPE=_DTYPES[dtype],
                               SQUARES=True, INTERPRET=config.interpreted(dev), num_warps=4)
    c = table[codes.long()]
    assert torch.equal(out, c.to(dtype).to(torch.float32))
    cs = c * scale
    assert torch.equal(sq, (cs * cs).to(torch.float16).to(torch.float32))


@triton.jit
def _nibble_kernel(words_ptr, out_ptr, bias_ptr, BN: tl.constexpr, W: tl.constexpr, DOT_DTYPE: tl.constexpr):
    words = tl.load(words_ptr + tl.arange(0, BN)[:, None] * W + tl.arange(0, W)[None, :])
    x, bias = biased_nibble_operand(words, DOT_DTYPE)
    tl.store(out_ptr + tl.arange(0, BN)[:, None] * (4 * W) + tl.arange(0, 4 * W)[None, :], x.to(tl.float32))
    tl.store(bias_ptr + tl.arange(0, BN), tl.full([BN], bias, tl.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_biased_nibble_operand_unpacks_words_in_element_order(dtype):
    # GPU only (inline PTX): element 4 i + j of a row is nibble j of word i, plus the bias.
    dev = device()
    g = torch.Generator().manual_seed(7)
    words = torch.randint(-(1 << 15), 1 << 15, (64, 32), generator=g, dtype=torch.int32).to(torch.int16)
    out = torch.full((64, 128), float("nan"), device=dev)
    bias = torch.full((64,), float("nan"), device=dev)
    _nibble_kernel[(1,)](words.to(dev), out, bias, BN=64, W=32, DOT_DTYPE=_DTYPES[dtype], num_warps=4)
    u = words.to(torch.int32) & 0xFFFF
    codes = torch.stack([(u >> (4 * j)) & 15 for j in range(4)], dim=-1).reshape(64, 128)
    expected_bias = {torch.bfloat16: 128.0, torch.float16: 1024.0}[dtype]
    assert torch.all(bias == expected_bias)
    assert torch.equal(out.cpu(), codes.to(torch.float32) + expected_bias)


@triton.jit
def _fp8_encode_kernel(x_ptr, out_ptr, HARDWARE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8_e4m3fn_encode(tl.load(x_ptr + i), HARDWARE))


@pytest.mark.parametrize("hardware", [False, True], ids=["integer", "cast"])
def test_fp8_encode_matches_spec_on_every_fp16_and_random_fp32(hardware, fp8_encode_inputs):
    """Both encodes (the GPU store takes the cast) give the reference's bits on
    `fp8_encode_inputs` (every float16, wide random float32, subnormals, the edges)."""
    dev = device()
    if hardware and config.interpreted(dev):
        pytest.skip("the fp8 cast is the GPU's convert instruction: needs a GPU "
                    "(the interpreter runs the integer encode)")
    x = fp8_encode_inputs
    rng = np.random.default_rng(1)
    x = np.concatenate([x, rng.standard_normal(-x.size % 1024).astype(np.float32)])
    out = torch.full((x.size,), 0xAB, dtype=torch.uint8, device=dev)  # canary: every byte is written
    _fp8_encode_kernel[(x.size // 1024,)](torch.from_numpy(x).to(dev), out, HARDWARE=hardware, BLOCK=1024)
    np.testing.assert_array_equal(out.cpu().numpy(), tq_spec.fp8_e4m3fn_encode(x))
