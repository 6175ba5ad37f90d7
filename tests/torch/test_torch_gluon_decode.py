"""The Gluon decode (`tq_torch._src.gluon_decode`), the decode path's kernel for 4bit_nc, k3v4_nc, 3bit_nc and k8v4
caches on sm_90.

CPU: it compiles for sm_90a, and its key loop keeps every tile in registers (no shared memory,
no barrier). GPU (``-m gpu``): the default path takes it; its output matches the float64 reference
through the parity tolerance on garbage-laden caches (shuffled pages, bad block ids past each
sequence; several query tokens per sequence in causal tiles), and the attention rules hold as on the
Triton kernels, one token per sequence or several: padding rows, q_len 0 and 2, NaN queries and sinks,
bad block ids, seq_lens and query_start_loc, CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tq_torch
from tq_gluon import decode as shared_decode
from tq_torch._src.api import _paged_attention
from tq_torch_testlib import AttnCase, build, check_against_reference

# The slots the kernel reads: at D = 128, and at D = 256 (decode steps).
PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4")
ROOT = Path(__file__).resolve().parents[2]


# Compiles the kernel for sm_90a and prints its TTGIR (run without TRITON_INTERPRET: the interpreter
# would take over the reductions' combine functions).
_COMPILE_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

import tq_spec
from tq_gluon import decode

lay = tq_spec.layout(sys.argv[1], int(sys.argv[4]))
shape = decode.launch_shape(lay, num_tokens=int(sys.argv[2]), num_q_heads=4, num_kv_heads=1, num_seqs=1,
                            max_blocks=4, num_splits=1, has_sinks=True)
options = {k: v for k, v in shape.constexprs.items() if k in ("num_warps", "maxnreg")}
consts = {k: v for k, v in shape.constexprs.items() if k not in options}
consts.update(SPLITS_PAD=16, WIDE=sys.argv[3] == "wide")
if consts["WIDE"]:  # (wide loads and TMA stages exclude each other; the launchers pick one)
    consts.update(STAGES=0)
print("stages", consts["STAGES"])
sig = dict(decode.kernel_signature(shape.slot), **{k: "constexpr" for k in consts})
src = GluonASTSource(decode.gluon_decode_kernel, sig, constexprs=consts, attrs={})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
print(kernel.asm["ttgir"])
"""


_DOTS = {"turboquant_4bit_nc": 3, "turboquant_k3v4_nc": 3, "turboquant_3bit_nc": 3, "turboquant_k8v4": 2}
_KEY_LOOP_BUILDS = ([(preset, q_len, loads, 128) for preset in PRESETS for q_len in (1, 4)
                     for loads in ("wide", "narrow")]
                    + [(preset, 1, "narrow", 256) for preset in PRESETS])


@pytest.mark.parametrize("preset,q_len,loads,head_dim", _KEY_LOOP_BUILDS,
                         ids=[f"{p}-q{q}-{w}-d{d}" for p, q, w, d in _KEY_LOOP_BUILDS])
