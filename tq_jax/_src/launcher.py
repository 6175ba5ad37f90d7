"""Launches of the shared Gluon kernels (`tq_gluon`) inside XLA programs: jaxlib's Triton kernel call.

Triton compiles a kernel to PTX when a call is traced (`compiled`, cached per specialisation), and
`kernel_call` emits the custom call that Pallas' Triton lowering emits on jaxlib > 0.10.2
(``triton_kernel_call_ffi``): jaxlib builds the PTX with its ptxas once per process and launches it on
the computation's stream, so the launch is part of the XLA program (no host work per call, no retrace
across calls of one shape). tq_torch launches the same kernels through Triton's own launcher
(`tq_torch._src.launcher`).

jaxlib's kernel call passes the kernel its buffers in the custom call's order, operands then results,
as the kernel's pointer parameters, then the scalars, then two null pointers for Triton's scratch
parameters: a kernel's pointer parameters must list what it reads before what it writes.
"""

from __future__ import annotations

import functools
import zlib
from typing import Optional

import jax

# The custom call target of jaxlib's Triton kernel call (jaxlib > 0.10.2), and its alignment check of the
# pointers (bytes): XLA's buffers are aligned at least this much, and a launch with one that is not fails.
_TARGET = "triton_kernel_call_ffi"
POINTER_ALIGN = 16


@functools.lru_cache(maxsize=1)
def unavailable() -> Optional[str]:
    """None where this process can compile and launch the Gluon kernels (static), else why not."""
    try:
        from jax._src.lib import gpu_triton
        from jax._src.lib import version as jaxlib_version
    except ImportError:
        return "needs jaxlib's Triton kernel call"
    if jaxlib_version <= (0, 10, 2) or not hasattr(gpu_triton, "TritonKernel"):
        return "needs jaxlib > 0.10.2 with its CUDA plugin"
    try:
        import triton  # noqa: F401
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError:
        return "needs the triton package (3.6 to 3.9) to compile the kernel"
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return "needs a CUDA GPU in this process"
    if not gpus or getattr(gpus[0], "compute_capability", "").split(".")[0] != "9":
        return "built and measured for sm_90 (H100/H200) only"
    return None


@functools.lru_cache(maxsize=128)
def compiled(kernel, signature_items: tuple, constexpr_items: tuple, option_items: tuple, divisible: tuple,
             arch: int) -> tuple:
    """``(name, ptx, shared_bytes)`` of a Gluon ``kernel`` built by Triton for ``sm_<arch>`` (``a`` features on
    sm_90): its runtime parameters' Triton types, constexprs, launch options (num_warps, maxnreg) and the runtime
    parameters (indices) known to be multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = dict(constexpr_items)
    signature = dict(signature_items, **{k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    built = triton.compile(GluonASTSource(kernel, signature, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32), options=dict(option_items))
    return built.metadata.name, built.asm["ptx"], int(built.metadata.shared)


def device_arch() -> int:
    """The first GPU's compute capability as ``10 * major + minor``."""
    major, minor = jax.devices("gpu")[0].compute_capability.split(".")
    return 10 * int(major) + int(minor)


