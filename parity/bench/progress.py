"""Progress with an ETA on stderr: a self-overwriting bar on a terminal, one line per step elsewhere.

A step is one timed configuration (row x preset x leg, or a row's baselines);
the ETA is the mean time per step so far times the steps left, which
over-counts early (first compiles) and settles as the run goes.
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


class BenchProgress:
    def __init__(self, total: int, stream=None, width: int = 24, enabled: bool = True):
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width, self.enabled = width, enabled
        self.done = 0
        self.t0 = time.perf_counter()

    def step(self, what: str, result: str = "") -> None:
        """One more step finished: `what` it was and a short `result`."""
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        head = f"{self.done}/{self.total} {_clock(elapsed)} elapsed, ETA {_clock(eta)}"
        if self.tty:
            fill = int(self.width * self.done / self.total)
            bar = "#" * fill + "-" * (self.width - fill)
            self.stream.write(f"\r[{bar}] {head}  {what[:70]:<70}")
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{head}] {what}: {result}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line that must stay visible (a WRONG kernel, a skipped row), with or without the bar."""
        if self.enabled and self.tty:
            self.stream.write("\r" + " " * (self.width + 110) + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()
