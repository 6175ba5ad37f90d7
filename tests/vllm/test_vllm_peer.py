"""vLLM 0.33's own TurboQuant kernels as the peer: same bytes, same answers, caches interchangeable.

For each preset, the same keys/values go into two layer caches of one vLLM
allocation: layer 0 through vLLM's store kernel, layer 1 through our backend's
``do_kv_cache_update``. Then, for one decode step:

* our ``forward`` on vLLM's bytes and on ours matches the float64 reference on
  those bytes (the project's tolerance), so we read vLLM's cache correctly;
* vLLM's decode kernel on our bytes and on its own agrees with ours on the
  same bytes (within the sum of both outputs' error bounds, i.e. twice ours),
  so vLLM reads our cache correctly;
* the two stores agree byte for byte on at least 99% of the written slot
  bytes (vLLM's value rounding uses Triton's approximate division on GPU,
  DESIGN.md section 8), and ours matches the reference.

CPU: small sizes in the Triton interpreter (vLLM's kernels included). GPU
(``-m gpu``): realistic sizes on the device, vLLM's default 32 KV splits.
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

from parity.tolerances import check_attention, compare_store  # noqa: E402

HAS_GPU = torch.cuda.is_available()


def _interchange(spec: L.LayerSpec, seq_lens: list[int], *, num_blocks: int, num_kv_splits: int, seed: int = 0):
    h = L.Harness(spec, num_blocks=num_blocks, seed=seed)
    peer = L.VllmPeer(spec.preset, spec.head_dim, h.dev)
    b = len(seq_lens)
    # Every token of every request, as earlier steps would have stored them.
    slots = []
    for r, s in enumerate(seq_lens):
        slots += h.slots(r, list(range(s)))
    sm = torch.tensor(slots, dtype=torch.int64, device=h.dev)
    _, k, v = h.fused_qkv(len(slots))
    vllm_before, ours_before = h.tq_cache(0).clone(), h.tq_cache(1).clone()
    peer.store(k, v, h.tq_cache(0), sm)
    h.impl.do_kv_cache_update(h.layer, k, v, h.views[1], sm)
    ours_store = compare_store(h.tq_cache(1), k, v, ours_before, sm, preset=spec.preset)
    assert ours_store.ok, ours_store.describe()
    vllm_store = compare_store(h.tq_cache(0), k, v, vllm_before, sm, preset=spec.preset)
    written = torch.zeros(num_blocks * spec.block_size, dtype=torch.bool, device=h.dev)
    written[sm] = True
    written = written.view(num_blocks, spec.block_size)
    same = (h.tq_cache(0)[written] == h.tq_cache(1)[written]).float().mean().item()
    # The Triton interpreter's fp32 -> fp8 cast loses the carry when rounding overflows the
    # mantissa (DESIGN.md section 8): vLLM's fp8 key bytes can only be judged on a GPU.
    interpreter_fp8 = h.dev.type == "cpu" and peer.cfg.key_fp8
    if not interpreter_fp8:
        assert same >= 0.99, f"vLLM's and our store agree on only {same:.4%} of slot bytes; {vllm_store.describe()}"

    # One decode step (query = each request's last token), metadata from vLLM's classes.
    cam = h.common_metadata(seq_lens, [1] * b)
    md = h.builder.build(0, cam)
    q, _, _ = h.fused_qkv(b)
    scale = spec.layer_scale
    report = [f"store agreement {same:.4%}; vLLM's store vs reference: {vllm_store.describe()}"]
    for layer, whose in ((0, "vLLM's"), (1, "our")):
        out = torch.full((b, spec.num_q_heads, spec.head_dim), float("nan"), dtype=spec.dtype, device=h.dev)
        h.impl.forward(h.layer, q, None, None, h.views[layer], md, output=out)
        ours = check_attention(out, q, h.tq_cache(layer), cam.block_table_tensor, cam.seq_lens,
                               cam.query_start_loc, preset=spec.preset, scale=scale)
        assert ours.ok, f"our decode on {whose} cache: {ours.describe()}"
        theirs_out = peer.decode(q, h.tq_cache(layer), cam.block_table_tensor, cam.seq_lens, scale, num_kv_splits)
        theirs = check_attention(theirs_out, q, h.tq_cache(layer), cam.block_table_tensor, cam.seq_lens,
                                 cam.query_start_loc, preset=spec.preset, scale=scale)
        diff = (out.float() - theirs_out.float()).abs().max().item()
        report.append(f"{whose} cache: ours {ours.describe()}; vLLM's decode {theirs.describe()}; "
                      f"|ours - vLLM's| max {diff:.3e}")
        assert np.isfinite(diff) and diff <= 2 * ours.bound, "\n".join(report)
    print("\n".join(report))


@pytest.mark.skipif(HAS_GPU, reason="CPU sizes (the Triton interpreter); the GPU variant is test_peer_gpu")
@pytest.mark.parametrize("preset", L.TQ_PRESETS)
def test_peer_cpu(preset):
    _interchange(L.LayerSpec(preset=preset), [13, 1, 18], num_blocks=6, num_kv_splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", L.TQ_PRESETS)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_peer_gpu(preset, head_dim):
    rng = np.random.default_rng(head_dim)
    seq = [int(x) for x in rng.integers(1, 2000, 12)] + [1, 16, 17, 4096]
    spec = L.LayerSpec(preset=preset, num_q_heads=32, num_kv_heads=8, head_dim=head_dim, block_size=16)
    _interchange(spec, seq, num_blocks=sum(-(-s // 16) for s in seq) + 8, num_kv_splits=32)
