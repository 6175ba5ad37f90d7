"""One result row: a case x op x leg x path, with its status and evidence."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PASSED, FAILED, SKIPPED, UNAVAILABLE = "passed", "failed", "skipped", "unavailable"
# A known failure, tracked in the catalog with its reason (pytest's strict xfail): it does not fail
# the run, and a known failure that passes is reported as a failure (``xpassed``) so the mark goes.
XFAILED = "xfailed"
STATUSES = (PASSED, FAILED, SKIPPED, UNAVAILABLE, XFAILED)


@dataclass
class Record:
    """The outcome of one comparison.

    Attributes:
      case_id: the case's stable id.
      op: the comparison (store, attention, paths, cross, cross-store, e2e,
        interchange, chunking, model, case).
      leg: the leg (``torch``), a pair compared directly (``torch|jax``) or a
        writer->reader pair (``jax->torch``).
      path: the attention path (``auto``, ``decode``, ...), ``chunk=N`` or ``-``.
      preset: the preset of the comparison (a model layer's own preset).
      status: one of `STATUSES`; ``unavailable`` counts as skipped; ``xfailed`` is a
        known failure (the detail gives its reason).
      detail: the comparison's description, or the skip reason.
      metrics: numbers (errors, bounds, agreement rates) for the JSON report.
      worst: the worst element (index, values, error) of a failed comparison.
      legs: the legs needed to reproduce it (for the repro line).
      layer: the model layer, if any.
      repro: the one-line command that re-runs the case (set by the runner).
      seconds: wall time of the comparison.
    """

    case_id: str
    op: str
    leg: str
    path: str
    preset: str
    status: str
    detail: str = ""
    metrics: dict = field(default_factory=dict)
    worst: str = ""
    legs: tuple = ()
    layer: str = ""
    repro: str = ""
    seconds: float = 0.0

    @property
    def counted_as(self) -> str:
        """passed / failed / skipped (unavailable counts as skipped)."""
        return SKIPPED if self.status == UNAVAILABLE else self.status

    def to_json(self) -> dict:
        d = asdict(self)
        d["legs"] = list(self.legs)
        return d


def tally(records) -> dict[str, int]:
    """Counts of passed / failed / skipped (and known failures, ``xfailed``, when there are any)."""
    out = {PASSED: 0, FAILED: 0, SKIPPED: 0}
    for r in records:
        out[r.counted_as] = out.get(r.counted_as, 0) + 1
    return out


def final_line(records) -> str:
    """The last line the CLI prints."""
    t = tally(records)
    known = f", {t[XFAILED]} known failures (xfailed)" if t.get(XFAILED) else ""
    return f"parity: {t[PASSED]} passed, {t[FAILED]} failed, {t[SKIPPED]} skipped{known}"
