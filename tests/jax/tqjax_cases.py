"""Case builders shared by the tq_jax tests (imported by test modules in this folder).

Attention caches are filled with tq_spec's *reference* store (so attention
tests do not depend on tq_jax.store_kv), on top of NaN-producing garbage:
0xFF bytes decode to NaN as fp8, fp16 and bf16 alike. Unused pages, the unused
tail of each sequence's last page, slots no query may see (outside every
query's window) and the pages unused block-table entries point at all hold
garbage, so any leak shows up as a non-finite or wrong output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tq_spec
from tq_jax._src.attention import _default_key_entries, _paged_attention, query_rotation
from tq_jax._src.params import resolve

GARBAGE_BYTE = 0xFF

# A head dim per preset for CPU tests: 40 exercises the padded (non power of
# two) lanes of the fp8-key and raw presets; mse presets need powers of two.
CPU_HEAD_DIM = {
    "turboquant_k8v4": 40,
    "turboquant_4bit_nc": 64,
    "turboquant_k3v4_nc": 64,
    "turboquant_3bit_nc": 64,
    "bf16": 40,
    "fp16": 64,
}

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def random_tokens(rng, shape, dtype="float32"):
    """Fresh random values (never zeros), with a few large-magnitude channels."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.where(rng.random(shape[-1]) < 0.1, 8.0, 1.0).astype(np.float32)
    return x.astype(DTYPES[dtype])


@dataclass
class AttentionCase:
    preset: str
    query: np.ndarray
    kv_cache: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    kwargs: dict = field(default_factory=dict)  # scale / sliding_window / logits_soft_cap / sinks
    rotation: np.ndarray | None = None
    _reference: np.ndarray | None = field(default=None, repr=False)

    def reference(self) -> np.ndarray:
        """The float64 reference output (computed once per cache content)."""
        if self._reference is None or self._reference_of is not self.kv_cache:
            self._reference = tq_spec.reference.paged_attention(
                self.query, self.kv_cache, self.block_table, self.seq_lens, self.query_start_loc,
                preset=self.preset, rotation=self.rotation, **self.kwargs)
            self._reference_of = self.kv_cache
        return self._reference

    def jax_args(self):
        return tuple(jnp.asarray(a) for a in (self.query, self.kv_cache, self.block_table, self.seq_lens,
                                              self.query_start_loc))

    def jax_kwargs(self):
        kw = dict(self.kwargs)
        if kw.get("sinks") is not None:
            kw["sinks"] = jnp.asarray(kw["sinks"])
        return kw

    @property
    def num_seqs(self) -> int:
        return int(self.block_table.shape[0])