def test_gluon_decode_key_loop_has_no_shared_memory(tmp_path, preset, q_len, loads, head_dim):
    """A decode step (one query token per program, 8 columns) and several query tokens per sequence (16), with
    wide loads of 4-bit codes (`gluon_decode.wide_loads`) and without; decode steps at D = 256."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90, preset, str(q_len), loads, str(head_dim)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton build ships no ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The innermost loops (no scf.for between a loop's head and its first yield) holding dots.
    loops = [body for body in re.findall(r"(?=scf\.for .*?\n(.*?)\n\s*scf\.yield)", proc.stdout, flags=re.S)
             if "tt.dot" in body and "scf.for" not in body]
    assert len(loops) == 1, f"expected one key loop, found {len(loops)}"
    # (Its layout conversions are all register no-ops: `assert_trivial` fails the compile otherwise.)
    for op in ("ttg.local_alloc", "ttg.local_load", "ttg.local_store", "gpu.barrier"):
        assert op not in loops[0], f"{op} in the key loop"
    # Q K^T, V^T P^T, and for mse keys the squares' ones row, for each page of a loop trip (TMA stages: one page).
    staged = re.search(r"^stages (\d+)$", proc.stdout, flags=re.M)
    pages = shared_decode._FORMATS[shared_decode._slot_format(preset, head_dim)]["UNROLL"]
    if staged and int(staged.group(1)) > 0:
        pages = 1
    assert loops[0].count("tt.dot") == _DOTS[preset] * pages


def _decode_case(name, seq_lens, hq, hkv, q_lens=None, sinks=False, head_dim=128):
    return AttnCase(name, seq_lens=seq_lens, q_lens=q_lens or (1,) * len(seq_lens), num_q_heads=hq,
                    num_kv_heads=hkv, head_dim=head_dim, page=16, presets=PRESETS, sinks=sinks)


GPU_CASES = (
    _decode_case("lengths_gqa32_8", (1, 5, 15, 16, 17, 33, 4100), 32, 8),
    _decode_case("gqa8_1", (300, 4096), 8, 1),
    _decode_case("gqa16_8_sinks", (2000, 77), 16, 8, sinks=True),
    _decode_case("gqa24_8", (900,), 24, 8),  # G = 3: padded rows in the 8-column tile
    # T <= B with a q_len 2 row and a q_len 0, seq_len 0 request: each token is its own pass.
    _decode_case("q_len_2_and_0", (50, 0, 3000, 17), 32, 8, q_lens=(2, 0, 1, 1)),
    # T > B: tiles of 16 // G tokens x G heads, causal per column (`gluon_decode.tile_shape`). A sequence as
    # long as its query (its first token sees one key), q_len 1 among longer ones, sequences of several
    # tiles, a last tile part-filled, G = 3 (15 of 16 columns), 1 (16 tokens per tile) and 8.
    _decode_case("spec_q4_gqa32_8", (40, 17, 3000, 4), 32, 8, q_lens=(4, 4, 4, 4)),
    _decode_case("spec_gqa24_8", (900, 33, 5), 24, 8, q_lens=(7, 1, 5)),
    _decode_case("spec_gqa8_8", (70, 2000), 8, 8, q_lens=(20, 3)),
    _decode_case("spec_gqa8_1", (300, 4096), 8, 1, q_lens=(2, 2)),
)
# One sequence of each: NaN, metadata and padding cases; with one query token per sequence (the decode
# step's tile) and several (`gluon_decode.tile_shape`'s other).
GUARD_CASE = _decode_case("guards", (700, 90, 2100), 32, 8, sinks=True)
MULTI_GUARD_CASE = _decode_case("guards_multi", (700, 90, 2100), 32, 8, q_lens=(3, 2, 3), sinks=True)
D256_GUARD_CASE = _decode_case("guards_d256", (700, 90, 2100), 16, 4, sinks=True, head_dim=256)
_GUARDS = ([(p, c) for c in (GUARD_CASE, MULTI_GUARD_CASE) for p in PRESETS]
           + [(p, D256_GUARD_CASE) for p in PRESETS])
GUARD_CASES = pytest.mark.parametrize("preset,guard_case", _GUARDS, ids=[f"{p}-{c.name}" for p, c in _GUARDS])
# D = 256: decode steps take the kernel; several query tokens per sequence keep the Triton kernels.
D256_CASES = (
    _decode_case("d256_lengths_gqa16_4", (1, 5, 15, 16, 17, 33, 4100), 16, 4, head_dim=256),
    _decode_case("d256_gqa8_1", (300, 4096), 8, 1, head_dim=256),
    _decode_case("d256_gqa8_8_sinks", (2000, 77), 8, 8, sinks=True, head_dim=256),
    _decode_case("d256_q_len_2_and_0", (50, 0, 3000, 17), 16, 4, q_lens=(2, 0, 1, 1), head_dim=256),
)


class _Counting:
    """Wraps `gluon_decode.launch_decode_spec` to count the launches the dispatcher made."""

    def __init__(self, monkeypatch):
        from tq_torch._src import gluon_decode

        self.calls = 0
        inner = gluon_decode.launch_decode_spec

        def wrapped(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(gluon_decode, "launch_decode_spec", wrapped)


def _run(built, *, path="auto", num_splits=0, out=None, **changes):
    """``_paged_attention`` (the public op's body; validation off) into a NaN-poisoned output."""
    built = dataclasses.replace(built, **changes) if changes else built
    out = torch.full_like(built.query, float("nan")) if out is None else out
    _paged_attention(*built.args(), **built.kwargs(), rotation=None, codebook=None, path=path, out=out,
                     num_splits=num_splits, validate=False)
    return out


def _rows(built, seq):
    qsl = built.query_start_loc.cpu()
    return slice(int(qsl[seq]), int(qsl[seq + 1]))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("case", GPU_CASES + D256_CASES, ids=[c.name for c in GPU_CASES + D256_CASES])
@pytest.mark.parametrize("num_splits", (0, 1, 3, 16))
def test_gpu_gluon_decode_matches_reference(preset, case, num_splits, monkeypatch):
    """The default path of a decode of these presets on sm_90 runs the Gluon kernel (decode steps at D = 256 too),
    through the parity tolerance (0 = the automatic split count users get)."""
    built = build(case, preset, dev=torch.device("cuda"))
    counting = _Counting(monkeypatch)
    out = _run(built, num_splits=num_splits)
    assert counting.calls == 1, "the decode path did not take the Gluon kernel"
    check_against_reference(built, out)
    # A second call relaunches the kept compiled kernel (`launcher.KernelSite`): same bits.
    assert torch.equal(_run(built, num_splits=num_splits), out)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_d256_tiles_of_several_tokens_keep_the_triton_decode(preset, monkeypatch):
    """At D = 256 only decode steps take the kernel: several query tokens per sequence run the Triton decode."""
    case = _decode_case("d256_multi", (40, 3000), 16, 4, q_lens=(4, 3), head_dim=256)
    built = build(case, preset, dev=torch.device("cuda"))
    counting = _Counting(monkeypatch)
    out = _run(built)
    assert counting.calls == 0
    check_against_reference(built, out)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_gluon_decode_agrees_with_the_triton_decode(preset, monkeypatch):
    from tq_torch._src import gluon_decode, ops

    built = build(GPU_CASES[0], preset, dev=torch.device("cuda"))
    fast = _run(built)
    monkeypatch.setattr(shared_decode, "ENABLED", False)
    ops._attention_setup.cache_clear()
    try:
        counting = _Counting(monkeypatch)
        slow = _run(built)
        assert counting.calls == 0
    finally:
        ops._attention_setup.cache_clear()
    check_against_reference(built, fast)
    check_against_reference(built, slow)
    assert (fast.float() - slow.float()).abs().max().item() < 0.05


def test_the_kernel_rotates_the_query_where_its_spec_says():
    """Tiles of several query tokens of mse slots rotate the query in the kernel (``ROTATE``); decode steps take
    it rotated; fp8 keys need no rotation."""
    from tq_torch._src import config, gluon_decode

    import tq_spec

    for preset in PRESETS:
        fmt = tq_spec.layout(preset, 128)
        for num_tokens in (8, 32):
            spec = gluon_decode.decode_spec(fmt, num_tokens=num_tokens, num_q_heads=32, num_kv_heads=8, num_seqs=8,
                                            max_blocks=64, num_splits=2, has_sinks=False)
            expected = preset != "turboquant_k8v4" and num_tokens > 8
            assert spec.rotates == expected, (preset, num_tokens)
            assert spec.split.constexprs["ROTATE"] == spec.split_narrow.constexprs["ROTATE"] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"))
@pytest.mark.parametrize("q_lens", ((1, 1, 1), (3, 2, 5)), ids=("q1", "multi"))
@pytest.mark.parametrize("rotation_kind", ("default", "randomized_hadamard", "orthogonal"))
def test_gpu_gluon_decode_rotations_and_query_views_match_reference(preset, q_lens, rotation_kind, monkeypatch):
    """The query read from a strided view of a wider tensor, through the parity tolerance: rotated by
    `rotation.rotate_query` (decode steps), in the kernel (tiles of several tokens, the default rotation's signs),
    or before it and then by the kernel's identity (a user's rotation). For tiles of several tokens, the default
    rotation's output is also within a bf16 rounding of the output with the query rotated before the launch."""
    from tq_torch._src import gluon_decode, ops

    dev = torch.device("cuda")
    if rotation_kind == "default":
        rotation = None
    elif rotation_kind == "randomized_hadamard":
        import tq_spec

        rotation = tq_spec.rotation(128, "randomized_hadamard", seed=5)
    else:  # (float32, orthogonal to float32 accuracy: the reference takes it as given)
        rotation = np.linalg.qr(np.random.default_rng(7).standard_normal((128, 128)))[0].astype(np.float32)
    case = _decode_case("rotations", (700, 90, 2100), 32, 8, q_lens=q_lens, sinks=True)
    built = build(case, preset, dev=dev, rotation=rotation)
    wide = torch.randn(*built.query.shape[:2], 256, generator=torch.Generator().manual_seed(3)).to(built.query)
    wide[..., :128] = built.query
    view = wide[..., :128]  # last dim contiguous, rows 512 bytes apart
    counting = _Counting(monkeypatch)
    out = torch.full_like(built.query, float("nan"))
    _paged_attention(view, *built.args()[1:], **built.kwargs(), rotation=rotation, codebook=None, path="auto",
                     out=out, num_splits=0, validate=False)
    assert counting.calls == 1
    check_against_reference(built, out)
    if rotation is None and sum(q_lens) > len(q_lens):  # (tiles of several tokens: the kernel rotated the query)
        monkeypatch.setattr(shared_decode, "ROTATE_IN_KERNEL", False)
        ops._attention_setup.cache_clear()
        try:
            host = _run(built)
        finally:
            ops._attention_setup.cache_clear()
        # The same exact products, summed in the tensor cores' order either way: at most a rounding apart.
        torch.testing.assert_close(out.float(), host.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("q_lens", ((1, 1, 0, 0), (3, 2, 0, 0)), ids=("q1", "multi"))
def test_gpu_gluon_decode_padding_rows_are_zero(preset, q_lens, monkeypatch):
    """Rows past ``query_start_loc[B]`` (vLLM's padded CUDA-graph batches) come out zero."""
    case = _decode_case("padded", (300, 20, 0, 0), 32, 8, q_lens=q_lens)
    built = build(case, preset, dev=torch.device("cuda"))
    t = sum(q_lens)
    extra = torch.randn(2, *built.query.shape[1:], generator=torch.Generator().manual_seed(1)).to(built.query)
    counting = _Counting(monkeypatch)
    out = _run(built, query=torch.cat([built.query, extra]))
    assert counting.calls == 1
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))
    check_against_reference(built, out[:t].contiguous())


