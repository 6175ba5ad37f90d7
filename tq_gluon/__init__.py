"""Gluon kernels for sm_90 (H100 / H200) shared by tq_torch and tq_jax.

Framework-free: the kernels take raw pointers, strides and constexprs, and this package imports only
Triton and `tq_spec`. Each framework adds its own launcher over the same kernel, compiled by the same
Triton: tq_torch through Triton's launcher (`tq_torch._src.gluon_decode`), tq_jax through jaxlib's
Triton kernel call (`tq_jax._src.gluon_decode`).
"""
