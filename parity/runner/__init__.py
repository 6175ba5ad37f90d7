"""The runner: runs catalog cases through legs and checks, and the command line.

  cli          ``python -m parity`` argument parsing and the top-level flow.
  environment  process set-up before any framework import (Triton interpreter on CPU, JAX memory).
  runner       `Runner`: one case through every requested check and leg -> `Record`s.
  case_run     `CaseRun`: the per-case state shared by the checks (problem, reference output, caches).
  parallel     cases in worker processes (``--jobs``).
  progress     the progress line with an ETA on stderr.
  sandbox      `Sandbox`: a child process for calls that may crash (the errors check's bad metadata).
"""
