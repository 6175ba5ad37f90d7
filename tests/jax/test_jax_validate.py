"""``validate=`` / ``TQ_VALIDATE``: full metadata validation with the reference's errors, off by default.

The twin of tests/torch/test_torch_validate.py. Eager calls check the values
on the host before running; under `jax.jit` the same check runs on the host
when the computation executes (a host callback), so a bad step fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec
from tqjax_cases import build_attention_case

PRESET = "turboquant_4bit_nc"

BAD_METADATA = [  # (argument, new value, message shared with tq_spec.reference)
    ("seq_lens", [5, -1], "seq_lens: expected entries >= 0"),
    ("seq_lens", [5, 13], "seq_lens: sequence 1 has 13 tokens but block_table holds at most"),  # 3 blocks x 4
    ("query_start_loc", [1, 2, 3], "query_start_loc: expected to start at 0"),
    ("query_start_loc", [0, 3, 1], "query_start_loc: expected non-decreasing entries"),
    ("query_start_loc", [0, 1, 4], r"query_start_loc: expected to end at most at T=3"),
    ("seq_lens", [5, 1], r"query_start_loc: sequence 1 has q_len 2 > seq_lens\[1\] = 1"),
]


def _case():
    return build_attention_case(np.random.default_rng(3), preset=PRESET, head_dim=64, num_q_heads=4,
                                num_kv_heads=2, block_size=4, seq_lens=[5, 7], q_lens=[1, 2])


def _args(case, name=None, values=None):
    args = dict(zip(("query", "kv_cache", "block_table", "seq_lens", "query_start_loc"), case.jax_args()))
    if name is not None:
        args[name] = jnp.asarray(values, jnp.int32)
    return args


@pytest.mark.parametrize("name,values,message", BAD_METADATA, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_METADATA)])
def test_validate_raises_the_reference_error(name, values, message):
    args = _args(_case(), name, values)
    with pytest.raises(ValueError, match=message):
        tq_spec.reference.paged_attention(**{k: np.asarray(v) for k, v in args.items()}, preset=PRESET)
    with pytest.raises(ValueError, match=message):
        tq_jax.paged_attention(**args, preset=PRESET, validate=True)


def test_environment_switch_and_default(monkeypatch):
    args = _args(_case(), "seq_lens", [5, -1])  # unvalidated it is harmless: no visible key
    monkeypatch.delenv("TQ_VALIDATE", raising=False)
    tq_jax.paged_attention(**args, preset=PRESET)
    monkeypatch.setenv("TQ_VALIDATE", "1")
    with pytest.raises(ValueError, match="seq_lens: expected entries >= 0"):
        tq_jax.paged_attention(**args, preset=PRESET)
    tq_jax.paged_attention(**args, preset=PRESET, validate=False)


def test_validate_under_jit_checks_when_the_step_runs():
    case = _case()
    step = jax.jit(lambda q, c, bt, sl, qsl: tq_jax.paged_attention(q, c, bt, sl, qsl, preset=PRESET, validate=True))
    good = _args(case)
    step(*good.values()).block_until_ready()  # valid metadata passes through the callback
    bad = _args(case, "seq_lens", [5, -1])
    with pytest.raises(Exception, match="seq_lens: expected entries >= 0"):
        step(*bad.values()).block_until_ready()


def test_store_validate_names_duplicate_and_out_of_range_slots():
    lay = tq_spec.layout(PRESET, 64)
    cache = jnp.zeros((2, 4, 2, lay.slot_bytes), jnp.uint8)
    kv = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 64)), jnp.float32)
    with pytest.raises(ValueError, match="slot_mapping: expected each slot at most once, got slot 1"):
        tq_jax.store_kv(kv, kv, cache, jnp.asarray([1, 1, -1], jnp.int32), preset=PRESET, validate=True)
    with pytest.raises(ValueError, match=r"slot_mapping: expected entries in \[-1, 8\)"):
        tq_jax.store_kv(kv, kv, cache, jnp.asarray([0, 8, -1], jnp.int32), preset=PRESET, validate=True)
    out = tq_jax.store_kv(kv, kv, cache, jnp.asarray([0, 1, -1], jnp.int32), preset=PRESET, validate=True)
    np.testing.assert_array_equal(np.asarray(out[1]), 0)  # slots 0 and 1 live in block 0
