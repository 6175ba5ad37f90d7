"""The ``errors`` check: bad inputs (`parity.catalog.bad_inputs`) through every kernel leg.

For one row of the table, each kernel leg is called with ``validate=True``
and with ``validate=False`` (attention rows whose metadata reach a kernel run
on both forced paths, ``decode`` and ``extend``). The calls run in a
`parity.runner.sandbox.Sandbox` child per leg, so a crash becomes a failed
record. The float64 reference (which always validates) gives the expected
exception; the rules are in `parity.catalog.bad_inputs`.

Guard canaries (torch): the cache is a view into a buffer with `GUARD_BLOCKS`
canary-filled blocks on each side, and ``out=`` a view into a buffer with
`GUARD_ROWS` canary rows on each side; every canary byte must survive. In
JAX a kernel cannot reach memory outside its operands through the API, so
the check is on values: the store must leave every slot that no in-range
entry names unchanged (it once wrote an out-of-range slot into another
one), and neither op may change its input cache.

Records: op ``errors``, leg ``torch``/``jax`` (and ``torch|jax`` for their
agreement), path ``<mode>:<attention path>`` (``validated:auto``,
``unvalidated:decode``...). Known failures listed in the row are ``xfailed``.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from tq_spec import reference

from .. import tolerances
from ..catalog.bad_inputs import (PAIR, AsIs, AsNumpy, AsTorch, BadInput, base_problem, error_argument,
                                  reference_outcome, row_by_id)
from ..report.records import FAILED, PASSED, XFAILED, Record

GUARD_BLOCKS = 8  # canary blocks on each side of the torch cache (the base cache has 8 blocks)
GUARD_ROWS = 4  # canary rows on each side of torch's out=
CANARY_BYTE = 0xA5  # the cache's own unused bytes are 0xFF; a write of anything shows
CANARY_BYTE_2 = 0x3C  # the second run of a metadata row: an output that changes with the guard read it
CANARY_FLOAT_BITS = 0x7FA5A5A5  # a NaN payload no kernel computes
# Elements of two legs' outputs for rows without a reference must agree within this (relative to the
# larger magnitude, floored at 1), NaN where the other has NaN: both run in IEEE fp32 (float32 queries)
# and differ only in accumulation order (~1e-6), far below this.
PAIR_RTOL = 1e-3


def attempts(row: BadInput) -> list[tuple[str, str]]:
    """``(mode, path)`` pairs a leg runs for `row` (path None: the op's default)."""
    if row.op == "paged_attention" and row.kind in ("metadata", "valid"):
        return [("validated", "auto"), ("unvalidated", "decode"), ("unvalidated", "extend")]
    return [("validated", "auto"), ("unvalidated", "auto")]


# ============================================================================ child side


_BASES: dict = {}


def _base(seed: int):
    if seed not in _BASES:
        _BASES[seed] = base_problem(seed)
    return _BASES[seed]


def serve(request: dict) -> dict:
    """Sandbox handler: runs one (row, leg, mode, path) and returns what happened."""
    from ..runner import environment

    environment.configure(validate=True)
    row = row_by_id(request["row"])
    base = _base(request["seed"])
    kw = row.call_kwargs(base)
    kw.setdefault("validate", request["mode"] == "validated")
    if row.op == "paged_attention" and request["path"] != "auto":
        kw["path"] = request["path"]
    run = _run_torch if request["leg"] == "torch" else _run_jax
    t0 = time.perf_counter()
    out = run(row, kw)
    out["seconds"] = time.perf_counter() - t0
    return out


def _raised(e: BaseException) -> tuple:
    return (type(e).__name__, error_argument(e), str(e)[:500])


def _is_cache(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 4 and x.shape[0] >= 1


def _run_torch(row: BadInput, kw: dict) -> dict:
    ans = _torch_call(row, kw, CANARY_BYTE)
    if (row.op == "paged_attention" and row.kind == "metadata" and not kw.get("validate")
            and ans["raised"] is None and not ans["problems"] and ans["result"] is not None):
        # Reads leave no trace in the guard; a second run with other guard bytes shows them: an
        # output that depends on the guard's contents was computed from memory outside the cache.
        again = _torch_call(row, kw, CANARY_BYTE_2)
        a, b = ans["result"], again["result"]
        if again["raised"] is not None or b is None:
            ans["problems"].append("a second identical call (other guard bytes) raised or returned nothing")
        elif not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            diff = a.view(np.uint32) != b.view(np.uint32)
            i = tuple(int(x) for x in np.argwhere(diff)[0])
            with np.errstate(all="ignore"):
                zeros_only = bool(np.all((a[diff] == 0) & (b[diff] == 0)))
            note = " (only the sign of zero: guard bytes were loaded and multiplied by 0)" if zeros_only else ""
            ans["problems"].append(
                f"read outside the cache: {int(diff.sum())} output elements differ between two identical calls "
                f"whose only difference is the bytes of the guard around the cache (first at {list(i)}: "
                f"{a[i]:.7g} vs {b[i]:.7g}){note}")
        ans["problems"] += again["problems"]
    return ans


def _torch_call(row: BadInput, kw: dict, canary_byte: int) -> dict:
    import torch

    import tq_torch

    # Uninitialised memory (torch.empty scratch) comes back NaN, deterministically: a kernel that
    # reads scratch it never wrote then shows NaN in both runs instead of whatever the allocator held.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def conv(v):
        if isinstance(v, AsIs) or isinstance(v, AsNumpy):
            return v.value
        if isinstance(v, AsTorch):
            return torch.from_numpy(np.ascontiguousarray(v.value)).to(dev)
        if isinstance(v, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(v)).to(dev)
        return v

    problems = []
    cache_np = kw["kv_cache"] if _is_cache(kw["kv_cache"]) else None
    args = {k: conv(v) for k, v in kw.items() if k != "kv_cache" or cache_np is None}
    buf = None
    if cache_np is not None:
        n = cache_np.shape[0]
        buf = torch.full((n + 2 * GUARD_BLOCKS, *cache_np.shape[1:]), canary_byte, dtype=torch.uint8, device=dev)
        buf[GUARD_BLOCKS:GUARD_BLOCKS + n] = torch.from_numpy(cache_np).to(dev)
        args["kv_cache"] = buf[GUARD_BLOCKS:GUARD_BLOCKS + n]
        buf_before = buf.cpu().numpy().copy()
    out_buf = None
    q = kw.get("query")
    if (row.op == "paged_attention" and row.kind in ("metadata", "valid") and isinstance(q, np.ndarray)
            and q.dtype == np.float32 and q.ndim == 3):
        t = q.shape[0]
        out_buf = torch.full((t + 2 * GUARD_ROWS, *q.shape[1:]), CANARY_FLOAT_BITS, dtype=torch.int32,
                             device=dev).view(torch.float32)
        args["out"] = out_buf[GUARD_ROWS:GUARD_ROWS + t]
    fn = tq_torch.store_kv if row.op == "store_kv" else tq_torch.paged_attention
    try:
        res = fn(**args)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the expected outcome of most rows
        res, raised = None, _raised(e)
    else:
        raised = None
    if buf is not None:
        after = buf.cpu().numpy()
        n = cache_np.shape[0]
        for side, sl in (("before", slice(0, GUARD_BLOCKS)), ("after", slice(GUARD_BLOCKS + n, None))):
            changed = after[sl] != buf_before[sl]
            if changed.any():
                blk, off, head, byte = map(int, np.argwhere(changed)[0])
                problems.append(f"canary: {int(changed.sum())} bytes {side} the cache changed (first: guard block "
                                f"{blk}, offset {off}, head {head}, byte {byte})")
        if row.op == "paged_attention":
            inside = after[GUARD_BLOCKS:GUARD_BLOCKS + n] != buf_before[GUARD_BLOCKS:GUARD_BLOCKS + n]
            if inside.any():
                problems.append(f"paged_attention changed {int(inside.sum())} bytes of its input cache")
    if out_buf is not None:
        bits = out_buf.view(torch.int32).cpu().numpy()
        t = q.shape[0]
        guard = np.concatenate([bits[:GUARD_ROWS], bits[GUARD_ROWS + t:]])
        if (guard != CANARY_FLOAT_BITS).any():
            problems.append(f"canary: {int((guard != CANARY_FLOAT_BITS).sum())} elements of out='s guard rows "
                            "changed (written outside the output)")
    result = None
    if raised is None:
        if row.op == "store_kv":
            result = args["kv_cache"].cpu().numpy().copy() if buf is not None else None
        elif res is not None:
            result = res.detach().float().cpu().numpy().copy()
    return {"raised": raised, "result": result, "problems": problems}


def _run_jax(row: BadInput, kw: dict) -> dict:
    import jax

    import tq_jax

    def conv(v):
        if isinstance(v, AsIs) or isinstance(v, AsNumpy):
            return v.value
        if isinstance(v, AsTorch):
            import torch

            return torch.from_numpy(np.ascontiguousarray(v.value))
        if isinstance(v, np.ndarray):
            # float64/int64 stay numpy (tq_jax takes numpy; without x64 a device_put would narrow them).
            if v.dtype in (np.float64, np.int64):
                return v
            return jax.device_put(v)
        return v

    args = {k: conv(v) for k, v in kw.items()}
    fn = tq_jax.store_kv if row.op == "store_kv" else tq_jax.paged_attention
    problems = []
    try:
        res = jax.block_until_ready(fn(**args))
    except Exception as e:  # noqa: BLE001
        res, raised = None, _raised(e)
    else:
        raised = None
    cache_np = kw["kv_cache"]
    if _is_cache(cache_np) and isinstance(args["kv_cache"], jax.Array):
        if not np.array_equal(np.asarray(args["kv_cache"]), cache_np):
            problems.append(f"{row.op} changed its input cache (not donated)")
    result = None
    if raised is None and res is not None:
        result = np.asarray(res)
        if row.op == "paged_attention":
            result = result.astype(np.float32)
        else:
            result = result.copy()
    return {"raised": raised, "result": result, "problems": problems}


# =========================================================================== parent side


class ErrorsRunner:
    """Runs bad-input rows through kernel legs, one `Sandbox` child per leg (reused across rows)."""

    def __init__(self, seed: int = 0, *, timeout: float = 900.0):
        self.seed = seed
        self.timeout = timeout
        self._sandboxes: dict = {}
        self._base = None
        self._clean_ref = None

    @property
    def base(self):
        if self._base is None:
            self._base = base_problem(self.seed)
        return self._base

    def sandbox(self, leg: str):
        from ..runner.sandbox import Sandbox

        if leg not in self._sandboxes:
            self._sandboxes[leg] = Sandbox("parity.checks.errors:serve", timeout=self.timeout,
                                           label=f"{leg} sandbox")
        return self._sandboxes[leg]

    def close(self) -> None:
        for sb in self._sandboxes.values():
            sb.close()
        self._sandboxes.clear()

    def outcome(self, row: BadInput, leg: str, mode: str, path: str) -> dict:
        """What one leg did with the row (runs in the leg's sandbox)."""
        sb = self.sandbox(leg)
        ans = sb.call({"row": row.id, "leg": leg, "mode": mode, "path": path, "seed": self.seed})
        raised = ans.get("raised")
        unexpected = raised is not None and raised[0] not in ("TypeError", "ValueError", "NotImplementedError")
        if ans.get("crashed") or ans.get("problems") or ans.get("harness") or unexpected:
            # Whatever it damaged (heap, a CUDA context after an illegal address) must not reach the next row.
            sb.restart()
        return ans

    # -- judging ---------------------------------------------------------------------

    def judge(self, row: BadInput, leg: str, mode: str, ans: dict, expected, ref_result) -> tuple[bool, str, str]:
        """``(ok, detail, worst)`` of one leg's answer."""
        if ans.get("crashed"):
            return False, f"crashed: {ans['crashed']}", ""
        if ans.get("harness"):
            return False, f"harness error in the sandbox: {ans['harness']}", ans.get("traceback", "")[-800:]
        raised = ans.get("raised")
        problems = list(ans.get("problems") or ())
        accepted = row.accepted_by(leg)
        if accepted is not None:
            if raised is not None:
                return False, f"raised {raised[0]}: {raised[2][:300]}; this leg accepts the input ({accepted})", ""
            if problems:
                return False, "; ".join(problems), ""
            ok, detail, worst = self._matches_reference(row, ans.get("result"), None, base_call=True)
            return ok, f"accepted by design ({accepted}): {detail}", worst
        must_raise = expected is not None and (mode == "validated" or row.kind in ("argument", "framework"))
        if must_raise:
            want = f"{expected[0]} naming {expected[1]!r}"
            if raised is None:
                return False, f"ran without an error; the reference raises {want}: {expected[2]}", ""
            if (raised[0], raised[1]) != (expected[0], expected[1]):
                return False, f"raised {raised[0]} naming {raised[1]!r} ({raised[2][:200]}); expected {want}", ""
            if problems:
                return False, "; ".join(problems), ""
            return True, f"raised {raised[0]} naming {raised[1]!r}", ""
        if raised is not None:
            if expected is not None and (raised[0], raised[1]) == (expected[0], expected[1]) and not problems:
                return True, f"rejected on the host: {raised[0]} naming {raised[1]!r} (safe)", ""
            extra = f"; {'; '.join(problems)}" if problems else ""
            return False, f"raised {raised[0]}: {raised[2][:300]}{extra}", ""
        if problems:
            return False, "; ".join(problems), ""
        got = ans.get("result")
        if row.kind == "valid":
            return self._matches_reference(row, got, ref_result)
        return self._safe(row, got)

    def _matches_reference(self, row, got, ref_result, *, base_call: bool = False) -> tuple[bool, str, str]:
        kw = dict(self.base.store if row.op == "store_kv" else self.base.attention) if base_call \
            else row.call_kwargs(self.base)
        if base_call and row.op == "paged_attention":
            ref_result = self.clean_reference()
        if row.op == "store_kv":
            if got is None:
                return False, "no cache came back", ""
            cmp = tolerances.compare_store(got, kw["key"], kw["value"], kw["kv_cache"], kw["slot_mapping"],
                                           preset=kw["preset"])
            return cmp.ok, cmp.describe().splitlines()[0] if cmp.ok else cmp.describe(), "; ".join(cmp.problems)
        cmp = _check_attention(got, kw, ref_result)
        return cmp.ok, cmp.describe(), "" if cmp.ok else cmp.worst

    def clean_reference(self) -> np.ndarray:
        """The reference output of the base attention call."""
        if self._clean_ref is None:
            with np.errstate(all="ignore"):
                self._clean_ref = reference.paged_attention(**self.base.attention)
        return self._clean_ref

    def _safe(self, row, got) -> tuple[bool, str, str]:
        """Unvalidated metadata rows that ran: nothing outside the named slots / unaffected rows moved."""
        kw = row.call_kwargs(self.base)
        if row.op == "store_kv":
            if got is None:
                return True, "ran; canaries intact (no cache to compare: not a cache-shaped call)", ""
            return _store_safe(got, kw)
        if got is None:
            return False, "no output came back", ""
        protected = [r for b, rows in enumerate(self.base.rows_of) if row.affected is not None
                     and b not in row.affected for r in rows]
        if not protected:
            return True, "ran; canaries intact, input cache unchanged (no row has a defined output)", ""
        clean = dict(self.base.attention)
        ref = self.clean_reference()
        if got.shape != ref.shape:
            return False, f"output shape {got.shape}, expected {ref.shape}", ""
        merged = ref.astype(np.float32)
        merged[protected] = got[protected]
        cmp = _check_attention(merged, clean, ref)
        detail = (f"ran; canaries intact; rows {protected} of the untouched sequences match the reference: "
                  + cmp.describe())
        return cmp.ok, detail, "" if cmp.ok else cmp.worst


def _check_attention(got, kw, ref):
    args = {k: v for k, v in kw.items() if k not in ("path", "validate")}
    with np.errstate(all="ignore"):
        return tolerances.check_attention(
            got, args["query"], args["kv_cache"], args["block_table"], args["seq_lens"], args["query_start_loc"],
            preset=args["preset"], scale=args.get("scale"), sliding_window=args.get("sliding_window"),
            logits_soft_cap=args.get("logits_soft_cap"), sinks=args.get("sinks"), reference_out=ref)


def _store_safe(got: np.ndarray, kw: dict) -> tuple[bool, str, str]:
    """A store with bad slots: in-range slots hold their token, every other slot is unchanged.

    A slot named twice races: its bytes are unspecified (docs/format.md section 8), so any content
    passes there; the detail says whether it holds one of its tokens or a torn mix of them.
    """
    before = kw["kv_cache"]
    sm = np.asarray(kw["slot_mapping"]).astype(np.int64)
    n_slots = before.shape[0] * before.shape[1]
    in_range = (sm >= 0) & (sm < n_slots)
    clean = np.where(in_range, sm, -1)
    uniq, counts = np.unique(clean[clean >= 0], return_counts=True)
    dups = uniq[counts > 1]
    dropped = int((~in_range & (sm != -1)).sum())
    done = f"ran; {dropped} out-of-range slot(s) not written, in-range slots correct, every other byte unchanged"
    if not len(dups):
        cmp = tolerances.compare_store(got, kw["key"], kw["value"], before, clean, preset=kw["preset"])
        if cmp.ok:
            return True, done, ""
        return False, "store wrote outside the in-range slots or wrote them wrong: " + "; ".join(cmp.problems), \
            "; ".join(cmp.problems)
    # Which token does each duplicated slot hold? Try every assignment first (a clean race).
    choices = [clean]
    for slot in dups:
        idx = np.nonzero(clean == slot)[0]
        nxt = []
        for c in choices:
            for keep in idx:
                alt = c.copy()
                alt[idx] = -1
                alt[keep] = slot
                nxt.append(alt)
        choices = nxt
    for c in choices:
        if tolerances.compare_store(got, kw["key"], kw["value"], before, c, preset=kw["preset"]).ok:
            return True, done + "; the duplicated slot holds one of its tokens", ""
    # A torn slot: accept any bytes there, check everything else.
    p = before.shape[1]
    before_dup = before.copy()
    before_dup[dups // p, dups % p] = got[dups // p, dups % p]
    rest = np.where(np.isin(clean, dups), -1, clean)
    cmp = tolerances.compare_store(got, kw["key"], kw["value"], before_dup, rest, preset=kw["preset"])
    if cmp.ok:
        return True, done + ("; the duplicated slot holds a torn mix of its tokens (unspecified by the "
                             "contract)"), ""
    return False, "store wrote outside the in-range slots or wrote them wrong: " + "; ".join(cmp.problems), \
        "; ".join(cmp.problems)


def _pair(a: dict, b: dict) -> tuple[bool, str]:
    """torch vs jax on one (mode, path): the same error, or outputs that agree."""
    if a.get("crashed") or b.get("crashed") or a.get("harness") or b.get("harness"):
        return False, "a leg crashed or the harness failed (see its record)"
    ra, rb = a.get("raised"), b.get("raised")
    if ra is not None and rb is not None:
        if (ra[0], ra[1]) == (rb[0], rb[1]):
            return True, f"both raise {ra[0]} naming {ra[1]!r}"
        return False, f"torch raises {ra[0]} naming {ra[1]!r}, jax raises {rb[0]} naming {rb[1]!r}"
    if ra is not None or rb is not None:
        who, r = ("torch", ra) if ra is not None else ("jax", rb)
        return None, f"only {who} raised ({r[0]} naming {r[1]!r}); judged per leg"
    x, y = a.get("result"), b.get("result")
    if x is None or y is None:
        return True, "both ran"
    if x.shape != y.shape:
        return False, f"output shapes differ: {x.shape} vs {y.shape}"
    if x.dtype == np.uint8:
        return True, "both ran (caches judged per leg)"
    with np.errstate(all="ignore"):
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
    nan_x, nan_y = np.isnan(x64), np.isnan(y64)
    if (nan_x != nan_y).any():
        i = tuple(int(v) for v in np.argwhere(nan_x != nan_y)[0])
        return False, f"NaN in one leg only, first at {list(i)}: torch {x64[i]:.7g}, jax {y64[i]:.7g}"
    fin = ~nan_x
    inf_mismatch = fin & (np.isinf(x64) | np.isinf(y64)) & (x64 != y64)
    if inf_mismatch.any():
        i = tuple(int(v) for v in np.argwhere(inf_mismatch)[0])
        return False, f"Inf differs at {list(i)}: torch {x64[i]:.7g}, jax {y64[i]:.7g}"
    ok = fin & np.isfinite(x64) & np.isfinite(y64)
    diff = np.where(ok, np.abs(x64 - y64), 0.0)
    allow = PAIR_RTOL * np.maximum(1.0, np.maximum(np.abs(np.where(ok, x64, 0)), np.abs(np.where(ok, y64, 0))))
    if (diff > allow).any():
        i = tuple(int(v) for v in np.argwhere(diff > allow)[0])
        return False, f"outputs differ at {list(i)}: torch {x64[i]:.7g}, jax {y64[i]:.7g}"
    return True, (f"outputs agree (max diff {float(diff.max(initial=0.0)):.3e}, NaN in the same "
                  f"{int(nan_x.sum())} places)")


def check_errors(row: BadInput, legs, runner: ErrorsRunner, case_id: str, preset: str, *,
                 apply_known: bool = True) -> list[Record]:
    """Records of one bad-input row over the kernel legs in `legs` (names).

    With ``apply_known=False`` known failures are reported as plain passes and failures (the pytest
    module applies them as ``xfail(strict=True)`` marks instead).
    """
    expected, ref_result = reference_outcome(row, runner.base)
    kernel = [leg for leg in legs if leg in row.legs]
    recs: list[Record] = []
    answers: dict = {}
    def known(leg, where):
        return row.known_reason(leg, where) if apply_known else None

    for leg in kernel:
        for mode, path in attempts(row):
            ans = runner.outcome(row, leg, mode, path)
            answers[(leg, mode, path)] = ans
            ok, detail, worst = runner.judge(row, leg, mode, ans, expected, ref_result)
            recs.append(_record(row, case_id, preset, leg, f"{mode}:{path}", ok, detail, worst,
                                known(leg, f"{mode}:{path}"), ans.get("seconds", 0.0), (leg,)))
    if set(row.legs) <= set(kernel) and len(row.legs) == 2:
        for mode, path in attempts(row):
            a, b = answers[("torch", mode, path)], answers[("jax", mode, path)]
            ok, detail = _pair(a, b)
            if ok is None:  # one raised (safe host rejection or a failure): the per-leg records judge it
                ok = True
            recs.append(_record(row, case_id, preset, PAIR, f"{mode}:{path}", ok, detail, "" if ok else detail,
                                known(PAIR, f"{mode}:{path}"), 0.0, ("torch", "jax")))
    return recs


def _record(row, case_id, preset, leg, path, ok, detail, worst, known: Optional[str], seconds, legs) -> Record:
    if known is not None:
        if ok:
            return Record(case_id, "errors", leg, path, preset, FAILED,
                          f"xpassed: known failure no longer happens ({known}); remove it from the row's `known` "
                          f"(parity/catalog/bad_inputs.py). Now: {detail}", legs=legs, seconds=seconds)
        return Record(case_id, "errors", leg, path, preset, XFAILED, f"known failure ({known}): {detail}",
                      worst=worst, legs=legs, seconds=seconds, metrics={"known": known})
    return Record(case_id, "errors", leg, path, preset, PASSED if ok else FAILED, detail,
                  worst="" if ok else (worst or detail), legs=legs, seconds=seconds)
