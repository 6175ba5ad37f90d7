"""Comparisons between two legs: direct output agreement, cache bytes, cache interchange."""

from __future__ import annotations

import numpy as np

import tq_spec

from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, attention_metrics, failed_by, timed
from .paths import max_diff


def check_cross(run: CaseRun, a: Leg, b: Leg) -> list[Record]:
    """Two legs' auto outputs on the same bytes agree within the sum of their bounds."""
    def go():
        pair = f"{a.name}|{b.name}"
        oa = run.outputs.get(a.name, {}).get(run.auto_path(a))
        ob = run.outputs.get(b.name, {}).get(run.auto_path(b))
        if oa is None or ob is None:
            missing = a.name if oa is None else b.name
            return run.record("cross", pair, "auto", FAILED, f"{missing} produced no auto-path output",
                              legs=(a.name, b.name))
        diff, where = max_diff(oa[0], ob[0])
        allowed = oa[1].bound + ob[1].bound
        ok = diff <= allowed
        detail = f"max |{a.name} - {b.name}| {diff:.3e} <= {allowed:.3e}" if ok else (
            f"max |{a.name} - {b.name}| {diff:.3e} > allowed {allowed:.3e} at {where}")
        return run.record("cross", pair, "auto", PASSED if ok else FAILED, detail, legs=(a.name, b.name),
                          metrics={"max_diff": diff, "allowed": allowed}, worst="" if ok else where)
    return timed(go)


def _fp_fields(lay: tq_spec.Layout) -> list[tuple[str, int, int, int]]:
    """(name, byte offset, element bytes, count) of every floating-point field of a slot."""
    p, d = lay.preset, lay.head_dim
    if p.key_format == "raw":
        return [("key", lay.key_offset, 2, d), ("value", lay.value_offset, 2, d)]
    out = []
    if p.key_format == "fp8":
        out.append(("key_fp8", lay.key_offset, 1, d))
    else:
        out.append(("key_norm", lay.key_norm_offset, 2, 1))
    out += [("value_scale", lay.value_scale_offset, 2, 1), ("value_zero", lay.value_zero_offset, 2, 1)]
    return out


def _ordinal(raw: np.ndarray, width: int) -> np.ndarray:
    if width == 1:
        u = raw.astype(np.int64)
        sign, mag = u & 0x80, u & 0x7F
    else:
        u = raw[..., 0].astype(np.int64) | (raw[..., 1].astype(np.int64) << 8)
        sign, mag = u & 0x8000, u & 0x7FFF
    return np.where(sign != 0, -mag, mag)


def check_cross_store(run: CaseRun, a: Leg, b: Leg) -> list[Record]:
    """Two legs' cache bytes: fp fields equal (see module docstring), codes as vetted by `store`."""
    def go():
        pair = f"{a.name}|{b.name}"
        try:
            ca, cb = run.store(a), run.store(b)
        except Exception as e:
            return failed_by(run, "cross-store", pair, "-", e, legs=(a.name, b.name))
        pr = run.problem
        sm = pr.slot_mapping.astype(np.int64)
        sm = sm[sm >= 0]
        p = pr.case.block_size
        sa, sb = ca[sm // p, sm % p], cb[sm // p, sm % p]
        lay = pr.layout
        interp = a.interpreted or b.interpreted
        problems, metrics = [], {"byte_agreement": float(np.mean(sa == sb)) if sa.size else 1.0}
        for name, off, width, count in _fp_fields(lay):
            fa = sa[..., off:off + width * count].reshape(*sa.shape[:-1], count, width)
            fb = sb[..., off:off + width * count].reshape(*sb.shape[:-1], count, width)
            ulps = np.abs(_ordinal(fa if width == 2 else fa[..., 0], width) - _ordinal(fb if width == 2 else fb[..., 0], width))
            allowed = 1 if (name == "key_norm" or (name == "key_fp8" and interp)) else 0
            metrics[f"{name}_agreement"] = float(np.mean(ulps == 0)) if ulps.size else 1.0
            if ulps.size and ulps.max() > allowed:
                i = np.unravel_index(int(np.argmax(ulps)), ulps.shape)
                problems.append(f"{name}: {int((ulps > allowed).sum())} fields differ by more than {allowed} "
                                f"ulp; worst {int(ulps[i])} ulp at token-slot {i[0]} head {i[1]}")
        ok = not problems
        detail = ("fp fields agree; byte agreement {:.6f}".format(metrics["byte_agreement"]) if ok
                  else "; ".join(problems))
        return run.record("cross-store", pair, "-", PASSED if ok else FAILED, detail, legs=(a.name, b.name),
                          metrics=metrics, worst="" if ok else problems[0])
    return timed(go)


def check_interchange(run: CaseRun, writer: Leg, reader: Leg) -> list[Record]:
    """A cache written by `writer` and read by `reader` vs the reference on those bytes."""
    def go():
        name = f"{writer.name}->{reader.name}"
        try:
            cache = run.problem.hide(run.store(writer))
            out, reused = run.auto_output(reader, cache)
            cmp = run.compare(reader, out, cache)
        except Exception as e:
            return failed_by(run, "interchange", name, "auto", e, legs=(writer.name, reader.name))
        note = f" ({writer.name} wrote the reference's exact bytes)" if reused else ""
        return run.record("interchange", name, "auto", PASSED if cmp.ok else FAILED, cmp.describe() + note,
                          legs=(writer.name, reader.name), metrics=attention_metrics(cmp),
                          worst="" if cmp.ok else cmp.worst)
    return timed(go)