@pytest.mark.gpu
@GUARD_CASES
def test_gpu_gluon_decode_nan_query_and_sink_propagate(preset, guard_case):
    built = build(guard_case, preset, dev=torch.device("cuda"))
    clean = _run(built)
    query = built.query.clone()
    query[1, 5, 7] = float("nan")  # token 1, head 5 (kv head 1)
    out = _run(built, query=query)
    nan = torch.zeros_like(out, dtype=torch.bool)
    nan[1, 5] = True
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], clean[~nan])
    sinks = built.sinks.clone()
    sinks[9] = float("nan")
    out = _run(built, sinks=sinks)
    nan = torch.zeros_like(out, dtype=torch.bool)
    nan[:, 9] = True
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], clean[~nan])


@pytest.mark.gpu
@pytest.mark.parametrize("bad", (-5, 2**31 - 1, 10**6))
@GUARD_CASES
def test_gpu_gluon_decode_bad_block_ids_and_lengths_stay_in_bounds(preset, bad, guard_case):
    """Block ids outside [0, N) mask their keys (a row with none left is zero); seq_lens are clamped
    to what the block table addresses (a negative one sees no key); other sequences' rows are
    bitwise unchanged."""
    case = dataclasses.replace(guard_case, sinks=False)
    built = build(case, preset, dev=torch.device("cuda"))
    clean = _run(built)
    table = built.block_table.clone()
    table[1] = bad
    out = _run(built, block_table=table)
    for seq in (0, 2):
        assert torch.equal(out[_rows(built, seq)], clean[_rows(built, seq)])
    assert torch.equal(out[_rows(built, 1)], torch.zeros_like(out[_rows(built, 1)]))
    lens = built.seq_lens.clone()
    lens[1] = bad
    out = _run(built, seq_lens=lens)
    for seq in (0, 2):
        assert torch.equal(out[_rows(built, seq)], clean[_rows(built, seq)])
    if bad < 0:
        assert torch.equal(out[_rows(built, 1)], torch.zeros_like(out[_rows(built, 1)]))
    # (A length past the sequence's tokens is garbage in, garbage out: its row sees never-written
    # slots of its last page, which hold NaN-decoding bytes.)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("guard_case,qsl,laid_out", [
    (GUARD_CASE, [0, 2, 1, 3], [0, 2, 2, 3]), (GUARD_CASE, [0, 2**31 - 1, -2**31, 3], [0, 3, 3, 3]),
    (GUARD_CASE, [0, 1, 2, 9], [0, 1, 2, 3]), (MULTI_GUARD_CASE, [0, 5, 2, 8], [0, 5, 5, 8]),
    (MULTI_GUARD_CASE, [0, 2**31 - 1, -2**31, 8], [0, 8, 8, 8]), (MULTI_GUARD_CASE, [0, 3, 5, 30], [0, 3, 5, 8]),
    (MULTI_GUARD_CASE, [-4, 1, 7, 8], [0, 1, 7, 8])])
