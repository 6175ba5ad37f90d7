"""Internals of tq_jax: Pallas kernels (Triton lowering) and their wrappers."""
