"""Compile the kernels for a GPU target on a machine without one (a CI guard).

The Triton interpreter accepts code that the GPU compiler rejects (globals
that are not constexpr, type mismatches between branches, dot shape limits,
register blow-ups that ptxas refuses). This module drives the real launchers
with CPU tensors while a stand-in driver reports a CUDA target, so every
kernel variant goes through Triton's whole pipeline down to a cubin (ptxas
ships with Triton); nothing is launched.

Run as ``python -m tq_torch._src.lowering [--quick]`` with TRITON_INTERPRET
unset. Relies on Triton runtime internals (``driver.set_active``,
``JITFunction.run(warmup=...)``), present in Triton 3.6 through 3.9.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Hopper's opt-in shared memory per block (227 KiB); smaller on older GPUs.
_MAX_SHARED_BYTES = 232448


def _install_fake_cuda_driver(arch: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class _CompileOnlyDriver:
        """Just enough of a driver for JITFunction.run(warmup=True)."""

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def __getattr__(self, name):
            raise AttributeError(f"compile-only driver has no {name!r}")

    driver.set_active(_CompileOnlyDriver())
    from tq_torch._src import launcher

    launcher.DIRECT = False  # nothing is launched: every call goes through JITFunction.run below
    original_run = JITFunction.run

    def compile_only_run(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        shared = int(getattr(kernel.metadata, "shared", 0))
        if shared > _MAX_SHARED_BYTES:
            # Launch would fail with OutOfResources on the GPU.
            raise RuntimeError(f"{self.__name__}: needs {shared} bytes of shared memory > {_MAX_SHARED_BYTES}")
        return kernel

    JITFunction.run = compile_only_run


def _variants(quick: bool):
    """(preset, head_dim, query dtype, Hq, Hkv) combinations to compile.

    The GQA group size is a runtime value; only groups > 16 change the decode
    tile height (and > 64 the extend tile), so two group sizes cover the tiles.
    Two kv heads: a cache of one kv head compiles without the L2 prefetch
    (`attention_kernel.l2_prefetch`).
    """
    import torch

    import tq_spec

    out = []
    for preset in tq_spec.PRESET_NAMES:
        mse = tq_spec.get_preset(preset).key_format == "mse"
        dims = (128,) if quick else ((64, 128, 256, 512) if mse else (40, 96, 128, 256, 512))
        for d in dims:
            dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
            for dt in dtypes:
                groups = ((8, 2),) if quick else ((8, 2), (40, 2))
                for hq, hkv in groups:
                    out.append((preset, d, dt, hq, hkv))
    return out


def compile_all(quick: bool = False, arch: int = 90, verbose: bool = True, only=()) -> int:
    """Compiles store + every attention path for every variant; returns the number of failures."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter never runs the GPU compiler")
    _install_fake_cuda_driver(arch)
    import torch

    import tq_spec
    from tq_torch._src import config
    from tq_torch._src.ops import paged_attention_op, store_kv_op

    config.sm_count = lambda device: 132  # no device to ask
    failures = 0
    seen = set()
    for preset, d, dt, hq, hkv in _variants(quick):
        tag = f"{preset}/D={d}/{dt}/G={hq // hkv}"
        if only and not any(x in tag for x in only):
            continue
        lay = tq_spec.layout(preset, d)
        key = (preset, d, dt, hq // hkv)
        if key in seen:
            continue
        seen.add(key)
        t0 = time.time()
        try:
            cache = torch.zeros(2, 16, hkv, lay.slot_bytes, dtype=torch.uint8)
            store_kv_op(torch.zeros(3, hkv, d, dtype=dt), torch.zeros(3, hkv, d, dtype=dt), cache,
                        torch.zeros(3, dtype=torch.int64), preset, None, None)
            q = torch.zeros(3, hq, d, dtype=dt)
            out = torch.empty_like(q)
            bt = torch.zeros(2, 2, dtype=torch.int32)
            sl = torch.tensor([5, 9], dtype=torch.int32)
            qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
            sinks = torch.zeros(hq, dtype=torch.float32)
            # `dequant` keeps a 16-bit workspace: not eligible for float32 queries.
            for path in [p for p in tq_spec.dispatch.PATH_NAMES if not (p == "dequant" and dt == torch.float32)]:
                paged_attention_op(q, cache, bt, sl, qsl, out, sinks, None, None, preset, 0.1, 0, 0.0, path, 0)
                paged_attention_op(q, cache, bt, sl, qsl, out, None, None, None, preset, 0.1, 8, 30.0, path, 0)
            status = f"ok {time.time() - t0:.1f}s"
        except Exception as e:  # report every variant, then fail
            failures += 1
            status = f"FAILED: {type(e).__name__}: {str(e)[:2000]}"
        if verbose:
            print(f"{preset:20s} D={d:<4d} {str(dt):15s} G={hq // hkv:<3d} {status}", flush=True)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one variant per preset")
    parser.add_argument("--only", default="", help="comma-separated substrings: keep matching variants")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    failures = compile_all(quick=args.quick, arch=args.arch, only=[x for x in args.only.split(",") if x])
    print(f"{failures} failing variants")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
