"""CUDA-graph capture and replay of a decode batch through the backend (``-m gpu``).

The way vLLM's full graphs use it: metadata built once with
``build_for_cudagraph_capture`` over persistent tensors, an eager warm-up, then
``do_kv_cache_update`` + ``forward`` captured into one graph. Each replay
writes a new batch into the same tensors first (requests advance by a token,
requests join, the batch shrinks to a few real requests and the rest is
padding: q_len 0, seq_len 0, slot -1), exactly as vLLM's runner does. After
each replay the output must match the float64 reference on the cache bytes,
padding rows must be zeros, and an eager ``forward`` on the same metadata must
give the same bits.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import vllm_testlib as L  # noqa: E402

L.import_vllm()

FEATURES = {"plain": {}, "window_cap_sinks": dict(window=256, soft_cap=30.0, sinks=True)}


class _EagerGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph``: replay re-runs the step (same Python, same tensors)."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def _graph_decode(spec: L.LayerSpec, *, cap_b: int, width: int, max_len: int, first: int, batches):
    """Captures one padded decode step of `cap_b` requests, then replays it for each request list in `batches`."""
    on_gpu = torch.cuda.is_available()
    h = L.Harness(spec, num_blocks=cap_b * width + 1)
    rng = np.random.default_rng(0)
    seq = {r: int(x) for r, x in enumerate(rng.integers(1, max_len, first))}

    def batch(reqs):
        """The next decode step of `reqs` (each gains one token), padded to the captured size."""
        for r in reqs:
            if r not in seq:
                seq[r] = int(rng.integers(1, max_len))
            else:
                seq[r] += 1
        lens = [seq[r] for r in reqs]
        h.store_context(lens, [1] * len(reqs), reqs=list(reqs))  # the earlier tokens (rewritten: harmless)
        pad = cap_b - len(reqs)
        return h.common_metadata(lens, [1] * len(reqs), reqs=list(reqs), pad_reqs=pad, pad_tokens=pad,
                                 width=width)

    cam = batch(list(range(first)))
    md = h.builder.build_for_cudagraph_capture(cam)
    d = spec.head_dim
    qkv = torch.zeros(cap_b, (spec.num_q_heads + 2 * spec.num_kv_heads) * d, dtype=spec.dtype, device=h.dev)
    q, k, v = (x.view(cap_b, -1, d) for x in qkv.split([spec.num_q_heads * d, spec.num_kv_heads * d,
                                                        spec.num_kv_heads * d], dim=-1))
    out = torch.empty(cap_b, spec.num_q_heads * d, dtype=spec.dtype, device=h.dev)

    def fill_qkv():
        nq, nk, nv = h.fused_qkv(cap_b)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)

    def step():
        h.impl.do_kv_cache_update(h.layer, k, v, h.kv_cache, cam.slot_mapping)
        h.impl.forward(h.layer, q, k, v, h.kv_cache, md, output=out.view(cap_b, -1, d))

    fill_qkv()
    if on_gpu:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: compiles the kernels and fills tq_torch's parameter caches
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    else:
        step()
        graph = _EagerGraph(step)

    for reqs in batches:
        new = batch(reqs)
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_table_tensor"):
            getattr(cam, name).copy_(getattr(new, name))
        cam.query_start_loc_cpu.copy_(new.query_start_loc_cpu)
        fill_qkv()
        out.fill_(float("nan"))
        graph.replay()
        if on_gpu:
            torch.cuda.synchronize()
        replayed = out.view(cap_b, -1, d).clone()
        h.check(new, q, replayed)
        out.fill_(float("nan"))
        h.impl.forward(h.layer, q, k, v, h.kv_cache, md, output=out.view(cap_b, -1, d))
        if on_gpu:
            torch.cuda.synchronize()
        assert torch.equal(replayed, out.view(cap_b, -1, d)), "graph replay and eager forward differ"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("features", list(FEATURES))
def test_cuda_graph_capture_and_replay_decode(preset, features, monkeypatch):
    monkeypatch.setenv("TQ_VALIDATE", "0")  # host-side validation syncs, which capture forbids
    spec = L.LayerSpec(preset=preset, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                       **FEATURES[features])
    # 16 captured requests, block tables of 128 pages (2048 tokens).
    _graph_decode(spec, cap_b=16, width=128, max_len=1800, first=11,
                  batches=[list(range(11)), list(range(16)), [3, 7, 15], list(range(16))])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-in; the GPU captures a real graph")
def test_graph_replay_flow_cpu(monkeypatch):
    """The same flow on CPU with the graph replaced by re-running the step (no capture on CPU)."""
    monkeypatch.setenv("TQ_VALIDATE", "0")
    spec = L.LayerSpec(preset="turboquant_4bit_nc", window=12, soft_cap=20.0, sinks=True)
    _graph_decode(spec, cap_b=4, width=3, max_len=40, first=3, batches=[[0, 1, 2, 3], [2]])
