"""Bad input to tq_torch raises ValueError/TypeError naming the argument, before any launch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tq_spec
import tq_torch
from tq_torch_testlib import device

D = 64
PRESET = "turboquant_4bit_nc"


def _store_args(**over):
    lay = tq_spec.layout(over.pop("preset_for_layout", PRESET), over.pop("d_for_layout", D))
    args = dict(
        key=torch.randn(3, 2, D), value=torch.randn(3, 2, D),
        kv_cache=torch.zeros(2, 4, 2, lay.slot_bytes, dtype=torch.uint8),
        slot_mapping=torch.tensor([0, 1, -1]),
    )
    args.update(over)
    return {k: v.to(device()) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _attn_args(**over):
    lay = tq_spec.layout(PRESET, D)
    args = dict(
        query=torch.randn(2, 4, D, dtype=torch.bfloat16),
        kv_cache=torch.zeros(4, 4, 2, lay.slot_bytes, dtype=torch.uint8),
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        seq_lens=torch.tensor([3, 5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
    )
    args.update(over)
    return {k: v.to(device()) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _store(preset=PRESET, **kw):
    a = _store_args(**kw.pop("args", {}))
    return tq_torch.store_kv(a["key"], a["value"], a["kv_cache"], a["slot_mapping"], preset=preset, **kw)


def _attend(preset=PRESET, **kw):
    a = _attn_args(**kw.pop("args", {}))
    return tq_torch.paged_attention(a["query"], a["kv_cache"], a["block_table"], a["seq_lens"],
                                    a["query_start_loc"], preset=preset, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(preset="turboquant_2bit"), ValueError, "preset"),
    (dict(args=dict(key=torch.randn(3, 2, D, dtype=torch.float64))), TypeError, "key"),
    (dict(args=dict(value=torch.randn(3, 2, D, dtype=torch.float16))), TypeError, "value"),
    (dict(args=dict(value=torch.randn(3, 1, D))), ValueError, "value"),
    (dict(args=dict(key=torch.randn(3, 2, 48), value=torch.randn(3, 2, 48))), ValueError, "head_dim"),
    (dict(args=dict(kv_cache=torch.zeros(2, 4, 2, 70, dtype=torch.int8))), TypeError, "kv_cache"),
    (dict(args=dict(kv_cache=torch.zeros(2, 4, 2, 72, dtype=torch.uint8))), ValueError, "kv_cache"),
    (dict(args=dict(kv_cache=torch.zeros(2, 4, 3, 70, dtype=torch.uint8))), ValueError, "kv_cache"),
    (dict(args=dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0]))), TypeError, "slot_mapping"),
    (dict(args=dict(slot_mapping=torch.tensor([0, 1]))), ValueError, "slot_mapping"),
    (dict(args=dict(key=np.zeros((3, 2, D), np.float32))), TypeError, "key"),
    (dict(rotation=np.eye(32, dtype=np.float32)), ValueError, "rotation"),
    (dict(rotation=torch.eye(32)), ValueError, "rotation"),
    (dict(codebook=tq_spec.codebook(D, 3)), ValueError, "codebook"),
    (dict(codebook="vllm"), TypeError, "codebook"),
    (dict(preset="bf16", args=dict(kv_cache=torch.zeros(2, 4, 2, 256, dtype=torch.uint8)),
          rotation=np.eye(D, dtype=np.float32)), ValueError, "rotation"),
])
def test_store_rejects(kw, exc, match):
    with pytest.raises(exc, match=match):
        _store(**kw)


def test_store_rejects_odd_cache_strides():
    lay = tq_spec.layout(PRESET, D)
    big = torch.zeros(2, 4, 2, lay.slot_bytes + 1, dtype=torch.uint8, device=device())
    with pytest.raises(ValueError, match="kv_cache"):
        _store(args=dict(kv_cache=big[..., 1:]))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(args=dict(query=torch.randn(2, 4, D, dtype=torch.float64))), TypeError, "query"),
    (dict(args=dict(query=torch.randn(2, 3, D, dtype=torch.bfloat16))), ValueError, "Hq"),
    (dict(args=dict(query=torch.randn(2, 4, 32, dtype=torch.bfloat16))), ValueError, "head_dim"),
    (dict(args=dict(block_table=torch.zeros(2, 2, dtype=torch.int64))), TypeError, "block_table"),
    (dict(args=dict(seq_lens=torch.tensor([3], dtype=torch.int32))), ValueError, "seq_lens"),
    (dict(args=dict(query_start_loc=torch.tensor([0, 2], dtype=torch.int32))), ValueError, "query_start_loc"),
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(sliding_window=2.5), TypeError, "sliding_window"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(scale=float("nan")), TypeError, "scale"),
    (dict(sinks=torch.zeros(3, device=device())), ValueError, "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.float16, device=device())), TypeError, "sinks"),
    (dict(sinks=np.zeros(4, np.float32)), TypeError, "sinks"),
    (dict(path="prefill"), ValueError, "path"),
    (dict(out=torch.empty(2, 4, D, device=device())), ValueError, "out"),
    (dict(out=torch.empty(2, 4, 2 * D, dtype=torch.bfloat16, device=device())[..., ::2]), ValueError, "stride"),
    (dict(rotation=np.ones((D, D), dtype=np.int32)), TypeError, "rotation"),
    (dict(preset="nope"), ValueError, "preset"),
])
def test_attention_rejects(kw, exc, match):
    with pytest.raises(exc, match=match):
        _attend(**kw)


def test_attention_remembered_call_still_checks_what_varies():
    """An eager call whose static facts passed before skips those checks (host time); it gives the
    same output and still checks `out` and, with validate=True, the metadata values."""
    a = _attn_args()
    first = _attend(args=a)
    again = _attend(args=a)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    with pytest.raises(ValueError, match="out"):
        _attend(args=a, out=torch.empty(2, 4, D, device=device()))
    with pytest.raises(ValueError, match="seq_lens"):
        _attend(args=dict(a, seq_lens=torch.tensor([3, 99], dtype=torch.int32, device=device())), validate=True)


def test_attention_remembered_calls_keep_their_own_arguments():
    """Each remembered signature keeps its own resolved scale, window, soft cap and path: calls that
    alternate between signatures over the same data each match the reference (first and repeated calls)."""
    from tq_torch_testlib import AttnCase, build, check_against_reference

    base = AttnCase("remembered_decode", seq_lens=(9, 14), q_lens=(1, 1), presets=(PRESET,))
    variants = [base, dataclasses.replace(base, scale=0.3), dataclasses.replace(base, window=3),
                dataclasses.replace(base, soft_cap=5.0), dataclasses.replace(base, sinks=True)]
    built = [build(case, PRESET, seed=7, dev=device()) for case in variants]
    for _ in range(2):
        for b in built:
            check_against_reference(b, tq_torch.paged_attention(*b.args(), **b.kwargs()))


def test_store_remembered_call_still_checks_what_varies():
    """A store whose static facts passed before skips those checks (host time); it writes the same
    bytes, and a cache, slot mapping or device that differs is still checked."""
    a = _store_args()
    first = _store(args=dict(a, kv_cache=a["kv_cache"].clone())).clone()
    again = _store(args=dict(a, kv_cache=a["kv_cache"].clone()))
    assert torch.equal(again, first)
    lay = tq_spec.layout(PRESET, D)
    big = torch.zeros(2, 4, 2, lay.slot_bytes + 1, dtype=torch.uint8, device=device())
    with pytest.raises(ValueError, match="kv_cache"):
        _store(args=dict(a, kv_cache=big[..., 1:]))
    with pytest.raises(TypeError, match="slot_mapping"):
        _store(args=dict(a, slot_mapping=a["slot_mapping"].float()))
    with pytest.raises(ValueError, match="slot_mapping"):
        _store(args=dict(a, slot_mapping=torch.tensor([0, 1, 99], device=device())), validate=True)
