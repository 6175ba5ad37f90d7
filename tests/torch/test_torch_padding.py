"""Padding rows: query rows past ``query_start_loc[B]`` come back as zeros on every path.

CUDA-graph batches (vLLM full graphs) and bucketed steps pad T past the real
tokens; those rows belong to no sequence, so no attention tile writes them.
Outputs are NaN-poisoned first, so an unwritten row fails. Requests with
q_len 0 and seq_len 0 (vLLM's padded requests) ride along.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tq_torch
from tq_torch_testlib import AttnCase, build, check_against_reference, run_path

CASE = AttnCase("padded_batch", seq_lens=(9, 0, 20), q_lens=(1, 0, 3), num_q_heads=4, num_kv_heads=2,
                head_dim=64, page=4)
PAD = 5


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4", "bf16"])
@pytest.mark.parametrize("path", tq_torch.PATH_NAMES)
def test_padding_rows_are_zero_and_real_rows_unchanged(preset, path):
    built = build(CASE, preset)
    real = built.query.shape[0]
    extra = torch.randn(PAD, *built.query.shape[1:], generator=torch.Generator().manual_seed(1))
    padded = dataclasses.replace(built, query=torch.cat([built.query, extra.to(built.query)]))
    out = run_path(padded, path)
    assert torch.equal(out[real:], torch.zeros_like(out[real:])), "padding rows must be exactly zero"
    check_against_reference(built, out[:real].contiguous())
