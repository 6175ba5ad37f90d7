"""The JAX/Pallas leg (`tq_jax`): GPU arrays on CUDA, interpret-mode Pallas on CPU."""

from __future__ import annotations

import numpy as np

from .base import OPS, KernelModuleLeg, Unavailable, missing_ops


class JaxLeg(KernelModuleLeg):
    """Drives `tq_jax.store_kv` / `tq_jax.paged_attention` (which return new arrays)."""

    name = "jax"

    def __init__(self, module, ops):
        import jax

        self._jax = jax
        super().__init__(module, ops)
        self.backend = jax.default_backend()
        self.interpreted = self.backend == "cpu"

    def describe(self) -> str:
        import jaxlib

        if self.interpreted:
            mode = "Pallas interpret mode"
        else:
            from tq_jax._src.launcher import unavailable

            gluon = unavailable()
            mode = "Pallas Triton lowering; " + ("Gluon decode and store kernels through jaxlib's Triton call"
                                                 if gluon is None else f"no Gluon kernels: {gluon}")
        return (f"jax: tq_jax on jax {self._jax.__version__}, jaxlib {jaxlib.__version__}, "
                f"backend {self.backend} ({mode})")

    def put(self, array):
        a = np.array(array, copy=True)
        if a.dtype == np.int64 and not self._jax.config.jax_enable_x64:
            # Without x64 JAX would narrow silently (with a warning); do it explicitly.
            if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
                raise ValueError("jax leg: int64 data beyond int32 range needs jax_enable_x64")
            a = a.astype(np.int32)
        return self._jax.device_put(a)

    def get(self, x):
        return np.array(x, copy=True)

    def store_kv(self, key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None):
        out = self._mod.store_kv(key, value, kv_cache, slot_mapping, preset=preset,
                                 rotation=rotation, codebook=codebook)
        return self._jax.block_until_ready(out)

    def paged_attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
                        scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                        rotation=None, codebook=None, path="auto"):
        out = self._mod.paged_attention(
            query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
            rotation=rotation, codebook=codebook, path=path,
        )
        return self._jax.block_until_ready(out)

    supports_splits = True

    def paged_attention_splits(self, query, kv_cache, block_table, seq_lens, query_start_loc, *, num_splits: int,
                               preset, scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                               rotation=None, codebook=None):
        # tq_jax's public op picks the split count from shapes; its jitted private entry takes a
        # count (the hook tq_jax's own tests use). It skips the public op's argument checks, which
        # the other paths of the same case run, and gets the constant key-table entries the public
        # op would pass (on a GPU, 4bit_nc batches of 8+ sequences run the packed-operand decode).
        import math

        import tq_spec
        from tq_jax._src.attention import _default_key_entries, _paged_attention, query_rotation
        from tq_jax._src.params import resolve

        lay = tq_spec.layout(preset, int(query.shape[-1]))
        kp = resolve(lay.preset, lay.head_dim, rotation, codebook)
        rot, rotation_scale = query_rotation(lay.preset, lay.head_dim, rotation, kp.rotation, query.dtype)
        out = _paged_attention(
            query, kv_cache, block_table, seq_lens, query_start_loc, sinks, rot, kp.centroids,
            preset_name=lay.preset.name,
            scale=float(1.0 / math.sqrt(lay.head_dim) if scale is None else scale),
            sliding_window=None if sliding_window is None else int(sliding_window),
            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            path="decode", num_splits=int(num_splits), interpret=None, rotation_scale=rotation_scale,
            key_entries=_default_key_entries(lay.preset, lay.head_dim, query.dtype, "decode", rotation, codebook,
                                             num_seqs=int(block_table.shape[0])))
        return self._jax.block_until_ready(out)


def load():
    """A `JaxLeg`, or `Unavailable` with the reason."""
    try:
        import jax  # noqa: F401
    except Exception as e:
        return Unavailable("jax", f"jax not importable: {type(e).__name__}: {e}")
    try:
        import tq_jax
    except Exception as e:
        return Unavailable("jax", f"tq_jax not importable: {type(e).__name__}: {e}")
    missing = missing_ops(tq_jax)
    if len(missing) == len(OPS):
        return Unavailable("jax", "tq_jax provides none of " + ", ".join(OPS) + " (not built yet)")
    return JaxLeg(tq_jax, [op for op in OPS if op not in missing])
