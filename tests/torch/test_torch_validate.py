"""``validate=`` / ``TQ_VALIDATE``: full metadata validation with the reference's errors, off by default."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tq_spec
import tq_torch
from tq_spec import reference
from tq_torch_testlib import AttnCase, build, device

PRESET = "turboquant_4bit_nc"
CASE = AttnCase("validate", seq_lens=(5, 7), q_lens=(1, 2), num_q_heads=4, num_kv_heads=2, head_dim=64, page=4,
                presets=(PRESET,))

BAD_METADATA = [  # (argument, new value, message shared with tq_spec.reference)
    ("seq_lens", [5, -1], "seq_lens: expected entries >= 0"),
    ("seq_lens", [5, 9], "seq_lens: sequence 1 has 9 tokens but block_table holds at most"),
    ("query_start_loc", [1, 2, 3], "query_start_loc: expected to start at 0"),
    ("query_start_loc", [0, 3, 1], "query_start_loc: expected non-decreasing entries"),
    ("query_start_loc", [0, 1, 4], r"query_start_loc: expected to end at most at T=3"),
    ("seq_lens", [5, 1], r"query_start_loc: sequence 1 has q_len 2 > seq_lens\[1\] = 1"),
]


def _with(built, name, values):
    args = dict(query=built.query, kv_cache=built.kv_cache, block_table=built.block_table,
                seq_lens=built.seq_lens, query_start_loc=built.query_start_loc)
    args[name] = torch.tensor(values, dtype=torch.int32, device=built.kv_cache.device)
    return args


@pytest.mark.parametrize("name,values,message", BAD_METADATA, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_METADATA)])
def test_validate_raises_the_reference_error(name, values, message):
    built = build(CASE, PRESET)
    args = _with(built, name, values)
    with pytest.raises(ValueError, match=message):
        reference.paged_attention(**{k: v.cpu().float().numpy() if v.is_floating_point() else v.cpu().numpy()
                                     for k, v in args.items()}, preset=PRESET)
    with pytest.raises(ValueError, match=message):
        tq_torch.paged_attention(**args, preset=PRESET, validate=True)


def test_environment_switch_and_default(monkeypatch):
    built = build(CASE, PRESET)
    # Harmless to run unvalidated: a negative length simply has no visible key.
    args = _with(built, "seq_lens", [5, -1])
    monkeypatch.delenv("TQ_VALIDATE", raising=False)
    tq_torch.paged_attention(**args, preset=PRESET)  # off by default: no sync, no error
    monkeypatch.setenv("TQ_VALIDATE", "1")
    with pytest.raises(ValueError, match="seq_lens: expected entries >= 0"):
        tq_torch.paged_attention(**args, preset=PRESET)
    tq_torch.paged_attention(**args, preset=PRESET, validate=False)  # the keyword wins


def test_store_validate_names_duplicate_and_out_of_range_slots():
    lay = tq_spec.layout(PRESET, 64)
    dev = device()
    cache = torch.zeros(2, 4, 2, lay.slot_bytes, dtype=torch.uint8, device=dev)
    kv = torch.randn(3, 2, 64, device=dev)
    with pytest.raises(ValueError, match="slot_mapping: expected each slot at most once, got slot 1"):
        tq_torch.store_kv(kv, kv, cache, torch.tensor([1, 1, -1], device=dev), preset=PRESET, validate=True)
    with pytest.raises(ValueError, match=r"slot_mapping: expected entries in \[-1, 8\)"):
        tq_torch.store_kv(kv, kv, cache, torch.tensor([0, 8, -1], device=dev), preset=PRESET, validate=True)
    tq_torch.store_kv(kv, kv, cache, torch.tensor([0, 1, -1], device=dev), preset=PRESET, validate=True)
    np.testing.assert_array_equal(cache[1].cpu().numpy(), 0)  # slots 0 and 1 live in block 0
