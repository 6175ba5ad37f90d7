"""The timed legs: tq_torch and tq_jax behind one interface, through their public ops only.

Each leg turns (row inputs, cache, preset) into a `Prepared` call: ``first()``
runs it once for the correctness gate (torch writes into a NaN-filled output
buffer), ``time()`` measures it (`parity.bench.timing`). jax calls are
compiled ahead of time; compile seconds are kept apart from the kernel time.
Availability and the attention compute dtype come from the parity legs
(`parity.legs`), so the bench and the parity suite agree on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

import tq_spec

from ..legs import Unavailable, load_leg
from .inputs import POISON_BYTE, RowInputs, host, to_jax
from .timing import Timing, aot_compile, jax_timing, torch_timing


@dataclass
class Prepared:
    """One ready-to-run configuration of a leg.

    first: () -> output (attention: ``[T, Hq, D]``; store: the cache) of the gated call.
    time: (graph: bool) -> `Timing` of repeated calls.
    sampled: (output, rows or pages as numpy ints) -> numpy copy of those rows / pages.
    all_finite: output -> whether every element is finite.
    """

    first: Callable[[], object]
    time: Callable[[bool], Timing]
    sampled: Callable[[object, np.ndarray], np.ndarray]
    all_finite: Callable[[object], bool]
    compile_s: float | None = None


class TorchBench:
    """tq_torch (CUDA tensors on a GPU, the Triton interpreter on CPU)."""

    name = "torch"

    def __init__(self, leg, on_gpu: bool, smoke: bool):
        import torch
        import tq_torch

        self.leg, self.on_gpu, self.smoke = leg, on_gpu, smoke
        self.torch, self.ops = torch, tq_torch

    def _prepared(self, first, call) -> Prepared:
        torch = self.torch

        def sampled(out, idx):
            return host(out.index_select(0, torch.from_numpy(idx.astype(np.int64)).to(out.device)))

        return Prepared(first, lambda graph: torch_timing(call, on_gpu=self.on_gpu, graph=graph, smoke=self.smoke),
                        sampled, lambda out: bool(torch.isfinite(out.float()).all()))

    def attention(self, inp: RowInputs, cache, preset: str) -> Prepared:
        torch, ops = self.torch, self.ops
        args = (inp.query, cache, inp.block_table, inp.seq_lens, inp.query_start_loc)
        kw = dict(preset=preset, sliding_window=inp.row.window)

        def first():
            poisoned = torch.full_like(inp.query, float("nan"))
            return ops.paged_attention(*args, out=poisoned, **kw)

        return self._prepared(first, lambda: ops.paged_attention(*args, **kw))

    def store(self, inp: RowInputs, preset: str) -> Prepared:
        torch, ops = self.torch, self.ops
        key, value, slots = inp.store_kv_inputs()
        cache = inp.new_cache(tq_spec.layout(preset, inp.row.geometry.head_dim).slot_bytes)
        sm = torch.from_numpy(slots.astype(np.int32)).to(inp.device)

        def call():
            return ops.store_kv(key, value, cache, sm, preset=preset)

        return self._prepared(call, call)


class JaxBench:
    """tq_jax (Pallas Triton lowering and, on sm_90, the shared Gluon kernels on a GPU; interpret mode on CPU);
    calls compiled ahead of time."""

    name = "jax"

    def __init__(self, leg, smoke: bool):
        import jax
        import jax.numpy as jnp
        import tq_jax

        self.leg, self.smoke = leg, smoke
        self.jax, self.jnp, self.ops = jax, jnp, tq_jax

    def _prepared(self, first, call, compile_s) -> Prepared:
        jnp = self.jnp
        return Prepared(first, lambda graph: jax_timing(call, compile_s=compile_s, smoke=self.smoke),
                        lambda out, idx: np.asarray(out[jnp.asarray(idx.astype(np.int32))]),
                        lambda out: bool(jnp.isfinite(out.astype(jnp.float32)).all()), compile_s)

    def attention(self, inp: RowInputs, cache, preset: str) -> Prepared:
        ops, window = self.ops, inp.row.window
        args = (inp.jax("query"), to_jax(cache), inp.jax("block_table"), inp.jax("seq_lens"),
                inp.jax("query_start_loc"))

        def fn(*a):
            return ops.paged_attention(*a, preset=preset, sliding_window=window)

        compiled, secs = aot_compile(fn, *args)
        return self._prepared(lambda: compiled(*args), lambda: compiled(*args), secs)

    def store(self, inp: RowInputs, preset: str) -> Prepared:
        jnp, ops = self.jnp, self.ops
        key, value, slots = inp.store_kv_inputs()
        k, v = to_jax(key), to_jax(value)
        sm = jnp.asarray(slots.astype(np.int32))
        g = inp.row.geometry
        shape = (inp.batch.num_blocks, inp.row.page, g.num_kv_heads, tq_spec.layout(preset, g.head_dim).slot_bytes)
        cache0 = jnp.full(shape, POISON_BYTE, jnp.uint8)

        def fn(k, v, c, s):
            return ops.store_kv(k, v, c, s, preset=preset)

        # The cache is donated and threaded through the calls, as a model step would.
        compiled, secs = aot_compile(fn, k, v, cache0, sm, donate_argnums=(2,))
        state = {"cache": cache0}

        def call():
            state["cache"] = compiled(k, v, state["cache"], sm)
            return state["cache"]

        return self._prepared(call, call, secs)


def load_bench_legs(names, on_gpu: bool, smoke: bool) -> tuple[list, list[str]]:
    """(bench legs that can run here, 'name: reason' for those that cannot)."""
    legs, missing = [], []
    for name in names:
        leg = load_leg(name)
        if isinstance(leg, Unavailable):
            missing.append(f"{name}: {leg.reason}")
            continue
        try:
            legs.append(TorchBench(leg, on_gpu, smoke) if name == "torch" else JaxBench(leg, smoke))
        except Exception as e:  # pragma: no cover - import problems are reported, not raised
            missing.append(f"{name}: {type(e).__name__}: {e}")
    return legs, missing


def compute_dtype(bench_leg) -> str | None:
    """The leg's attention dot dtype for bf16 queries (what the tolerance emulates)."""
    return bench_leg.leg.compute_dtype("bfloat16")
