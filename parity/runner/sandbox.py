"""A child process that runs risky leg calls, so a crash fails one record instead of the run.

Bad metadata can make an unguarded kernel write outside its buffers: a
segfault, ``free(): invalid pointer``, or silent heap damage that breaks a
later case. `Sandbox` keeps one child per leg (started on first use, with the
parent's environment: interpreter switches and ``TQ_VALIDATE`` are
inherited), sends it one request at a time and waits for the answer. If the
child dies, the request's answer says how (exit code or signal, and the tail
of its stderr); the next request starts a fresh child. A request that runs
past `timeout` kills the child the same way.

The protocol is length-prefixed pickles over the child's stdin/stdout; the
child's own stdout is redirected to its stderr so that stray prints (Triton,
XLA) cannot corrupt it.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

_HEADER = struct.Struct("<Q")


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("sandbox: the other side closed the pipe")
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("sandbox: truncated message")
    return pickle.loads(data)


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


class Sandbox:
    """One child process serving `handler(request) -> answer` (a ``module:function`` name)."""

    def __init__(self, handler: str, *, timeout: float = 600.0, label: str = "sandbox"):
        self.handler = handler
        self.timeout = timeout
        self.label = label
        self._proc: Optional[subprocess.Popen] = None
        self._err = None
        self.starts = 0
        atexit.register(self.close)

    def _start(self) -> None:
        if self._err is not None:
            self._err.close()
        self._err = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "parity.runner.sandbox", self.handler],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=dict(os.environ))
        self.starts += 1

    def _stderr_tail(self, n: int = 1500) -> str:
        if self._err is None:
            return ""
        try:
            self._err.seek(0, os.SEEK_END)
            size = self._err.tell()
            self._err.seek(max(0, size - n))
            return self._err.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def call(self, request: Any) -> dict:
        """The handler's answer (a dict), or ``{"crashed": why}`` if the child died or hung."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        proc = self._proc
        t0 = time.perf_counter()
        try:
            _send(proc.stdin, request)
        except (BrokenPipeError, OSError):
            pass  # the child died at start-up; reported below
        # A reader thread would complicate shutdown; poll the child instead: it answers or exits.
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = self.timeout - (time.perf_counter() - t0)
                if left <= 0:
                    self._kill()
                    return {"crashed": f"{self.label}: no answer within {self.timeout:.0f}s (killed)",
                            "seconds": time.perf_counter() - t0}
                if sel.select(timeout=min(left, 1.0)):
                    break
                if proc.poll() is not None:
                    break
        finally:
            sel.close()
        try:
            answer = _recv(proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            code = proc.wait()
            why = f"{self.label}: child process died ({describe_exit(code)})"
            tail = self._stderr_tail()
            self._proc = None
            return {"crashed": why + (f"; stderr tail: {tail[-600:]}" if tail else ""),
                    "seconds": time.perf_counter() - t0}
        return answer

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self) -> None:
        """Ends the child (the next call starts a fresh one), e.g. after it wrote out of bounds."""
        self.close()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if self._err is not None:
            self._err.close()
            self._err = None


def selftest(request: dict) -> dict:
    """A handler for the sandbox's own tests: echo, exit, abort, segfault or hang on request."""
    what = request.get("do")
    if what == "echo":
        return {"echo": request.get("value"), "pid": os.getpid()}
    if what == "exit":
        os._exit(int(request.get("code", 3)))
    if what == "segv":
        import ctypes

        ctypes.string_at(0)
    if what == "abort":
        os.abort()
    if what == "print":
        print("stray output on stdout", flush=True)  # must not corrupt the protocol
        os.write(1, b"stray bytes on fd 1\n")
        return {"printed": True}
    if what == "sleep":
        time.sleep(float(request.get("seconds", 60)))
        return {"slept": True}
    if what == "raise":
        raise RuntimeError("asked to raise")
    return {"unknown": what}


def _serve(handler_name: str) -> None:
    import importlib

    # Keep the protocol stream private: anything printed (Python or C level) goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proto_in = os.fdopen(os.dup(0), "rb")
    mod_name, fn_name = handler_name.split(":")
    handler = getattr(importlib.import_module(mod_name), fn_name)
    while True:
        try:
            request = _recv(proto_in)
        except EOFError:
            return
        try:
            answer = handler(request)
        except BaseException as e:  # noqa: BLE001 - the parent records it
            answer = {"harness": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        _send(proto_out, answer)


if __name__ == "__main__":
    _serve(sys.argv[1])
