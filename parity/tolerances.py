"""Every tolerance of the project, in one place (DESIGN.md section 5).

* Store: integer code fields must equal the reference except where the
  reference's pre-quantization value lies within `BOUNDARY_RTOL` (relative to
  the quantity's magnitude, floored at 1) of a bucket boundary; fp16 and fp8
  fields within `FIELD_ULPS` ulp (pass ``field_ulps=0`` where both sides use
  IEEE fp32 and must agree exactly); every byte outside the written slots
  unchanged.
* Attention: a leg is compared with the float64 reference evaluated on the
  same cache bytes. Its max abs error must be at most
  ``ATTENTION_ERROR_FACTOR * (max error of the same math emulated in the leg's
  precision) + floor``. The floor has two terms: one rounding of the output
  dtype at the output's largest magnitude, and the typical fp32 rounding of a
  length-D logit dot product (``sqrt(D) * u32 * |scale| * |q_rot| * |k|``,
  Higham's probabilistic estimate, Cauchy-Schwarz for the sum of |products|)
  propagated through the softmax (an output moves by at most
  ``2 * max|v| * max|d logit|``). The second term matters only for fp32
  compute, where the emulation's own error is a single sample of the same
  size as the leg's and accumulation order differs between kernels.

* NaN and Inf: where the reference's output is NaN or +-Inf (a visible NaN/Inf query, key,
  value or sink propagating, DESIGN.md section 3) the leg must have the same non-finite value;
  a non-finite value anywhere else fails. Bounds are sized on the finite elements.

Inputs may be numpy arrays, torch tensors or jax arrays; nothing here imports
a framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tq_spec import reference
from tq_spec.bits import unpack_bits
from tq_spec.params import quant_params
from tq_spec.quantize import encode_slots
from tq_spec.validation import dtype_name

BOUNDARY_RTOL = 1e-6
FIELD_ULPS = 1
ATTENTION_ERROR_FACTOR = 2.0
# Unit roundoff (half an ulp at 1.0) of each output dtype: the floor term.
_UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def to_numpy(x) -> np.ndarray:
    """numpy view of a numpy / torch / jax array; bf16 is widened to float32."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", "torch.float8_e4m3fn"):
            x = x.float()
        return x.numpy()
    a = np.asarray(x)
    if str(a.dtype) == "bfloat16":
        a = a.astype(np.float32)
    return a


# ----------------------------------------------------------------------------- store


