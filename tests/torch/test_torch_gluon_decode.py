"""The Gluon 4-bit decode (`tq_torch._src.gluon_decode`, not dispatched yet).

CPU: it compiles for sm_90a, and its key loop keeps every tile in registers (no shared memory,
no barrier). GPU (``-m gpu``): its output matches the float64 reference through the parity
tolerance, on a garbage-laden cache with shuffled pages and bad block ids past each sequence.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tq_torch_testlib import AttnCase, build, check_against_reference

PRESET = "turboquant_4bit_nc"
ROOT = Path(__file__).resolve().parents[2]


# Compiles the kernel for sm_90a and prints its TTGIR (run without TRITON_INTERPRET: the interpreter
# would take over the reductions' combine functions).
_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from tq_torch._src import gluon_decode

ints = ("stride_qt", "stride_qh", "stride_bt", "stride_cn", "stride_cp", "stride_ch", "num_blocks",
        "num_splits", "num_q_heads")
sig = dict(q_ptr="*bf16", cache_ptr="*i16", cb_ptr="*fp32", bt_ptr="*i32", seq_lens_ptr="*i32",
           part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", **{n: "i32" for n in ints},
           qk_scale="fp32", max_seq_len="i32", G="constexpr")
src = GluonASTSource(gluon_decode.gluon_decode_kernel, sig, constexprs={"G": 4}, attrs={})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=4, maxnreg=gluon_decode.MAXNREG))
print(kernel.asm["ttgir"])
"""


def test_gluon_decode_key_loop_has_no_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton build ships no ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    loops = re.findall(r"scf\.for .*?\n(.*?)\n\s*scf\.yield", proc.stdout, flags=re.S)
    assert len(loops) == 1, f"expected one key loop, found {len(loops)}"
    # (Its layout conversions are all register no-ops: `assert_trivial` fails the compile otherwise.)
    for op in ("ttg.local_alloc", "ttg.local_load", "ttg.local_store", "gpu.barrier"):
        assert op not in loops[0], f"{op} in the key loop"
    assert loops[0].count("tt.dot") == 3  # Q K^T, the squares' ones row, V^T P^T


def _decode_case(name, seq_lens, hq, hkv):
    return AttnCase(name, seq_lens=seq_lens, q_lens=(1,) * len(seq_lens), num_q_heads=hq, num_kv_heads=hkv,
                    head_dim=128, page=16, presets=(PRESET,))


GPU_CASES = (
    _decode_case("lengths_gqa32_8", (1, 5, 15, 16, 17, 33, 4100), 32, 8),
    _decode_case("gqa8_1", (300, 4096), 8, 1),
    _decode_case("gqa16_8", (2000, 77), 16, 8),
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
@pytest.mark.parametrize("num_splits", (1, 3, 16))
def test_gpu_gluon_decode_matches_reference(case, num_splits):
    from tq_torch._src import gluon_decode, params
    from tq_torch._src.rotation import query_rotation, rotate_query

    built = build(case, PRESET, dev=torch.device("cuda"))
    q_rot = rotate_query(built.query, query_rotation(PRESET, 128, None, built.query.dtype, built.query.device))
    out = torch.full_like(built.query, float("nan"))
    gluon_decode.launch_gluon_decode(
        q_rot, out, built.kv_cache, params.default_centroids(PRESET, 128, out.device), built.block_table,
        built.seq_lens, built.query_start_loc, sm_scale=128 ** -0.5, num_splits=num_splits)
    check_against_reference(built, out)