def build_attention_case(rng, *, preset, head_dim, num_q_heads, num_kv_heads, block_size, seq_lens, q_lens,
                         q_dtype="float32", sliding_window=None, logits_soft_cap=None, sinks=False,
                         scale=None, rotation=None, extra_pages=3) -> AttentionCase:
    """A varlen batch over a shuffled, garbage-filled paged cache (`extra_pages` never used)."""
    lay = tq_spec.layout(preset, head_dim)
    b = len(seq_lens)
    pages_per_seq = [max(1, -(-s // block_size)) for s in seq_lens]
    max_blocks = max(pages_per_seq) + 1  # one spare column: an unused entry per row
    used = sum(pages_per_seq)
    n = used + 1 + extra_pages
    ids = rng.permutation(n)[: used + 1]
    garbage_page = int(ids[-1])  # unused block-table entries point here: a real, NaN-filled page
    ids = rng.permutation(ids[:-1])
    table = np.full((b, max_blocks), garbage_page, np.int32)
    at = 0
    for i, cnt in enumerate(pages_per_seq):
        table[i, :cnt] = ids[at : at + cnt]
        at += cnt
    cache = np.full((n, block_size, num_kv_heads, lay.slot_bytes), GARBAGE_BYTE, np.uint8)
    slots_all, keys, values = [], [], []
    for i, s in enumerate(seq_lens):
        j = np.arange(s)
        slots_all.append(table[i, j // block_size].astype(np.int64) * block_size + j % block_size)
        keys.append(random_tokens(rng, (s, num_kv_heads, head_dim)).astype(np.float32))
        values.append(random_tokens(rng, (s, num_kv_heads, head_dim)).astype(np.float32))
    slots = np.concatenate(slots_all)
    k = np.concatenate(keys)
    v = np.concatenate(values)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    if sliding_window is not None:
        # Positions no query of the sequence can see become garbage: the kernels
        # must neither read them into the result nor let their NaNs through.
        keep = []
        for i, (s, ql) in enumerate(zip(seq_lens, q_lens)):
            first_visible = max(0, s - ql - sliding_window + 1) if ql else s
            keep.append(np.arange(s) >= first_visible)
        keep = np.concatenate(keep) if keep else np.zeros(0, bool)
        slots = np.where(keep, slots, -1)
    if slots.size:
        cache = tq_spec.reference.store_kv(k, v, cache, slots, preset=preset, rotation=rotation)
    query = random_tokens(rng, (int(qsl[-1]), num_q_heads, head_dim), q_dtype)
    kwargs = {}
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    if logits_soft_cap is not None:
        kwargs["logits_soft_cap"] = logits_soft_cap
    if sinks:
        kwargs["sinks"] = rng.standard_normal(num_q_heads).astype(np.float32) * 2.0
    if scale is not None:
        kwargs["scale"] = scale
    return AttentionCase(preset, query, cache, table, np.asarray(seq_lens, np.int32), qsl, kwargs, rotation)


def attention_failure(case: AttentionCase, out) -> str | None:
    """None if `out` passes parity.tolerances.check_attention, else the description."""
    from parity.tolerances import check_attention

    out_np = np.asarray(out)
    if out_np.dtype.name == "bfloat16":
        out_np = out_np.astype(np.float32)
    if out_np.shape != case.query.shape or str(np.asarray(out).dtype) != str(case.query.dtype):
        return f"out: expected {case.query.dtype}{list(case.query.shape)}, got {np.asarray(out).dtype}{list(out_np.shape)}"
    res = check_attention(
        out_np, case.query, case.kv_cache, case.block_table, case.seq_lens, case.query_start_loc,
        preset=case.preset, rotation=case.rotation, reference_out=case.reference(), **case.kwargs,
    )
    return None if res.ok else res.describe()


def paths_for(case) -> tuple[str, ...]:
    """The dispatch paths eligible for `case` (``dequant`` needs a 16-bit query)."""
    problem = tq_spec.dispatch.problem_for(case.query, case.kv_cache, case.block_table, preset=case.preset,
                                           sliding_window=case.jax_kwargs().get("sliding_window"))
    return tq_spec.dispatch.eligible_paths(problem)


def skip_if_ineligible(case, path) -> None:
    """Skips (with the dispatch table's reason) a parametrized path that cannot run `case`."""
    if path not in paths_for(case):
        reason = tq_spec.dispatch.PATHS[path].ineligible(tq_spec.dispatch.problem_for(
            case.query, case.kv_cache, case.block_table, preset=case.preset))
        pytest.skip(f"path {path!r} is not eligible here: {reason}")


def attend(case, path, *, num_splits=None, word_view=None):
    """Runs one path on `case` with poisoned outputs (private entry, no re-validation), with the
    constant key-table entries the public op passes (`attention._default_key_entries`: on a GPU,
    decode of 4bit_nc batches of 8+ sequences with a 16-bit query runs its packed-operand tiles)."""
    d = case.query.shape[-1]
    kp = resolve(case.preset, d, case.rotation)
    rot, rotation_scale = query_rotation(tq_spec.get_preset(case.preset), d, case.rotation, kp.rotation,
                                         case.query.dtype)
    kw = case.jax_kwargs()
    scale = kw.get("scale")
    return _paged_attention(
        *case.jax_args(), kw.get("sinks"), rot, kp.centroids, preset_name=case.preset,
        scale=float(1.0 / math.sqrt(d) if scale is None else scale), sliding_window=kw.get("sliding_window"),
        logits_soft_cap=kw.get("logits_soft_cap"), path=path, num_splits=num_splits, interpret=None,
        word_view=word_view, poison=True, rotation_scale=rotation_scale,
        key_entries=_default_key_entries(tq_spec.get_preset(case.preset), d, case.query.dtype, path, case.rotation,
                                         None, num_seqs=int(case.block_table.shape[0])),
    )


def _gluon_launchable() -> bool:
    from tq_jax._src.launcher import unavailable

    try:
        return unavailable() is None
    except Exception:  # noqa: BLE001 (no GPU backend at all)
        return False


# The tests of the shared Gluon kernels (`tq_jax._src.launcher`): they need what the kernels need.
needs_gluon = pytest.mark.skipif(not _gluon_launchable(), reason="needs an sm_90 GPU, jaxlib > 0.10.2 and triton")


class CountingTraces:
    """Counts the calls of ``module.name`` (patched through ``monkeypatch``) from a clean jit cache: the traces
    of the ops that reach it."""

    def __init__(self, monkeypatch, module, name: str):
        import jax

        self.calls = 0
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        jax.clear_caches()
