"""The Gluon store (`tq_torch._src.gluon_store`), the store's kernel for 4bit_nc, k3v4_nc and 3bit_nc caches of
bfloat16 K/V at D = 128 on sm_90.

CPU: it compiles for sm_90a with no barrier and no shared-memory store in its tile loop. GPU (``-m gpu``):
`store_kv` takes it by default; the bytes it writes match the float64 reference (fp16 fields exactly, codes up
to the contract's bucket-boundary rule) and the Triton store's, on canary-filled caches, with padding and bad
slots, odd row counts, one kv head or many, pages of 1 to 48 slots, strided inputs, NaN / Inf elements, and
CUDA-graph replay.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import tq_spec
import tq_torch
from parity.tolerances import compare_store
from tq_gluon import store as shared_store
from tq_torch._src import gluon_store, store

PRESETS = gluon_store.PRESETS
ROOT = Path(__file__).resolve().parents[2]

# Compiles the kernel for sm_90a and prints its TTGIR and the SASS of its cubin.
_COMPILE_SM90 = """
import os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import tq_spec
from tq_gluon import store

consts = store.kernel_constexprs(sys.argv[1], num_kv_heads=8, page_size=16)
options = {k: consts.pop(k) for k in ("num_warps", "maxnreg")}
sig = dict(store.kernel_signature("*i64"), **{k: "constexpr" for k in consts})
attrs = {(i,): [["tt.divisibility", 16]] for i in range(10)}
src = GluonASTSource(store.gluon_store_kernel, sig, constexprs=consts, attrs=attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
print(kernel.asm["ttgir"])
print("=== SASS")
path = os.path.join(os.environ["TRITON_CACHE_DIR"], "k.cubin")
open(path, "wb").write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
print(subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout)
"""


@pytest.mark.parametrize("preset", PRESETS)
def test_gluon_store_tile_loop_has_no_barrier(tmp_path, preset):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90, preset], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "cuobjdump" in proc.stderr) and "not found" in proc.stderr:
        pytest.skip("this Triton build ships no ptxas / cuobjdump")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ttgir, sass = proc.stdout.split("=== SASS")
    # The tile loop: from its `scf.for` to the closing brace at its indentation.
    loops = re.findall(r"^( *)scf\.for .*?\n(.*?)^\1\}", ttgir, flags=re.S | re.M)
    assert len(loops) == 1, "one tile loop"
    body = loops[0][1]
    assert body.count("mma") >= 4, "the rotation on the tensor cores, four chunks"
    for op in ("ttg.local_alloc", "ttg.local_store", "gpu.barrier", "ttg.barrier"):
        assert op not in body, f"{op} in the tile loop"
    # One CTA barrier in all: after the rotation operand's store to shared memory, before the loop. (Row
    # scales reach the dot's columns by shuffles, not through shared memory.)
    assert len(re.findall(r"\bBAR\.SYNC", sass)) == 1, "a barrier besides the prologue's"


# --------------------------------------------------------------------------- GPU


def _triton_store(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(shared_store, "ENABLED", False)
        tq_torch.store_kv(*args, **kwargs)


def _inputs(preset, t, hkv, n, p, seed, *, bad_slots=True):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{preset}/{t}/{hkv}/{n}/{p}/{seed}".encode()))
    lay = tq_spec.layout(preset, 128)
    cache = torch.randint(0, 256, (n, p, hkv, lay.slot_bytes), dtype=torch.uint8, generator=gen)
    key = (torch.randn(t, hkv, 128, generator=gen) * 5).to(torch.bfloat16)
    value = (torch.randn(t, hkv, 128, generator=gen) + 0.5).to(torch.bfloat16)
    slots = torch.randperm(n * p, generator=gen)[:t]
    if bad_slots:
        slots[::7] = -1
        slots[3::11] = n * p + 5  # past the cache: written nowhere
    return cache, key, value, slots


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("t,hkv,n,p", [(1, 8, 4, 16), (7, 1, 3, 16), (63, 2, 40, 16), (300, 8, 40, 16),
                                       (1000, 4, 80, 48), (77, 3, 300, 1), (5000, 8, 400, 16)])
def test_gpu_gluon_store_matches_reference_and_the_triton_store(preset, t, hkv, n, p, monkeypatch):
    assert store._takes_gluon(preset, torch.bfloat16, torch.bfloat16, 128, torch.device("cuda"))
    cache, key, value, slots = _inputs(preset, t, hkv, n, p, 0)
    got = cache.cuda()
    tq_torch.store_kv(key.cuda(), value.cuda(), got, slots.cuda(), preset=preset)
    in_cache = torch.where(slots < n * p, slots, -1)  # (the comparison reads slots in the cache only)
    cmp = compare_store(got, key, value, cache, in_cache, preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()
    ref = cache.cuda()
    _triton_store(monkeypatch, key.cuda(), value.cuda(), ref, slots.cuda(), preset=preset)
    # Same bytes as the Triton store but for codes at bucket boundaries (fp32 sums in another order).
    differ = (got != ref).sum().item()
    assert differ <= max(2, got.numel() // 20000), f"{differ} bytes differ from the Triton store"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_gluon_store_nonfinite_and_strided_inputs(preset):
    cache, key, value, slots = _inputs(preset, 200, 4, 20, 16, 1)
    nan, inf = float("nan"), float("inf")
    value[0, 0, 5], value[1, 1, 0], value[2, 0, 127] = nan, inf, -inf
    value[3, 1, 2], value[3, 1, 3] = inf, -inf
    value[8, 2] = nan
    key[4, 0, 7], key[5, 1, 1], key[6, 0, 0] = nan, inf, -inf
    key[9, 3] = 0.0  # a zero key: norm 0
    # K and V as views of wider rows (token stride 2 * Hkv * D), as a fused QKV projection hands them over.
    kv = torch.stack([key, value], dim=2).cuda()  # [T, Hkv, 2, D]
    got = cache.cuda()
    tq_torch.store_kv(kv[:, :, 0], kv[:, :, 1], got, slots.cuda(), preset=preset)
    cmp = compare_store(got, key, value, cache, torch.where(slots < 20 * 16, slots, -1), preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()


@pytest.mark.gpu
@pytest.mark.parametrize("slot_dtype", (torch.int32, torch.int64))
def test_gpu_gluon_store_bad_slots_write_nothing(slot_dtype):
    preset = "turboquant_4bit_nc"
    cache, key, value, _ = _inputs(preset, 64, 8, 4, 16, 2, bad_slots=False)
    for slots in (torch.full((64,), -1), torch.arange(64) + 64, torch.arange(64) - 2**20):
        got = cache.cuda()
        tq_torch.store_kv(key.cuda(), value.cuda(), got, slots.to(slot_dtype).cuda(), preset=preset)
        assert torch.equal(got.cpu(), cache), f"slots {slots[:3].tolist()}...: bytes changed"


@pytest.mark.gpu
def test_gpu_gluon_store_cuda_graph_replay_matches_eager():
    preset = "turboquant_k3v4_nc"
    cache, key, value, slots = _inputs(preset, 129, 8, 40, 16, 3)
    k, v, s = key.cuda(), value.cuda(), slots.cuda()
    eager = cache.cuda()
    tq_torch.store_kv(k, v, eager, s, preset=preset)
    replayed = cache.cuda()
    tq_torch.store_kv(k, v, replayed, s, preset=preset)  # warm: compiled before the capture
    replayed.copy_(cache.cuda())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tq_torch.store_kv(k, v, replayed, s, preset=preset)
    replayed.copy_(cache.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)


@pytest.mark.parametrize("key_bits", (3, 4))
def test_sign_operand_permutes_rows_to_rotated_dims_and_columns_to_lane_dims(key_bits):
    """The kernel's A operand is S with rows in `_rotated_dims` order and columns in `_lane_dims` order: both maps
    are permutations, and a product through them equals the plain one; lane g's codes are the ones its
    stores write (4 bits: rotated dims 32c + 4g .. 32c + 4g + 3 in chunk c; 3 bits: 16g .. 16g + 15)."""
    lane, rotated = gluon_store._lane_dims(), gluon_store._rotated_dims(key_bits)
    assert sorted(lane) == list(range(128)) and sorted(rotated) == list(range(128))
    rng = np.random.default_rng(0)
    signs_t = np.where(rng.random((128, 128)) < 0.5, -1.0, 1.0)
    op = gluon_store._sign_operand(signs_t, key_bits)
    assert op.shape == (128, 128)
    k = rng.standard_normal((5, 128))
    # The kernel: Y^T = op @ K^T with K's dims in lane order; row m of Y^T is rotated dim rotated[m].
    np.testing.assert_allclose((op @ k[:, lane].T).T, (k @ signs_t)[:, rotated], rtol=1e-12, atol=1e-12)
    m = np.arange(128)
    c, g = m // 32, m % 8
    if key_bits == 4:
        assert np.array_equal(rotated // 4, 8 * c + g)
    else:
        assert np.array_equal(rotated // 16, g) and np.array_equal((rotated % 16) // 4, c)


def test_store_takes_the_gluon_kernel_only_where_it_applies():
    cpu = torch.device("cpu")
    assert gluon_store.ineligible("turboquant_4bit_nc", key_dtype=torch.bfloat16, value_dtype=torch.bfloat16,
                                  head_dim=128, device=cpu, default_tables=True) is not None
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        cuda = torch.device("cuda")
        for preset in PRESETS:
            assert store._takes_gluon(preset, torch.bfloat16, torch.bfloat16, 128, cuda)
        assert not store._takes_gluon("turboquant_k8v4", torch.bfloat16, torch.bfloat16, 128, cuda)
        assert not store._takes_gluon("turboquant_4bit_nc", torch.float16, torch.float16, 128, cuda)
        assert not store._takes_gluon("turboquant_4bit_nc", torch.bfloat16, torch.bfloat16, 256, cuda)
