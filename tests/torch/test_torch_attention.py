"""tq_torch.paged_attention vs the float64 reference on the same cache bytes (CPU: Triton interpreter).

Every eligible path of `tq_spec.dispatch` is forced on every case; outputs are
NaN-poisoned before each run; caches carry NaN-producing garbage in unused
pages, page tails, out-of-window slots and unused block-table columns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import tq_spec
import tq_torch
from tq_torch._src.attention_kernel import TILE_ORDER_HEADS, _longest_tiles_first
from tq_torch_testlib import AttnCase, build, check_against_reference, device, eligible_paths, run_path

PLAIN = ("turboquant_k8v4", "bf16", "fp16")  # presets that accept any multiple-of-8 head_dim

# Small on purpose: the interpreter runs every program in numpy.
CPU_CASES = (
    AttnCase("decode_batch", seq_lens=(1, 5, 9, 17), q_lens=(1, 1, 1, 1)),
    # q_len 8 over seq 9 with page 16 (a FlashInfer regression), GQA 3, a q_len-0
    # continuation and an empty sequence.
    AttnCase("mixed_q8_seq9_page16_gqa3", seq_lens=(9, 20, 3, 0), q_lens=(8, 0, 3, 0),
             num_q_heads=3, num_kv_heads=1, page=16, dtype=torch.float16),
    AttnCase("window4_gqa7_page3", seq_lens=(17, 6, 30), q_lens=(5, 1, 2), num_q_heads=7,
             num_kv_heads=1, page=3, window=4),
    AttnCase("window1_softcap30_sinks_page1_mha", seq_lens=(7, 12), q_lens=(3, 1), num_q_heads=4,
             num_kv_heads=4, page=1, window=1, soft_cap=30.0, sinks=True, dtype=torch.float32,
             presets=("turboquant_4bit_nc", "turboquant_k8v4", "bf16")),
    AttnCase("d40_page48_gqa20_softcap50_sinks", seq_lens=(60, 5), q_lens=(2, 5), num_q_heads=20,
             num_kv_heads=1, head_dim=40, page=48, soft_cap=50.0, sinks=True, dtype=torch.float16,
             presets=PLAIN),
    AttnCase("window_eq_and_gt_seq", seq_lens=(10, 6), q_lens=(10, 2), window=10,
             presets=("turboquant_3bit_nc", "fp16")),
    AttnCase("d128_fp32_scale", seq_lens=(33,), q_lens=(1,), num_q_heads=2, num_kv_heads=1,
             head_dim=128, page=16, dtype=torch.float32, scale=0.3,
             presets=("turboquant_k3v4_nc", "turboquant_k8v4")),
    # Logits around -1e4..1e4: a finite -5e4 mask sentinel would let masked garbage win.
    AttnCase("huge_logits_window3", seq_lens=(11,), q_lens=(2,), num_q_heads=2, num_kv_heads=1,
             window=3, dtype=torch.float32, scale=3e3, presets=("turboquant_4bit_nc", "bf16")),
)

PARAMS = [cp for case in CPU_CASES for cp in case.preset_params()]


@pytest.mark.parametrize("case,preset", PARAMS, ids=[f"{c.name}-{p}" for c, p in PARAMS])
def test_every_path_matches_reference(case, preset):
    built = build(case, preset)
    cache_before = built.kv_cache.clone()
    paths = eligible_paths(built)
    # Every path but `dequant`, whose workspace is 16-bit, is eligible for every case here.
    expected = set(tq_torch.PATH_NAMES) - ({"dequant"} if built.query.dtype == torch.float32 else set())
    assert set(paths) == expected
    outs = {}
    reference_out = None
    for path in paths:
        outs[path] = run_path(built, path)
        cmp = check_against_reference(built, outs[path], reference_out=reference_out)
        assert cmp.max_err <= cmp.bound
    auto = tq_torch.paged_attention(*built.args(), **built.kwargs())
    chosen = tq_spec.dispatch.select_path(tq_spec.dispatch.problem_for(
        built.query, built.kv_cache, built.block_table, preset=preset, sliding_window=case.window))
    assert torch.equal(auto, outs[chosen]), "path='auto' must run the path the dispatch table picks"
    assert torch.equal(built.kv_cache, cache_before), "attention must not write the cache"


@pytest.mark.parametrize("seqs, kv_heads, context, expected", [
    (32, 4, 8192, 4),  # 128 programs: 4 splits fill 4 per SM on 132 SMs, 5 would spill into a new wave
    (32, 8, 8192, 2),
    (1, 8, 4096, 32),  # 64 key tiles: at least two per split
    (1, 8, 40, 1),  # one tile
])
def test_decode_num_splits_fills_whole_waves(monkeypatch, seqs, kv_heads, context, expected):
    # The automatic split count on a GPU (host arithmetic only): as many programs as fit in
    # programs_per_sm x SMs, never more, with at least two 64-key tiles per split.
    from tq_torch._src import config
    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    splits = config.decode_num_splits(
        num_seqs=seqs, num_kv_heads=kv_heads, num_tokens=seqs, num_q_heads=32, head_dim=128,
        max_context=context, block_n=64, device=torch.device("cuda"), interpret=False, programs_per_sm=4)
    assert splits == expected
    assert splits == 1 or seqs * kv_heads * splits <= 4 * 132


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_counts(preset, num_splits):
    # 8 splits over sequences of 1..6 keys: most splits are empty and must merge as nothing.
    case = AttnCase("short_decode", seq_lens=(1, 6, 4), q_lens=(1, 2, 1), num_q_heads=6, num_kv_heads=2,
                    page=2, window=3, sinks=True)
    built = build(case, preset, seed=num_splits)
    out = run_path(built, "decode", num_splits=num_splits)
    check_against_reference(built, out)


def test_more_sequences_than_one_scan_chunk():
    """130 sequences: a tile finds its sequence over two 128-sequence chunks of the
    query_start_loc scan (`attention_kernel._find_sequence`), decode and extend."""
    rng = np.random.default_rng(130)
    q_lens = tuple(int(x) for x in rng.integers(0, 3, 130))
    seq_lens = tuple(q + int(x) for q, x in zip(q_lens, rng.integers(0, 4, 130)))
    case = AttnCase("many_sequences", seq_lens=seq_lens, q_lens=q_lens, num_q_heads=2, num_kv_heads=1,
                    head_dim=64, page=2, extra_blocks=1)
    built = build(case, "turboquant_4bit_nc")
    for path in ("decode", "extend"):
        check_against_reference(built, run_path(built, path))


def test_randomized_rotation_and_exact_codebook():
    preset = "turboquant_4bit_nc"
    rot = tq_spec.rotation(64, "randomized_hadamard", seed=7)
    cb = tq_spec.codebook(64, 4, flavor="exact")
    case = AttnCase("custom_params", seq_lens=(13, 4), q_lens=(1, 4))
    built = build(case, preset, rotation=rot, codebook=cb)
    for path in ("decode", "extend"):
        check_against_reference(built, run_path(built, path))
    # The same cache read with the default parameters is a different (wrong) answer:
    # proves the custom rotation/codebook actually reach the kernels.
    default = tq_torch.paged_attention(*built.args(), **built.kwargs(), path="extend")
    assert not torch.allclose(default.float(), run_path(built, "extend").float(), atol=1e-2)


@pytest.mark.parametrize("gain", [2.0**15, 2.0**-10])
def test_norm_correction_with_codebooks_far_from_unit_range(gain):
    """Decode tiles take ``||c||**2`` from fp16 squares on tensor cores (`kv_tiles.decode_key_tile`): a
    codebook whose squares would overflow (x 2**15) or flush (x 2**-10) in fp16 must still give the
    reference's scores, so the squares are taken of the codebook rescaled by a power of two."""
    preset, d = "turboquant_4bit_nc", 64
    base = tq_spec.codebook(d, 4)
    c = (base.centroids * np.float32(gain)).astype(np.float32)
    cb = tq_spec.Codebook(d, 4, "custom", c, ((c[:-1] + c[1:]) / np.float32(2)).astype(np.float32))
    case = AttnCase("scaled_codebook", seq_lens=(21, 6), q_lens=(1, 1), num_q_heads=4, num_kv_heads=1)
    built = build(case, preset, codebook=cb)
    for path in ("decode", "extend"):
        check_against_reference(built, run_path(built, path))


