"""CPU-only guard: compile the real (non-interpreted) kernels for sm_90 without a GPU.

The interpreter accepts code the GPU compiler rejects (non-constexpr globals,
branch type mismatches, dot shape limits, shared-memory overflows), so the
interpreted tests alone can pass while every GPU launch fails. This test runs
`tq_torch._src.lowering` in a subprocess (TRITON_INTERPRET must be unset
before triton is imported) for a few variants down to a cubin.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the GPU tests compile every kernel for real")
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    # One mse preset with a 3-bit (straddling) key stream, fp8 keys and one raw preset,
    # D=128 bf16: every kernel (store, tile in both modes, merge) of three formats.
    proc = subprocess.run(
        [sys.executable, "-m", "tq_torch._src.lowering", "--quick", "--only",
         "turboquant_k3v4_nc,turboquant_k8v4,bf16/"],
        env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton build ships no ptxas")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 failing variants" in proc.stdout
    # Dot operands decoded from packed codes go through `kernel_math.mma_operand`, so every
    # mma.sync operand of the attention kernels keeps runs of 2 along k: runs of 4 mean ptxas
    # copies registers around each MMA (`mma_operand`'s docstring).
    ttgir = sorted((tmp_path / "triton-cache").glob("*/paged_attention_kernel.ttgir"))
    assert ttgir, "no attention kernel was compiled"
    for path in ttgir:
        widths = set(re.findall(r"kWidth = (\d+)", path.read_text()))
        assert widths <= {"2"}, f"{path.parent.name}: dot operands with kWidth {sorted(widths)}"
    # The dequant path's attention kernel reads its workspace through a bf16 view: K/V tiles are
    # copied to shared memory as bf16 and feed the dots there. (An int16 view brought each tile
    # into registers for the bitcast and back: H100, 8k prefill 2.20 -> 2.09 ms.)
    float_tiles = [path for path in ttgir if re.search(
        r"async_copy_global_to_local .*: tensor<\d+x\d+x!tt\.ptr<bf16>", path.read_text())]
    assert float_tiles, "no attention kernel copies bf16 K/V tiles (the dequant workspace's float view)"
    # fp8 keys with the hand prefetch ask L2 for the tile after next (`attention_kernel.l2_prefetch`),
    # and only they: the kernels of the other two formats have no prefetch.
    ptx = [path.read_text() for path in sorted((tmp_path / "triton-cache").glob("*/paged_attention_kernel.ptx"))]
    asking = [text for text in ptx if "prefetch.global.L2" in text]
    assert asking, "no attention kernel asks L2 for coming K/V lines (fp8 keys should)"
    assert all("e4m3" in text for text in asking), "a kernel without fp8 keys asks L2 for K/V lines"
