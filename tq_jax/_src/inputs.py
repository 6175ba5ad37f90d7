"""Argument normalisation shared by the public ops (before `tq_spec.validation`).

* Arrays must be jax arrays (tracers included) or numpy arrays. Anything else
  that looks like an array (a torch tensor, a cupy array) is a `TypeError`
  naming the argument: tq_jax never guesses a device transfer or a copy
  semantics (torch updates caches in place, tq_jax returns new ones).
* Integer metadata given as numpy arrays (values on the host) is converted to
  int32 when that is lossless, else a `ValueError` naming the argument. jax
  arrays are left as they are (reading device values would sync), so a jax
  int64 block table still gets validation's clear dtype error.
* `not_differentiable` turns `jax.jvp`/`jax.grad` through an op into a
  `NotImplementedError` naming the op, instead of an assertion deep in Pallas.
"""

from __future__ import annotations

import jax
import numpy as np

_INT32 = np.iinfo(np.int32)


def array(name: str, x, *, optional: bool = False):
    """`x` itself if it is a jax or numpy array (None too when `optional`), else TypeError."""
    if x is None and optional:
        return None
    if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "__jax_array__"):
        return x
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    hint = ""
    if type(x).__module__.split(".")[0] == "torch":
        hint = ("; tq_jax does not take torch tensors: convert with jax.dlpack.from_dlpack(tensor) "
                "(zero-copy on the same device) or tensor.numpy(), or call tq_torch instead")
    raise TypeError(f"{name}: expected a jax.Array or numpy.ndarray, got {kind}{hint}")


def index_array(name: str, x):
    """Integer metadata: numpy integer arrays become int32 when lossless.

    Returns `x` unchanged for jax arrays and for numpy arrays that are already
    int32 or not integers (validation reports the dtype then).

    Raises:
      TypeError: `x` is not a jax/numpy array.
      ValueError: a numpy value does not fit in int32.
    """
    x = array(name, x)
    if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.integer) and x.dtype != np.int32:
        if x.size and (x.min() < _INT32.min or x.max() > _INT32.max):
            bad = x.min() if x.min() < _INT32.min else x.max()
            raise ValueError(f"{name}: expected values that fit in int32, got {int(bad)} (dtype {x.dtype})")
        x = x.astype(np.int32)
    return x


def not_differentiable(op_name: str, fn):
    """`fn` (positional array arguments) with a JVP rule that raises.

    `jax.jvp`, `jax.grad`, `jax.vjp` and `jax.linearize` all go through the
    JVP rule, so each of them raises `NotImplementedError` naming `op_name`
    as soon as a differentiated value reaches the op. Inputs behind
    `jax.lax.stop_gradient` are not differentiated and run as usual.
    """

    @jax.custom_jvp
    def op(*args):
        return fn(*args)

    @op.defjvp
    def _jvp(primals, tangents):
        del primals, tangents
        raise NotImplementedError(
            f"{op_name}: not differentiable (its Pallas kernels have no derivative rules); wrap "
            "the inputs in jax.lax.stop_gradient if no gradient should flow through the cache"
        )

    return op


def validate_values(check, metadata: dict, **static) -> None:
    """Runs a `tq_spec.validation.check_*_values` on the host when ``validate=`` asks for it.

    ``metadata`` maps argument names to the index arrays whose values are
    checked; ``static`` carries everything else `check` needs (arrays there
    are only read for shape and dtype). Concrete arrays are checked now, with
    the same ValueError as the reference. Under a trace the check runs on the
    host when the computation executes (`jax.debug.callback`), so a bad value
    fails that call (jax wraps the ValueError in its runtime error).
    """
    names = list(metadata)
    arrays = [metadata[n] for n in names]
    shapes = {k: (jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else v) for k, v in static.items()}

    def run(*values):
        check(**shapes, **{n: np.asarray(v) for n, v in zip(names, values)})

    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        jax.debug.callback(run, *arrays)
    else:
        run(*arrays)
