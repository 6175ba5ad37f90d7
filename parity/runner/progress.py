"""A dependency-free progress display on stderr.

On a terminal: one self-overwriting bar. Elsewhere (CI logs): one line per
case, so a slow or hanging case is visible in the log.
"""

from __future__ import annotations

import sys
import time

from ..report.records import FAILED, tally
from ..report.report import failure_text


class Progress:
    """Callable as the runner's ``on_case(done, total, case, records, seconds)``."""

    def __init__(self, stream=None, width: int = 28, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.failed = 0
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int, case, records, seconds: float) -> None:
        failed = [r for r in records if r.status == FAILED]
        self.failed += len(failed)
        if not self.enabled:
            return
        if failed:
            # Failures are printed as they happen, so an interrupted run still shows them.
            if self.tty:
                self.stream.write("\r" + " " * (self.width + 90) + "\r")
            for r in failed:
                self.stream.write(failure_text(r) + "\n")
        t = tally(records)
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            fill = int(self.width * done / max(total, 1))
            bar = "#" * fill + "-" * (self.width - fill)
            line = f"\r[{bar}] {done}/{total} {elapsed:6.0f}s failed {self.failed}  {case.id[:60]:<60}"
            self.stream.write(line)
            if done == total:
                self.stream.write("\n")
        else:
            self.stream.write(
                f"[{done}/{total} {elapsed:.0f}s] {case.id}: {t['passed']} passed, {t['failed']} failed, "
                f"{t['skipped']} skipped ({seconds:.1f}s)\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
