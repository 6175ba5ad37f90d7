"""Device helpers of `tq_torch._src.kernel_math` on their own (CPU interpreter or GPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tq_torch._src import config
from tq_torch._src.kernel_math import biased_code_operand

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
