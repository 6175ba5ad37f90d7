"""Chunking invariance: one prefill == the same tokens stored and attended in chunks.

For each chunk size, the prefix of every sequence is stored once, then the
query tokens are stored and attended ``chunk`` at a time (all sequences in
lockstep, so later steps also exercise q_len 0 rows). The final cache must be
byte-identical to the one-shot store, and the concatenated outputs must match
the one-shot output within the two comparisons' bounds.
"""

from __future__ import annotations

import numpy as np

from tq_spec import reference

from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, LegError, attention_metrics, failed_by, timed
from .paths import max_diff


def _chunk_plan(seqs, chunk: int):
    """Per step: for each sequence the positions ``[lo, hi)`` stored and queried."""
    steps = []
    starts = [s - q for s, q in seqs]
    done = [0] * len(seqs)
    while any(done[b] < q for b, (_, q) in enumerate(seqs)):
        step = []
        for b, (s, q) in enumerate(seqs):
            lo = starts[b] + done[b]
            hi = starts[b] + min(q, done[b] + chunk)
            step.append((lo, hi))
            done[b] = hi - starts[b]
        steps.append(step)
    return steps


def _store_positions(run: CaseRun, leg: Leg, dev_cache, spans):
    """Stores positions ``spans[b] = (lo, hi)`` of every sequence into the leg cache."""
    pr = run.problem
    rows_k, rows_v, rows_s = [], [], []
    for b, (lo, hi) in enumerate(spans):
        rows_k.append(pr.seq_keys[b][lo:hi])
        rows_v.append(pr.seq_values[b][lo:hi])
        rows_s.append(pr.batch.slots[b][lo:hi])
    slots = np.concatenate(rows_s).astype(pr.case.slot_dtype)
    if slots.size == 0:
        return dev_cache
    try:
        return leg.store_kv(leg.put(np.concatenate(rows_k)), leg.put(np.concatenate(rows_v)), dev_cache,
                            leg.put(slots), **pr.store_kwargs())
    except Exception as e:
        raise LegError(f"{leg.name}.store_kv", e) from e


def chunked_run(run: CaseRun, leg: Leg, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix stored once, then the query tokens stored and attended `chunk` at a time.

    Returns (output ``[T, Hq, D]`` in the one-shot row order, final cache).
    """
    pr = run.problem
    case = pr.case
    dev = leg.put(pr.cache_before)
    dev = _store_positions(run, leg, dev, [(0, s - q) for s, q in case.seqs])
    if pr.hidden_slots.size:
        # Slots no query may see are all in the prefix: poison them as in one-shot.
        dev = leg.put(pr.hide(leg.get(dev)))
    per_seq = [[] for _ in case.seqs]
    kw = pr.attention_kwargs()
    kw["sinks"] = None if pr.sinks is None else leg.put(pr.sinks)
    for step in _chunk_plan(case.seqs, chunk):
        dev = _store_positions(run, leg, dev, step)
        q_rows = [pr.seq_queries[b][lo - (s - q):hi - (s - q)] for b, ((lo, hi), (s, q)) in enumerate(zip(step, case.seqs))]
        q_lens = [len(r) for r in q_rows]
        query = np.concatenate(q_rows)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        seq_lens = np.array([hi for lo, hi in step], dtype=np.int32)
        try:
            out = leg.get(leg.paged_attention(leg.put(query), dev, leg.put(pr.block_table), leg.put(seq_lens),
                                              leg.put(qsl), path="auto", **kw))
        except Exception as e:
            raise LegError(f"{leg.name}.paged_attention (chunk {chunk})", e) from e
        for b in range(len(case.seqs)):
            per_seq[b].append(out[qsl[b]:qsl[b + 1]])
    out = np.concatenate([np.concatenate(rows) if rows else np.zeros((0,) + pr.query.shape[1:], pr.query.dtype)
                          for rows in per_seq]) if per_seq else pr.query[:0]
    return out, leg.get(dev)


def check_chunking(run: CaseRun, leg: Leg, chunks) -> list[Record]:
    """Chunked store+attend == one-shot (same final bytes; outputs within bounds of the reference)."""
    records = []
    pr = run.problem
    try:
        once_cache = pr.hide(run.store(leg))
        once_ref = reference_on_bytes(run, once_cache)
        once_out = run.ref_out if leg.oracle else run.auto_output(leg, once_cache)[0]
        once_cmp = run.compare(leg, once_out, once_cache, ref_out=once_ref)
    except Exception as e:
        return [failed_by(run, "chunking", leg.name, f"chunk={c}", e) for c in chunks]
    for chunk in chunks:
        def go(chunk=chunk):
            path = f"chunk={chunk}"
            try:
                out, cache = chunked_run(run, leg, chunk)
                cache = pr.hide(cache)
                if not np.array_equal(cache, once_cache):
                    n = int(np.sum(cache != once_cache))
                    return run.record("chunking", leg.name, path, FAILED,
                                      f"final cache differs from the one-shot store in {n} bytes")
                cmp = run.compare(leg, out, cache, ref_out=once_ref)
            except Exception as e:
                return failed_by(run, "chunking", leg.name, path, e)
            diff, where = max_diff(out, once_out)
            allowed = cmp.bound + once_cmp.bound
            ok = cmp.ok and diff <= allowed
            detail = (f"chunked vs one-shot max diff {diff:.3e} (allowed {allowed:.3e}); " + cmp.describe())
            return run.record("chunking", leg.name, path, PASSED if ok else FAILED, detail,
                              metrics={"max_diff": diff, "allowed": allowed, **attention_metrics(cmp)},
                              worst="" if ok else (cmp.worst if not cmp.ok else where))
        records += timed(go)
    return records


def reference_on_bytes(run: CaseRun, cache: np.ndarray):
    """Reference output on `cache` (reusing the case's if the bytes are the reference's)."""
    ref = run.reference_on(cache)
    if ref is None:
        pr = run.problem
        with np.errstate(all="ignore"):
            ref = reference.paged_attention(pr.query, cache, *pr.attention_args()[1:], **pr.attention_kwargs())
    return ref