def _fp16_ordinal(b: np.ndarray, exp_mask: int = 0x7C00) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> integers whose difference counts ulps.

    Every NaN maps to one ordinal past +Inf: the contract says a field is NaN, not which NaN
    (numpy's float16 NaN is 0x7E00, the GPU's conversion gives 0x7FFF). Any NaN against a
    number stays far apart.
    """
    u = (b[..., 0].astype(np.int32) | (b[..., 1].astype(np.int32) << 8))
    mag = u & 0x7FFF
    ordinal = np.where(u & 0x8000, -mag, mag)
    return np.where(mag > exp_mask, 0x10000, ordinal)


def _fp8_ordinal(b: np.ndarray) -> np.ndarray:
    u = b.astype(np.int32)
    mag = u & 0x7F
    return np.where(u & 0x80, -mag, mag)


def _bf16_ordinal(b: np.ndarray) -> np.ndarray:
    return _fp16_ordinal(b, 0x7F80)  # same sign-magnitude trick on 16-bit patterns


def _near_boundary_key(y: np.ndarray, midpoints: np.ndarray) -> np.ndarray:
    dist = np.min(np.abs(y[..., None] - midpoints.astype(np.float64)), axis=-1)
    return dist <= BOUNDARY_RTOL * np.maximum(1.0, np.abs(y))


def _near_boundary_value(t: np.ndarray) -> np.ndarray:
    return np.abs(t - np.round(t)) <= BOUNDARY_RTOL * np.maximum(1.0, np.abs(t))


@dataclass
class StoreComparison:
    """Result of `compare_store`. ``problems`` is empty iff ``ok``."""

    preset: str
    slots_written: int
    agreement: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v:.6f}" for k, v in self.agreement.items())
        head = f"store[{self.preset}] {self.slots_written} slots; exact agreement: {rates or 'n/a'}"
        return head if self.ok else head + "\n  " + "\n  ".join(self.problems)


def _compare_ulps(cmp: StoreComparison, name: str, leg_ord, ref_ord, ulps: int, where) -> None:
    diff = np.abs(leg_ord.astype(np.int64) - ref_ord.astype(np.int64))
    cmp.agreement[name] = float(np.mean(diff == 0)) if diff.size else 1.0
    if diff.size and diff.max() > ulps:
        i = np.unravel_index(int(np.argmax(diff)), diff.shape)
        cmp.problems.append(
            f"{name}: {int((diff > ulps).sum())} fields differ by more than {ulps} ulp; worst "
            f"{int(diff[i])} ulp at {where(i)}"
        )


def compare_store(leg_cache, key, value, cache_before, slot_mapping, *, preset, rotation=None,
                  codebook=None, field_ulps: int = FIELD_ULPS) -> StoreComparison:
    """Compares a leg's cache after `store_kv` with the float64 reference.

    Args:
      leg_cache: the cache the leg produced, ``uint8[N, P, Hkv, S]``.
      key, value: the ``[T, Hkv, D]`` inputs given to the leg.
      cache_before: the cache before the store (canary-filled by the test).
      slot_mapping: ``[T]`` slots, -1 = skip.
      field_ulps: allowed ulps on fp16/fp8/bf16 fields (0 demands exact bytes).
    """
    leg = to_numpy(leg_cache)
    before = to_numpy(cache_before)
    k = to_numpy(key).astype(np.float64)
    v = to_numpy(value).astype(np.float64)
    sm = to_numpy(slot_mapping).astype(np.int64)
    d = k.shape[-1]
    params = quant_params(preset, d, rotation=rotation, codebook=codebook)
    lay = params.layout
    p = lay.preset
    cmp = StoreComparison(p.name, int((sm >= 0).sum()))
    if leg.shape != before.shape or leg.dtype != np.uint8:
        cmp.problems.append(f"cache: expected uint8{list(before.shape)}, got {leg.dtype}{list(leg.shape)}")
        return cmp

    keep = sm >= 0
    n_blocks, page = before.shape[:2]
    written = np.zeros(before.shape[:2], bool)
    written[sm[keep] // page, sm[keep] % page] = True
    untouched = ~written
    changed = untouched[..., None, None] & (leg != before)
    if changed.any():
        blk, off, head, byte = map(int, np.argwhere(changed)[0])
        cmp.problems.append(
            f"canary: {int(changed.sum())} bytes outside the written slots changed; first at "
            f"block {blk} offset {off} head {head} byte {byte}: {before[blk, off, head, byte]:#04x} -> "
            f"{leg[blk, off, head, byte]:#04x}"
        )
    if not keep.any():
        return cmp

    tokens = np.nonzero(keep)[0]
    got = leg[sm[keep] // page, sm[keep] % page]  # [n, Hkv, S]
    want, details = encode_slots(k[keep], v[keep], params, details=True)

    def where(i):
        return f"token {tokens[i[0]]} head {i[1]}" + (f" element {i[2]}" if len(i) > 2 else "")

    if p.key_format == "raw":
        raw_ordinal = _bf16_ordinal if p.raw_dtype == "bfloat16" else _fp16_ordinal
        for part, off in (("key", lay.key_offset), ("value", lay.value_offset)):
            g = got[..., off : off + 2 * d].reshape(*got.shape[:-1], d, 2)
            w = want[..., off : off + 2 * d].reshape(*want.shape[:-1], d, 2)
            _compare_ulps(cmp, f"{part}_{p.raw_dtype}", raw_ordinal(g), raw_ordinal(w), field_ulps, where)
        return cmp

    if p.key_format == "fp8":
        _compare_ulps(cmp, "key_fp8", _fp8_ordinal(got[..., :d]), _fp8_ordinal(want[..., :d]), field_ulps, where)
    else:
        gk = unpack_bits(got[..., : lay.key_bytes], p.key_bits, d)
        wk = unpack_bits(want[..., : lay.key_bytes], p.key_bits, d)
        _compare_codes(cmp, "key_codes", gk, wk, _near_boundary_key(details.key_rotated, params.codebook.midpoints), where)
        no = lay.key_norm_offset
        _compare_ulps(cmp, "key_norm_fp16", _fp16_ordinal(got[..., no : no + 2]),
                      _fp16_ordinal(want[..., no : no + 2]), field_ulps, where)
    gv = unpack_bits(got[..., lay.value_offset : lay.value_offset + lay.value_bytes], p.value_bits, d)
    wv = unpack_bits(want[..., lay.value_offset : lay.value_offset + lay.value_bytes], p.value_bits, d)
    _compare_codes(cmp, "value_codes", gv, wv, _near_boundary_value(details.value_position), where)
    for name, off in (("value_scale_fp16", lay.value_scale_offset), ("value_zero_fp16", lay.value_zero_offset)):
        _compare_ulps(cmp, name, _fp16_ordinal(got[..., off : off + 2]), _fp16_ordinal(want[..., off : off + 2]),
                      field_ulps, where)
    return cmp


def _compare_codes(cmp: StoreComparison, name: str, got, want, at_boundary, where) -> None:
    differ = got != want
    cmp.agreement[name] = float(np.mean(~differ)) if differ.size else 1.0
    bad = differ & ~at_boundary
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        cmp.problems.append(
            f"{name}: {int(bad.sum())} codes differ away from a bucket boundary; first at {where(i)}: "
            f"got {int(got[i])}, reference {int(want[i])}"
        )


# ------------------------------------------------------------------------- attention


@dataclass
class AttentionComparison:
    """Result of `check_attention`."""

    max_err: float
    bound: float
    emulated_err: float
    worst: str
    nonfinite: int

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.max_err <= self.bound

    def describe(self) -> str:
        status, rel = ("ok", "<=") if self.max_err <= self.bound else ("FAIL", ">")
        if self.nonfinite:
            status = "FAIL"
        extra = (f"; {self.nonfinite} outputs non-finite where the reference is not, or not the reference's "
                 "NaN/Inf" if self.nonfinite else "")
        return (f"attention {status}: max_err {self.max_err:.3e} {rel} bound {self.bound:.3e} "
                f"(emulated {self.emulated_err:.3e}); worst {self.worst}{extra}")


def attention_bound(emulated_err: float, ref_max_abs: float, out_dtype: str, stats: dict | None = None) -> float:
    """`ATTENTION_ERROR_FACTOR` x emulated error + the floor described in the module docstring.

    `stats` is what `tq_spec.reference.emulate_paged_attention` reports
    (head_dim, scale, max_query_norm, max_key_norm, max_abs_value).
    """
    floor = _UNIT_ROUNDOFF[out_dtype] * max(ref_max_abs, 1e-30)
    if stats:
        logit_err = (np.sqrt(stats["head_dim"]) * _UNIT_ROUNDOFF["float32"] * abs(stats["scale"])
                     * stats["max_query_norm"] * stats["max_key_norm"])
        floor += 2.0 * stats["max_abs_value"] * logit_err
    return ATTENTION_ERROR_FACTOR * emulated_err + floor


@dataclass
class Emulation:
    """The emulated output of one (case, compute dtype) and the magnitudes that size the floor."""

    out: np.ndarray
    stats: dict


def emulate(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset, compute_dtype=None,
            scale=None, sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None,
            codebook=None) -> Emulation:
    """`tq_spec.reference.emulate_paged_attention` in the query's output dtype, for reuse across legs.

    NaN/Inf queries or sinks (which must propagate) would make the magnitudes that size the floor
    non-finite; those are then taken from the same call with the non-finite inputs zeroed.
    """
    out_dtype = dtype_name(query)
    stats: dict = {}
    args = (to_numpy(query), to_numpy(kv_cache), to_numpy(block_table), to_numpy(seq_lens),
            to_numpy(query_start_loc))
    kw = dict(preset=preset, compute_dtype=compute_dtype or out_dtype, out_dtype=out_dtype, scale=scale,
              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
              sinks=None if sinks is None else to_numpy(sinks), rotation=rotation, codebook=codebook)
    out = reference.emulate_paged_attention(*args, stats=stats, **kw)
    if not all(np.isfinite(v) for v in stats.values() if isinstance(v, float)):
        q = args[0]
        finite_q = np.where(np.isfinite(q.astype(np.float32)), q, 0).astype(q.dtype)
        kw["sinks"] = None if sinks is None else np.nan_to_num(kw["sinks"], nan=0.0, posinf=0.0, neginf=0.0)
        stats = {}
        reference.emulate_paged_attention(finite_q, *args[1:], stats=stats, **kw)
    return Emulation(out, stats)


def check_attention(out, query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
                    compute_dtype: str | None = None, scale=None, sliding_window=None,
                    logits_soft_cap=None, sinks=None, rotation=None, codebook=None,
                    reference_out: np.ndarray | None = None,
                    emulation: Emulation | None = None) -> AttentionComparison:
    """Checks a leg's attention output against the float64 reference on the same cache.

    Args:
      out: the leg's ``[T, Hq, D]`` output (its dtype should be the query's).
      query: the query the leg received (its dtype sets the output dtype).
      compute_dtype: the dtype of the leg's dot operands: ``"bfloat16"``,
        ``"float16"``, ``"float32"`` (IEEE) or ``"tfloat32"``; default: the
        query dtype.
      reference_out: a precomputed float64 reference, to avoid recomputing it.
      emulation: a precomputed `emulate(...)` for the same case and compute dtype.
    """
    out_dtype = dtype_name(query)
    compute_dtype = compute_dtype or out_dtype
    args = [to_numpy(query), to_numpy(kv_cache), to_numpy(block_table), to_numpy(seq_lens),
            to_numpy(query_start_loc)]
    kw = dict(preset=preset, scale=scale, sliding_window=sliding_window,
              logits_soft_cap=logits_soft_cap,
              sinks=None if sinks is None else to_numpy(sinks), rotation=rotation, codebook=codebook)
    ref = reference.paged_attention(*args, **kw) if reference_out is None else reference_out
    if emulation is None:
        emulation = emulate(*args, compute_dtype=compute_dtype, **kw)
    emul, stats = emulation.out, emulation.stats
    got = to_numpy(out).astype(np.float64)
    if got.shape != ref.shape:
        return AttentionComparison(np.inf, 0.0, 0.0, f"shape {got.shape} != {ref.shape}", got.size)
    # NaN/Inf where the reference has them is the contract (IEEE propagation from a visible NaN/Inf
    # input); anywhere else, or a different one (NaN for Inf, a finite value for NaN), is a failure.
    ref_fin = np.isfinite(ref)
    same_nonfinite = ~ref_fin & ((np.isnan(ref) & np.isnan(got)) | (np.isinf(ref) & (got == ref)))
    bad_nonfinite = (~np.isfinite(got) & ref_fin) | (~ref_fin & ~same_nonfinite)
    nonfinite = int(bad_nonfinite.sum())
    err = np.where(ref_fin, np.abs(np.where(np.isfinite(got), got, np.inf) - np.where(ref_fin, ref, 0.0)),
                   np.where(same_nonfinite, 0.0, np.inf))
    emul_err = np.abs(emul - ref)
    emulated_err = float(emul_err[ref_fin].max(initial=0.0)) if ref.size else 0.0
    bound = attention_bound(emulated_err, float(np.abs(ref[ref_fin]).max(initial=0.0)) if ref.size else 0.0,
                            out_dtype, stats)
    if ref.size == 0:
        return AttentionComparison(0.0, bound, 0.0, "empty", 0)
    i = np.unravel_index(int(np.argmax(err)), err.shape)
    worst = f"[t={i[0]}, h={i[1]}, d={i[2]}]: got {float(got[i]):.7g}, reference {float(ref[i]):.7g}"
    return AttentionComparison(float(err[i]), bound, emulated_err, worst, nonfinite)