def test_rotation_as_torch_tensor_matches_numpy():
    preset = "turboquant_3bit_nc"
    rot = tq_spec.rotation(64, "randomized_hadamard")
    case = AttnCase("tensor_rotation", seq_lens=(9,), q_lens=(1,))
    built = build(case, preset, rotation=rot)
    a = tq_torch.paged_attention(*built.args(), **built.kwargs(), rotation=rot)
    b = tq_torch.paged_attention(*built.args(), **built.kwargs(), rotation=torch.from_numpy(rot.copy()))
    assert torch.equal(a, b)


def test_empty_batch_returns_empty():
    dev = device()
    lay = tq_spec.layout("turboquant_k8v4", 64)
    cache = torch.zeros(2, 4, 1, lay.slot_bytes, dtype=torch.uint8, device=dev)
    q = torch.randn(0, 2, 64, dtype=torch.bfloat16, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    for path in ("decode", "extend"):
        out = tq_torch.paged_attention(q, cache, torch.zeros(1, 1, **i32), torch.zeros(1, **i32),
                                       torch.zeros(2, **i32), preset="turboquant_k8v4", path=path)
        assert out.shape == (0, 2, 64) and out.dtype == torch.bfloat16


def test_forced_unknown_path_is_rejected():
    built = build(AttnCase("tiny", seq_lens=(3,), q_lens=(1,)), "bf16")
    with pytest.raises(ValueError, match="path"):
        tq_torch.paged_attention(*built.args(), **built.kwargs(), path="flash")
    with pytest.raises(TypeError, match="path"):
        tq_torch.paged_attention(*built.args(), **built.kwargs(), path=None)


@triton.jit
def _launch_order_kernel(out_ptr, HEADS: tl.constexpr):
    tile, head = _longest_tiles_first(tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1),
                                      HEADS)
    launch = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out_ptr + tile * tl.num_programs(1) + head, launch)


@pytest.mark.parametrize("heads", [TILE_ORDER_HEADS.value, 2])
def test_extend_launch_order_takes_every_tile_once_longest_first(heads):
    # The extend path's (tile, kv head) of each program: every pair exactly once (a pair no
    # program takes keeps -1, two programs on one pair leave another at -1), and within each
    # head the later tiles (more keys, causal) launch first.
    for nx, ny in [(1, 1), (5, 1), (3, 2), (7, 4), (9, 8), (4, 6), (3, 12)]:
        out = torch.full((nx, ny), -1, dtype=torch.int32, device=device())
        _launch_order_kernel[(nx, ny)](out, HEADS=heads)
        out = out.cpu()
        assert torch.equal(out.flatten().sort().values, torch.arange(nx * ny, dtype=torch.int32)), (nx, ny)
        assert out[nx - 1, 0] == 0, (nx, ny)
        if nx > 1:
            assert bool((out[:-1] > out[1:]).all()), (nx, ny, out)
