"""Internals of tq_torch: Triton kernels, launchers, op registration."""