def kernel_call(kernel, *, grid: tuple, signature: dict, constexprs: dict, operands: tuple, results: tuple,
                scalars: tuple, zeroed: dict = None, input_output_aliases: dict = None):
    """Runs a Gluon ``kernel`` on ``operands`` -> its ``results`` (`jax.ShapeDtypeStruct`s), inside the program.

    ``signature``: the kernel's runtime parameters and Triton types, in order (operands' pointers, results'
    pointers, then ``scalars``: Python ints and floats, static); ``constexprs``: its constexprs and launch
    options; ``zeroed``: result index -> bytes jaxlib zeroes before the launch; ``input_output_aliases``: operand
    index -> result index (the result's buffer is the operand's and is not passed to the kernel again).

    Under `jax.vmap` the call runs once per batch element (a scan): the grid and the scalars describe one
    element's shapes, as the kernel was traced. Aliased operands and results pass optimization barriers
    (`_fenced_launch`).
    """
    from jax._src.lib import gpu_triton

    zeroed = zeroed or {}
    options = {k: v for k, v in constexprs.items() if k in ("num_warps", "maxnreg")}
    consts = {k: v for k, v in constexprs.items() if k not in options}
    aliased = set((input_output_aliases or {}).values())
    if aliased and min(aliased) != len(results) - len(aliased):
        raise ValueError("input_output_aliases: the aliased results must come last (jaxlib passes buffers in order)")
    buffers = len(operands) + len(results) - len(aliased)
    if len(signature) != buffers + len(scalars):
        raise ValueError(f"signature: {len(signature)} parameters for {buffers} buffers and {len(scalars)} scalars")
    divisible = tuple(range(buffers)) + tuple(buffers + i for i, v in enumerate(scalars)
                                              if isinstance(v, int) and v % 16 == 0)
    arch = device_arch()
    name, ptx, shared_bytes = compiled(kernel, tuple(signature.items()), tuple(sorted(consts.items())),
                                       tuple(sorted(options.items())), divisible, arch)
    params = [gpu_triton.create_array_parameter(0, POINTER_ALIGN) for _ in operands]
    params += [gpu_triton.create_array_parameter(zeroed.get(i, 0), POINTER_ALIGN)
               for i in range(len(results) - len(aliased))]
    params += [gpu_triton.create_scalar_parameter(v, "fp32" if isinstance(v, float) else "i32") for v in scalars]
    call = gpu_triton.TritonKernelCall(gpu_triton.TritonKernel(name, options["num_warps"], 1, shared_bytes, ptx, "",
                                                               arch), *grid, params)
    opaque = zlib.compress(call.to_proto(name, b""))
    call = functools.partial(jax.ffi.ffi_call(_TARGET, results, input_output_aliases=input_output_aliases,
                                              vmap_method="sequential"), opaque=opaque)
    if not input_output_aliases:
        return call(*operands)
    return _fenced_launch(call, frozenset(input_output_aliases), frozenset(aliased))(*operands)


def _fenced_launch(call, aliased_operands: frozenset, aliased_results: frozenset):
    """``call`` (the custom call of `kernel_call`) with its aliased operands and results behind
    `jax.lax.optimization_barrier`s, and under `jax.vmap` a scan over the batch of such calls.

    Why: XLA's GPU dynamic-slice fusion (on by default in the H200 image's jax 0.11.2) folds a dynamic-slice
    feeding a custom call and a dynamic-update-slice of its result into the call's addresses, ignoring the call's
    operand-to-result aliasing. Inside a scan over stacked caches (``lax.scan`` over a model's layers, or
    ``vmap_method="sequential"``) the kernel then writes into the scanned input while the result slice keeps
    whatever it held: on an H200, a vmapped 4bit_nc store returned 205k wrong bytes of 206k. The barriers keep the
    slice and the update out of the call's fusion; they move no data.
    """

    def fenced(*operands):
        operands = list(operands)
        for i in aliased_operands:
            operands[i] = jax.lax.optimization_barrier(operands[i])
        outs = list(call(*operands))
        for i in aliased_results:
            outs[i] = jax.lax.optimization_barrier(outs[i])
        return outs

    launch = jax.custom_batching.custom_vmap(fenced)

    @launch.def_vmap
    def _one_call_per_element(axis_size, in_batched, *operands):
        del axis_size
        batched = [x for x, b in zip(operands, in_batched) if b]

        def element(carry, xs):
            it = iter(xs)
            return carry, launch(*[next(it) if b else x for x, b in zip(operands, in_batched)])

        _, outs = jax.lax.scan(element, (), batched)
        return outs, [True] * len(outs)

    return launch