def test_gpu_gluon_decode_bad_query_start_loc_gives_each_row_one_owner(preset, guard_case, qsl, laid_out):
    built = build(guard_case, preset, dev=torch.device("cuda"))
    as_tensor = functools.partial(torch.tensor, dtype=torch.int32, device=built.query.device)
    expected = _run(built, query_start_loc=as_tensor(laid_out))
    got = _run(built, query_start_loc=as_tensor(qsl))
    assert not torch.isnan(expected).any()
    assert torch.equal(got, expected)


@pytest.mark.gpu
@GUARD_CASES
def test_gpu_gluon_decode_cuda_graph_replay_matches_eager(preset, guard_case, monkeypatch):
    built = build(guard_case, preset, dev=torch.device("cuda"))
    counting = _Counting(monkeypatch)

    def step():
        return tq_torch.paged_attention(*built.args(), **built.kwargs())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and keeps the kernels outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    built.query.copy_(torch.randn_like(built.query))
    built.seq_lens.copy_(torch.tensor([650, 17, 2100], dtype=torch.int32))
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, step())
    assert counting.calls == 3
    check_against_reference(built, static_out)


@pytest.mark.gpu
def test_gpu_fp8_keys_in_a_cache_off_4_bytes_take_the_triton_decode(monkeypatch):
    """fp8 keys are read as int32 words: a cache at an address 2 mod 4 (valid: fields are 2-byte)
    runs the Triton kernels instead, with the same answer."""
    built = build(GPU_CASES[0], "turboquant_k8v4", dev=torch.device("cuda"))
    cache = built.kv_cache
    backing = torch.empty(cache.numel() + 2, dtype=torch.uint8, device=cache.device)
    shifted = backing[2:].view(cache.shape)
    shifted.copy_(cache)
    assert shifted.data_ptr() % 4 == 2
    counting = _Counting(monkeypatch)
    out = _run(built, kv_cache=shifted)
    assert counting.calls == 0
    check_against_reference(built, out)


