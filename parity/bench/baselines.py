"""Baselines timed in the same run: SDPA in torch and jax on contiguous bf16 K/V, and a copy roofline.

* ``sdpa``: `torch.nn.functional.scaled_dot_product_attention` with
  ``enable_gqa=True`` on the row's raw K/V viewed ``[n, Hkv, S, D]``, under
  the FLASH backend (forced through `torch.nn.attention.sdpa_kernel`: with
  GQA the default choice may fall to the math kernel, which would flatter
  every kernel; where flash refuses, e.g. D > 256, the default, noted).
  Prefill (square) groups are causal; the others are not: a decode or
  multi-token query sees (nearly) every key, and a chunk over a long prefix
  differs from its lower-right causal mask by at most chunk^2/2 of chunk*S logits. One call
  per group of equal (q_len, seq_len); a sliding window that a decode row has
  is applied by slicing the last W keys (contiguous), a windowed prefill is
  compared with full causal SDPA, as its goal says.
* ``jax-dpa``: `jax.nn.dot_product_attention` with the same groups,
  ``implementation="cudnn"`` on a GPU, falling back to ``"xla"`` when cuDNN
  refuses (recorded), skipped where the xla version would materialise more
  than `XLA_LOGITS_LIMIT` bytes of logits.
* ``copy``: a device-to-device copy of a large buffer; bytes read + written
  per second is the bandwidth roofline every kernel's bytes are measured
  against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .inputs import RowInputs, to_jax
from .timing import Timing, aot_compile, event_time, jax_timing, loop_time, torch_timing

XLA_LOGITS_LIMIT = 4 * 2**30  # jax's allocator keeps what it grew to; torch runs beside it
COPY_BYTES_GPU = 2 * 2**30
COPY_BYTES_CPU = 32 * 2**20


@dataclass
class Baseline:
    """A timed baseline of one row: name, implementation notes, timing (or why there is none)."""

    name: str
    timing: Timing | None
    notes: str


def _groups(inp: RowInputs):
    """(q ``[n, q, Hq, D]``, k, v ``[n, S', Hkv, D]``, causal) per group; windowed decodes keep the last W keys."""
    w = inp.row.window
    for g in inp.groups:
        causal = g.q_len == g.seq_len and g.q_len > 1
        k, v = g.key, g.value
        if w and not causal and g.seq_len > w:
            k, v = k[:, -w:].contiguous(), v[:, -w:].contiguous()
        yield g.query, k, v, causal


def sdpa(inp: RowInputs, on_gpu: bool, smoke: bool) -> Baseline:
    """torch SDPA bf16 over the row's groups (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls = [(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), c) for q, k, v, c in _groups(inp)]
    notes = []

    def run_one(q, k, v, causal, flash):
        ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    flash = {}
    for i, (q, k, v, causal) in enumerate(calls):
        try:
            run_one(q, k, v, causal, True)
            flash[i] = True
            notes.append("flash (forced)" + (", causal" if causal else ""))
        except Exception as e:  # e.g. D > 256: whatever SDPA picks, recorded
            flash[i] = False
            notes.append(f"flash refused ({type(e).__name__}): default backend" + (", causal" if causal else ""))

    def fn():
        return [run_one(q, k, v, c, flash[i]) for i, (q, k, v, c) in enumerate(calls)]

    try:
        timing = torch_timing(fn, on_gpu=on_gpu, graph=inp.row.graph, smoke=smoke)
    except Exception as e:
        return Baseline("sdpa", None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return Baseline("sdpa", timing, "; ".join(sorted(set(notes))) + f"; {len(calls)} call(s)")


def jax_dpa(inp: RowInputs, on_gpu: bool, smoke: bool) -> Baseline:
    """`jax.nn.dot_product_attention` bf16 over the row's groups, cudnn first on a GPU."""
    import jax

    groups = list(_groups(inp))
    logits = sum(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[1] * 4 for q, k, _, _ in groups)
    args = [(to_jax(q), to_jax(k), to_jax(v)) for q, k, v, _ in groups]
    causal = [c for *_, c in groups]
    last_error = ""
    for impl in (("cudnn", "xla") if on_gpu else ("xla",)):
        if impl == "xla" and logits > XLA_LOGITS_LIMIT:
            return Baseline("jax-dpa", None, f"skipped: xla would hold {logits / 2**30:.1f} GiB of logits"
                            + (f" (cudnn: {last_error})" if last_error else ""))

        def fn(a, impl=impl):
            return [jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation=impl)
                    for (q, k, v), c in zip(a, causal)]

        try:
            compiled, secs = aot_compile(fn, args)
            timing = jax_timing(lambda: compiled(args), compile_s=secs, smoke=smoke)
        except Exception as e:
            last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            continue
        fell = f" (cudnn refused: {last_error})" if last_error else ""
        return Baseline("jax-dpa", timing, f"implementation={impl}{fell}; {len(args)} call(s)")
    return Baseline("jax-dpa", None, f"failed: {last_error}")


def copy_roofline(device, on_gpu: bool, smoke: bool) -> dict:
    """Measured device-to-device copy: ``gbps`` = (bytes read + bytes written) / time."""
    import torch

    n = COPY_BYTES_GPU if on_gpu else COPY_BYTES_CPU
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)

    def fn():
        return dst.copy_(src)

    if on_gpu:
        spread = event_time(fn)
    else:
        spread, _ = loop_time(fn, lambda _: None, smoke=smoke)
    del src, dst
    return {"bytes": n, "median_ms": spread.median_ms, "gbps": 2 * n / (spread.median_ms * 1e-3) / 1e9,
            "how": ("do_bench" if on_gpu else "loop") + f" copy of {n / 2**30:.2f} GiB"}
