"""GPU sweep of tq_torch (``pytest -m gpu``): the CPU test bodies at realistic sizes,
plus a > 2 GiB cache, CUDA-graph capture/replay of decode and torch.compile with inductor.

Sizes follow issue 3: seq_lens 1, 5, 9, 15, 16, 17, 25, 33, page +- 1 and 4k+;
q_len 1, 8 (seq 9, page 16), 127/128/129 and whole prefills; GQA 14/2 (D=64),
32/8, 8/1, 64/4, 28/4; windows 1, 8, < page, = seq_len, > seq_len, across many
pages; soft cap 30 and 50; sinks; every preset; pages 1, 16, 48, 128.
"""

from __future__ import annotations

import pytest
import torch

import tq_spec
import tq_torch
from parity.tolerances import compare_store
from tq_torch_testlib import AttnCase, build, check_against_reference, eligible_paths, run_path

pytestmark = pytest.mark.gpu

ALL = tq_spec.PRESET_NAMES
PLAIN = ("turboquant_k8v4", "bf16", "fp16")

GPU_CASES = (
    AttnCase("decode_lengths_gqa32_8_page16", seq_lens=(1, 5, 9, 15, 16, 17, 25, 33, 4100),
             q_lens=(1,) * 9, num_q_heads=32, num_kv_heads=8, head_dim=128, page=16),
    AttnCase("prefill_mixed_gqa28_4_page48", seq_lens=(9, 129, 300, 128, 4200, 47, 49),
             q_lens=(8, 129, 127, 128, 1, 47, 1), num_q_heads=28, num_kv_heads=4, head_dim=128, page=48),
    AttnCase("gqa14_2_d64_page1", seq_lens=(33, 700), q_lens=(1, 33), num_q_heads=14, num_kv_heads=2,
             head_dim=64, page=1),
    AttnCase("gqa8_1_d256_page128_window8", seq_lens=(1000, 17, 300), q_lens=(1, 17, 64), num_q_heads=8,
             num_kv_heads=1, head_dim=256, page=128, window=8),
    AttnCase("gqa64_4_softcap30_sinks_q8_seq9", seq_lens=(2048, 50, 9), q_lens=(1, 50, 8), num_q_heads=64,
             num_kv_heads=4, head_dim=128, page=16, soft_cap=30.0, sinks=True,
             presets=("turboquant_4bit_nc", "turboquant_k8v4", "bf16")),
    *(AttnCase(f"window{w}_{tag}", seq_lens=(300, 3000, 40), q_lens=(20, 1, 40), num_q_heads=16,
               num_kv_heads=4, head_dim=128, page=16, window=w, presets=("turboquant_k3v4_nc", "fp16"))
      for w, tag in ((1, "one"), (10, "lt_page"), (300, "eq_seq"), (5000, "gt_seq"), (700, "many_pages"))),
    AttnCase("softcap50_fp16_query", seq_lens=(500, 77), q_lens=(1, 77), num_q_heads=32, num_kv_heads=8,
             head_dim=128, page=16, soft_cap=50.0, dtype=torch.float16,
             presets=("turboquant_3bit_nc", "turboquant_k8v4")),
    AttnCase("fp32_query", seq_lens=(257, 64), q_lens=(1, 64), num_q_heads=8, num_kv_heads=2, head_dim=128,
             page=16, dtype=torch.float32, presets=("turboquant_4bit_nc", "bf16")),
    AttnCase("d512_gqa4", seq_lens=(600, 40), q_lens=(1, 40), num_q_heads=8, num_kv_heads=2, head_dim=512,
             page=16, presets=("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                               "turboquant_k8v4")),
    AttnCase("d96_gqa3_page48", seq_lens=(100, 333), q_lens=(1, 100), num_q_heads=12, num_kv_heads=4,
             head_dim=96, page=48, presets=PLAIN),
)

PARAMS = [cp for case in GPU_CASES for cp in case.preset_params()]


@pytest.mark.parametrize("case,preset", PARAMS, ids=[f"{c.name}-{p}" for c, p in PARAMS])
def test_gpu_every_path_matches_reference(case, preset):
    built = build(case, preset, dev=torch.device("cuda"))
    for path in eligible_paths(built):
        check_against_reference(built, run_path(built, path))


@pytest.mark.parametrize("preset", ALL)
def test_gpu_store_matches_reference_exactly(preset):
    # On the GPU both sides use IEEE fp32 and exact encodes: fp16/fp8/bf16
    # fields must match the reference bit for bit.
    gen = torch.Generator().manual_seed(11)
    dims = (64, 128, 256, 512) if tq_spec.get_preset(preset).key_format == "mse" else (40, 96, 128, 256)
    for d in dims:
        for dtype in (torch.bfloat16, torch.float32):
            t, hkv, n, p = 300, 8, 40, 16
            lay = tq_spec.layout(preset, d)
            cache = torch.randint(0, 256, (n, p, hkv, lay.slot_bytes), dtype=torch.uint8, generator=gen)
            key = (torch.randn(t, hkv, d, generator=gen) * 5).to(dtype)
            value = (torch.randn(t, hkv, d, generator=gen) + 0.5).to(dtype)
            slots = torch.randperm(n * p, generator=gen)[:t]
            slots[::17] = -1
            dev_cache = cache.cuda()
            tq_torch.store_kv(key.cuda(), value.cuda(), dev_cache, slots.cuda(), preset=preset)
            cmp = compare_store(dev_cache, key, value, cache, slots, preset=preset, field_ulps=0)
            assert cmp.ok, f"D={d} {dtype}: {cmp.describe()}"


def test_gpu_cache_over_2gib_pages_at_far_end():
    preset, d, hkv, page = "turboquant_k8v4", 128, 8, 16
    lay = tq_spec.layout(preset, d)
    block_bytes = page * hkv * lay.slot_bytes
    n = (2**31 // block_bytes) + 1200  # > 2 GiB; used pages live past the 2 GiB mark
    case = AttnCase("far_end", seq_lens=(300, 40, 1100), q_lens=(1, 40, 1), num_q_heads=32, num_kv_heads=hkv,
                    head_dim=d, page=page, presets=(preset,), far_end=True)
    built = build(case, preset, dev=torch.device("cuda"), num_blocks=n)
    assert built.kv_cache.numel() > 2**31
    assert int(built.block_table[built.block_table < n].min()) * block_bytes > 2**31
    for path in eligible_paths(built):
        check_against_reference(built, run_path(built, path), compact=True)
    # Store into the last blocks: bytes vs reference, nothing before them touched.
    gen = torch.Generator().manual_seed(2)
    tail = 4
    tail_before = built.kv_cache[n - tail:].cpu()
    head_sum = built.kv_cache[: n - 200].sum(dtype=torch.int64)
    slots = torch.randperm(tail * page, generator=gen)[:40] + (n - tail) * page
    key, value = torch.randn(40, hkv, d, generator=gen), torch.randn(40, hkv, d, generator=gen)
    tq_torch.store_kv(key.cuda(), value.cuda(), built.kv_cache, slots.cuda(), preset=preset)
    cmp = compare_store(built.kv_cache[n - tail:].cpu(), key, value, tail_before, slots - (n - tail) * page,
                        preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()
    assert int(built.kv_cache[: n - 200].sum(dtype=torch.int64)) == int(head_sum)


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "bf16"])
def test_gpu_cuda_graph_decode_replay_matches_eager(preset):
    case = AttnCase("graph_decode", seq_lens=(100, 37, 1000, 5), q_lens=(1, 1, 1, 1), num_q_heads=16,
                    num_kv_heads=4, head_dim=128, page=16, window=64, soft_cap=30.0, sinks=True)
    built = build(case, preset, dev=torch.device("cuda"))

    def step():
        return tq_torch.paged_attention(*built.args(), **built.kwargs(), path="decode")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles kernels and fills the parameter cache outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    # New step: fresh queries, some shorter contexts (within the stored tokens and
    # never exposing the slots `build` poisoned before the original windows).
    built.query.copy_(torch.randn_like(built.query))
    built.seq_lens.copy_(torch.tensor([100, 20, 1000, 3], dtype=torch.int32))
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(static_out, eager)
    check_against_reference(built, static_out)


def test_gpu_compile_fullgraph_inductor():
    from test_torch_ops import compile_and_compare

    compile_and_compare("inductor")