@pytest.mark.parametrize("preset,num_tokens,wide", [
    ("turboquant_k8v4", 8, True), ("turboquant_k8v4", 32, False), ("turboquant_4bit_nc", 8, False),
    ("turboquant_4bit_nc", 32, True), ("turboquant_k3v4_nc", 8, False), ("turboquant_3bit_nc", 32, False)])
def test_wide_loads_where_they_won_and_where_the_strides_allow(preset, num_tokens, wide):
    """Decode steps of k8v4 and tiles of several 4bit_nc tokens read 4-bit codes by 8-byte loads (`WIDE_SLOTS`);
    a call whose cache strides are not multiples of 8 bytes (say 1 or 2 kv heads of 134-byte slots) launches
    the narrow build."""
    from tq_torch._src import config, gluon_decode

    import tq_spec

    fmt = tq_spec.layout(preset, 128)
    spec = gluon_decode.decode_spec(fmt, num_tokens=num_tokens, num_q_heads=32, num_kv_heads=8, num_seqs=8,
                                    max_blocks=64, num_splits=2, has_sinks=False)
    assert spec.split.constexprs["WIDE"] == wide
    assert not spec.split_narrow.constexprs["WIDE"]
    slot_bytes = tq_spec.layout(preset, 128).slot_bytes
    for hkv in (1, 2, 4, 8):
        strides = (16 * hkv * slot_bytes // 2, hkv * slot_bytes // 2, slot_bytes // 2, 1)  # the int16 view's
        assert gluon_decode.wide_loads(strides) == (hkv * slot_bytes % 8 == 0), (hkv, slot_bytes)
    assert not gluon_decode.wide_loads((16 * 8 * 67, 8 * 67 + 2, 67, 1))  # a padded slot stride


@pytest.mark.parametrize("preset,num_tokens,head_dim,staged", [
    ("turboquant_4bit_nc", 8, 128, True), ("turboquant_4bit_nc", 32, 128, False), ("turboquant_4bit_nc", 8, 256, False),
    ("turboquant_k3v4_nc", 8, 128, False), ("turboquant_3bit_nc", 8, 128, False), ("turboquant_k8v4", 8, 128, False)])
def test_tma_stages_where_they_apply_and_where_the_cache_allows(preset, num_tokens, head_dim, staged):
    """Decode steps of 4bit_nc at D = 128 stream their pages through TMA stages (`TMA_STAGES`); tiles of several
    tokens, D = 256 and the other slots do not. Per call, the cache must be 16-byte aligned with pages of 16
    contiguous rows that are multiples of 16 bytes (`tma_loads`: 8 or 16 kv heads of 134-byte slots), else the
    register build runs."""
    import tq_spec

    lay = tq_spec.layout(preset, head_dim)
    shape = shared_decode.launch_shape(lay, num_tokens=num_tokens, num_q_heads=32, num_kv_heads=8, num_seqs=8,
                                       max_blocks=64, num_splits=2, has_sinks=False)
    assert shape.constexprs["STAGES"] == (shared_decode.TMA_STAGES if staged else 0)
    slot = tq_spec.layout("turboquant_4bit_nc", 128).slot_bytes
    for hkv in (1, 2, 4, 8, 16):
        strides = (16 * hkv * slot // 2, hkv * slot // 2, slot // 2, 1)  # the int16 view's
        assert shared_decode.tma_loads(strides) == (hkv % 8 == 0), hkv
        assert not shared_decode.tma_loads(strides, 2)  # a cache 2 bytes past a 16-byte boundary
    assert not shared_decode.tma_loads((16 * 8 * 67 + 8, 8 * 67, 67, 1))  # pages not 16 contiguous rows


def test_wide_loads_and_tma_stages_exclude_each_other(monkeypatch):
    """A format listed for wide loads too (as `test_gpu_gluon_decode_wide_loads_match_reference` forces) takes the
    wide register build: the kernel asserts that no build has both."""
    import tq_spec

    lay = tq_spec.layout("turboquant_4bit_nc", 128)
    fmt = shared_decode.slot_key(lay)
    monkeypatch.setattr(shared_decode, "WIDE_SLOTS", frozenset({(fmt, False), (fmt, True)}))
    shape = shared_decode.launch_shape(lay, num_tokens=8, num_q_heads=32, num_kv_heads=8, num_seqs=8,
                                       max_blocks=64, num_splits=2, has_sinks=False)
    assert shape.wide and shape.constexprs["STAGES"] == 0


WIDE_CASES = (GPU_CASES[0], GPU_CASES[1], GPU_CASES[5], GPU_CASES[8])


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("case", WIDE_CASES, ids=[c.name for c in WIDE_CASES])
@pytest.mark.parametrize("offset", (0, 2, 4, 6))
def test_gpu_gluon_decode_wide_loads_match_reference(preset, case, offset, monkeypatch):
    """Wide loads forced on for every slot and tile kind, over a cache at each address mod 8 (so its kv heads'
    slots start at every offset the rotation handles): the float64 reference's answer. 1 kv head (strides not
    multiples of 8 bytes) takes the narrow build; fp8 keys at an address 2 mod 4 take the Triton kernels."""
    from tq_torch._src import config, gluon_decode, ops

    import tq_spec

    fmt = shared_decode.slot_key(tq_spec.layout(preset, 128))
    monkeypatch.setattr(shared_decode, "WIDE_SLOTS", frozenset({(fmt, False), (fmt, True)}))
    ops._attention_setup.cache_clear()
    try:
        built = build(case, preset, dev=torch.device("cuda"))
        cache = built.kv_cache
        backing = torch.empty(cache.numel() + 8, dtype=torch.uint8, device=cache.device)
        start = (offset - backing.data_ptr()) % 8
        shifted = backing[start:start + cache.numel()].view(cache.shape)
        shifted.copy_(cache)
        assert shifted.data_ptr() % 8 == offset
        counting = _Counting(monkeypatch)
        out = _run(built, kv_cache=shifted)
        assert counting.calls == (0 if preset == "turboquant_k8v4" and offset % 4 else 1)
        check_against_reference(built, out)
    finally:
        ops._attention_setup.cache_clear()


@pytest.mark.parametrize("preset,num_tokens,num_splits,fused", [
    ("turboquant_4bit_nc", 8, 1, True), ("turboquant_4bit_nc", 8, 4, True), ("turboquant_k8v4", 8, 3, True),
    ("turboquant_3bit_nc", 8, 3, True), ("turboquant_4bit_nc", 8, 5, False), ("turboquant_4bit_nc", 32, 3, False),
    ("turboquant_k3v4_nc", 8, 3, False)],
    ids=("step_1_split", "step_4_splits", "k8v4", "3bit_nc", "step_5_splits", "multi_token", "k3v4_nc"))
def test_decode_steps_with_few_splits_merge_in_the_kernel(preset, num_tokens, num_splits, fused):
    """The launch plan: decode steps (``T <= B``) with up to `FUSED_MERGE_MAX_SPLITS` splits are one
    launch with a ticket counter per (row, kv head), for the slots of `MERGES_IN_KERNEL`; otherwise the
    merge kernel follows."""
    from tq_torch._src import config, gluon_decode

    import tq_spec

    fmt = tq_spec.layout(preset, 128)
    spec = gluon_decode.decode_spec(fmt, num_tokens=num_tokens, num_q_heads=32, num_kv_heads=8, num_seqs=8,
                                    max_blocks=64, num_splits=num_splits, has_sinks=False)
    assert (spec.merge is None) == fused
    assert spec.tickets == (num_tokens * 8 if fused else 0)
    assert spec.split.constexprs["FUSED_MERGE"] == fused


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ("turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k8v4"))
@pytest.mark.parametrize("num_splits", (1, 3, 4))
def test_gpu_gluon_decode_fused_merge_matches_the_merge_kernel(preset, num_splits, monkeypatch):
    """The last split's merge (one launch) against the merge kernel over the same partials, with sinks, a
    padding row and a row that sees no key; every ticket counter is zero again afterwards."""
    from tq_torch._src import gluon_decode, ops

    # T = B = 4 (decode steps): the 4th sequence has no query token, so row 3 is padding.
    case = _decode_case("fused_merge", (700, 90, 2100, 33), 32, 8, q_lens=(1, 1, 1, 0), sinks=True)
    built = build(case, preset, dev=torch.device("cuda"))
    padded = dataclasses.replace(built, query=torch.cat([built.query, torch.randn_like(built.query[:1])]))
    fused = _run(padded, num_splits=num_splits)
    torch.cuda.synchronize()
    for buf in gluon_decode._TICKETS_KEPT:
        assert not buf.any(), "a ticket counter was left non-zero"
    monkeypatch.setattr(shared_decode, "FUSED_MERGE", False)
    ops._attention_setup.cache_clear()
    try:
        merged = _run(padded, num_splits=num_splits)
    finally:
        ops._attention_setup.cache_clear()
    assert gluon_decode._TICKETS_KEPT, "the fused launch took no ticket counters"
    assert torch.equal(fused[-1], torch.zeros_like(fused[-1]))  # the padding row
    # The same partials summed in another order (fp32, a few ulps of values under 10), then rounded to
    # bf16: at most one bf16 rounding (2**-8 relative, 2**-7 at a binade edge) apart.
    torch.testing.assert_close(fused.float(), merged.float(), rtol=2**-7, atol=1e-5)
    check_against_reference(built, fused[:-1])


@pytest.mark.gpu
def test_gpu_gluon_decode_tickets_made_during_a_capture_are_zeroed_before_use(monkeypatch):
    """A ticket buffer first made inside a CUDA-graph capture is zeroed by a memset that only that graph
    replays. A second graph captured over the same buffer and replayed first must still find its counters
    zero (here the buffer is filled with garbage before each replay)."""
    from tq_torch._src import gluon_decode

    monkeypatch.setattr(gluon_decode, "_TICKETS", {})
    built = build(GUARD_CASE, "turboquant_4bit_nc", dev=torch.device("cuda"))
    _run(built, num_splits=3)  # compiles outside the captures (on another stream than theirs)
    torch.cuda.synchronize()
    graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph in graphs:
        with torch.cuda.graph(graph):
            outs.append(_run(built, num_splits=3))
    born_in_capture = [entry[0] for entry in gluon_decode._TICKETS.values() if not entry[1]]
    assert len(born_in_capture) == 1
    for i in (1, 0):  # the later graph first
        born_in_capture[0].fill_(5)
        outs[i].fill_(float("nan"))
        graphs[i].replay()
        torch.cuda.synchronize()
        check_against_reference(built, outs[i])


def test_ticket_counters_are_zeroed_until_an_eager_launch_has_zeroed_them(monkeypatch):
    """`gluon_decode.ticket_counters`' bookkeeping (the CUDA calls stubbed: CPU buffers, one stream). A
    buffer made during a capture is zeroed again before every use until one outside a capture; a buffer
    made or zeroed outside a capture is trusted (each launch leaves it zero); a larger request replaces
    the buffer and keeps the old one (graphs hold its address)."""
    from tq_torch._src import gluon_decode

    capturing = [True]
    monkeypatch.setattr(gluon_decode, "current_stream", lambda index: 7)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(gluon_decode, "_TICKETS", {})
    monkeypatch.setattr(gluon_decode, "_TICKETS_KEPT", [])
    cpu = torch.device("cpu")
    first = gluon_decode.ticket_counters(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    for still_capturing in (True, False):  # a later capture, then an eager launch: zeroed both times
        capturing[0] = still_capturing
        first.fill_(5)
        assert gluon_decode.ticket_counters(cpu, 10) is first and not first.any()
    first.fill_(5)
    assert gluon_decode.ticket_counters(cpu, 10) is first and bool((first == 5).all())  # trusted now
    bigger = gluon_decode.ticket_counters(cpu, first.numel() + 1)
    assert bigger.numel() > first.numel() and not bigger.any()
    assert gluon_decode._TICKETS_KEPT == [first, bigger]
