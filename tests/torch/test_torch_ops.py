"""The torch.library registration: schemas, fake impls, torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import tq_spec
import tq_torch
from tq_torch_testlib import device

PRESET, D, P, HKV, HQ = "turboquant_4bit_nc", 64, 4, 2, 4


def _problem():
    gen = torch.Generator().manual_seed(0)
    lay = tq_spec.layout(PRESET, D)
    dev = device()
    return dict(
        key=torch.randn(6, HKV, D, generator=gen).to(dev),
        value=torch.randn(6, HKV, D, generator=gen).to(dev),
        cache=torch.zeros(4, P, HKV, lay.slot_bytes, dtype=torch.uint8, device=dev),
        slots=torch.tensor([0, 1, 2, 4, 5, 6], device=dev),
        query=torch.randn(3, HQ, D, generator=gen).to(dev),
        block_table=torch.tensor([[0, 3], [1, 2]], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([3, 7], dtype=torch.int32, device=dev),
        qsl=torch.tensor([0, 1, 3], dtype=torch.int32, device=dev),
    )


def _step(key, value, cache, slots, query, block_table, seq_lens, qsl):
    tq_torch.store_kv(key, value, cache, slots, preset=PRESET)
    return tq_torch.paged_attention(query, cache, block_table, seq_lens, qsl, preset=PRESET,
                                    sliding_window=5, logits_soft_cap=20.0)


def test_ops_are_registered():
    assert hasattr(torch.ops.tq_torch, "store_kv")
    assert hasattr(torch.ops.tq_torch, "paged_attention")


def test_opcheck_store_kv():
    p = _problem()
    opcheck(torch.ops.tq_torch.store_kv.default,
            (p["key"], p["value"], p["cache"], p["slots"], PRESET, None, None))


@pytest.mark.parametrize("path", ["decode", "extend"])
def test_opcheck_paged_attention(path):
    p = _problem()
    tq_torch.store_kv(p["key"], p["value"], p["cache"], p["slots"], preset=PRESET)
    out = torch.empty_like(p["query"])
    opcheck(torch.ops.tq_torch.paged_attention.default,
            (p["query"], p["cache"], p["block_table"], p["seq_lens"], p["qsl"], out, None, None, None,
             PRESET, 0.125, 3, 0.0, path, 0))


def compile_and_compare(backend: str) -> None:
    """store + attention under torch.compile(fullgraph=True) equals eager, bit for bit."""
    p = _problem()
    args = [p[k] for k in ("key", "value", "cache", "slots", "query", "block_table", "seq_lens", "qsl")]
    eager_cache = p["cache"].clone()
    eager = _step(*args[:2], eager_cache, *args[3:])
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend=backend)
    got = compiled(*args)
    assert torch.equal(p["cache"], eager_cache), "compiled store must write the same bytes"
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_compile_fullgraph_matches_eager():
    # Inductor needs a C++ toolchain on CPU; aot_eager still traces the whole
    # graph with Dynamo and functionalises both mutating ops. GPU: inductor
    # (test_torch_gpu.py).
    compile_and_compare("aot_eager")
