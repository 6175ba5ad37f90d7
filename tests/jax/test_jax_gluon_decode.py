"""tq_jax's decode path on the shared Gluon kernel (`tq_jax._src.gluon_decode`, `tq_gluon.decode`).

On the CPU: the launch contract (the kernel's parameters are its read pointers, then its written
pointers, then its scalars, as jaxlib's Triton call passes operands, results, scalars) and the
kernel's sm_90a build with the signature tq_jax compiles. On an sm_90 GPU (``pytest -m gpu``): the
public op dispatches it for the four TurboQuant slots and matches the float64 reference over
garbage-filled caches, with and without the in-kernel merge, and the Pallas kernels when it is off.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec
from tq_gluon import decode as shared
from tq_jax._src import gluon_decode
from tqjax_cases import CountingTraces, attend, attention_failure, build_attention_case, needs_gluon

PRESETS = shared.PRESETS
ROOT = Path(__file__).resolve().parents[2]


def test_kernel_parameters_are_read_pointers_then_written_pointers_then_scalars():
    """jaxlib's Triton call hands the kernel the custom call's operands, then its results, then the scalars: the
    kernel's parameters must come in that order (`gluon_decode.decode` passes 9 operands and 6 results)."""
    names = list(inspect.signature(shared.gluon_decode_kernel.fn).parameters)
    runtime = list(shared.KERNEL_POINTERS) + list(shared.KERNEL_SCALARS)
    assert names[:len(runtime)] == runtime
    assert shared.KERNEL_POINTERS[9:] == ("part_acc_ptr", "part_m_ptr", "part_l_ptr", "out_ptr", "ticket_ptr",
                                          "tma_ws_ptr")
    assert all(p.annotation is not inspect.Parameter.empty for p in
               list(inspect.signature(shared.gluon_decode_kernel.fn).parameters.values())[len(runtime):])


def test_the_kernel_is_unavailable_without_an_sm90_gpu_and_declines_what_it_does_not_read():
    lay = tq_spec.layout("turboquant_4bit_nc", 128)
    common = dict(num_tokens=4, num_seqs=4, num_q_heads=32, kv_cache_shape=(10, 16, 8, lay.slot_bytes))
    assert "interpreter" in gluon_decode.ineligible(lay, query_dtype=jnp.bfloat16, interpret=True, **common)
    assert "bfloat16" in gluon_decode.ineligible(lay, query_dtype=jnp.float16, interpret=False, **common)
    assert "pages" in gluon_decode.ineligible(lay, query_dtype=jnp.bfloat16, interpret=False,
                                              **dict(common, kv_cache_shape=(10, 32, 8, lay.slot_bytes)))
    bf16 = tq_spec.layout("bf16", 128)
    assert "slots" in gluon_decode.ineligible(bf16, query_dtype=jnp.bfloat16, interpret=False,
                                              **dict(common, kv_cache_shape=(10, 16, 8, bf16.slot_bytes)))
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert gluon_decode.ineligible(lay, query_dtype=jnp.bfloat16, interpret=False, **common) is not None


# Compiles tq_jax's build of the kernel for sm_90a (what `gluon_decode.decode` hands jaxlib) and prints the
# PTX entry's parameter count (run without TRITON_INTERPRET: the interpreter would take over).
_COMPILE_SM90 = """
import re
import tq_spec
from tq_gluon import decode as shared
from tq_jax._src import launcher

lay = tq_spec.layout("turboquant_4bit_nc", 128)
shape = shared.launch_shape(lay, num_tokens=32, num_q_heads=32, num_kv_heads=8, num_seqs=32, max_blocks=512,
                            num_splits=3, has_sinks=True)
options = {k: v for k, v in shape.constexprs.items() if k in ("num_warps", "maxnreg")}
consts = {k: v for k, v in shape.constexprs.items() if k not in options}
consts.update(ROTATE=False, WIDE=False)
name, ptx, shared_bytes = launcher.compiled(shared.gluon_decode_kernel,
                                            tuple(shared.kernel_signature(shape.slot).items()),
                                            tuple(sorted(consts.items())), tuple(sorted(options.items())),
                                            tuple(range(15)), 90)
entry = ptx[ptx.index(".entry " + name):]
entry = entry[:entry.index(")")]
print("params", entry.count(".param"), "maxnreg", re.findall(r"[.]maxnreg (\\d+)", ptx))
"""


def test_tq_jax_build_of_the_kernel_compiles_for_sm90(tmp_path):
    """The PTX jaxlib receives: the 35 runtime parameters plus Triton's two scratch pointers (jaxlib appends
    two null pointers to every launch), and the register cap of the decode step's build."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("params")][0]
    n_runtime = len(shared.KERNEL_POINTERS) + len(shared.KERNEL_SCALARS)
    assert line.split()[1] in (str(n_runtime + 1), str(n_runtime + 2)), line
    assert f"'{shared.MAXNREG}'" in line, line


def _case(preset, name, *, seq_lens=(1, 5, 15, 16, 17, 33, 700, 4100), q_lens=None, hq=32, hkv=8, head_dim=128,
          sinks=True):
    """A bf16 decode batch over a garbage-filled cache (`tqjax_cases.build_attention_case`), one token per
    sequence unless ``q_lens`` says otherwise."""
    rng = np.random.default_rng(zlib.crc32(f"{name}-{preset}".encode()))
    return build_attention_case(rng, preset=preset, head_dim=head_dim, num_q_heads=hq, num_kv_heads=hkv,
                                block_size=16, seq_lens=list(seq_lens), q_lens=list(q_lens or [1] * len(seq_lens)),
                                q_dtype="bfloat16", sinks=sinks)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("shape", ["gqa32_8", "gqa8_1", "gqa24_8_multi", "d256"])
def test_gpu_public_op_takes_the_gluon_decode_and_matches_reference(preset, shape, monkeypatch):
    """`tq_jax.paged_attention` with its defaults (path auto) on decode batches: the Gluon kernel, within the
    parity tolerance of the float64 reference. Several query tokens per sequence (speculative decoding) run its
    tiles of ``16 // G`` tokens; D = 256 decode steps too."""
    kw = dict(gqa32_8={}, gqa8_1=dict(hq=8, hkv=1, seq_lens=(300, 4096)),
              gqa24_8_multi=dict(hq=24, hkv=8, seq_lens=(900, 33, 5), q_lens=(7, 1, 5)),
              d256=dict(hq=16, hkv=4, head_dim=256))[shape]
    case = _case(preset, shape, **kw)
    counting = CountingTraces(monkeypatch, gluon_decode, "decode")
    out = tq_jax.paged_attention(*case.jax_args(), preset=case.preset, **case.jax_kwargs())
    assert counting.calls == 1
    failure = attention_failure(case, out)
    assert failure is None, failure


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("num_splits", [1, 3, 4, 5, 16])
def test_gpu_in_kernel_merge_and_xla_merge_match_reference(preset, num_splits, monkeypatch):
    """Decode steps with up to `FUSED_MERGE_MAX_SPLITS` splits merge in the kernel (slots of
    `MERGES_IN_KERNEL`); otherwise the kernel's log2-domain partials go to the XLA merge. Sinks, an empty
    sequence (no query token) and garbage pages throughout."""
    case = _case(preset, "splits", seq_lens=(0, 3, 17, 2000, 4100), q_lens=(0, 1, 1, 1, 1), sinks=True)
    counting = CountingTraces(monkeypatch, gluon_decode, "decode")
    out = attend(case, "decode", num_splits=num_splits)
    assert counting.calls >= 1
    failure = attention_failure(case, out)
    assert failure is None, failure


@pytest.mark.gpu
@needs_gluon
def test_gpu_padding_rows_are_zero_and_switched_off_runs_pallas(monkeypatch):
    """Query rows past ``query_start_loc[B]`` (a bucketed batch) come out zero; with the process switch off
    (``TQ_GLUON_DECODE=0``) the same call runs the Pallas kernels, also within the parity tolerance."""
    case = _case("turboquant_4bit_nc", "padding", seq_lens=(40, 2000, 90))
    q = np.concatenate([case.query, np.full((5,) + case.query.shape[1:], 7.0, case.query.dtype)])
    args = list(case.jax_args())
    args[0] = jnp.asarray(q)
    counting = CountingTraces(monkeypatch, gluon_decode, "decode")
    fast = np.asarray(tq_jax.paged_attention(*args, preset=case.preset, **case.jax_kwargs()).astype(jnp.float32))
    assert counting.calls == 1
    assert not np.any(fast[case.query.shape[0]:])
    monkeypatch.setattr(shared, "ENABLED", False)
    counting = CountingTraces(monkeypatch, gluon_decode, "decode")
    slow = np.asarray(tq_jax.paged_attention(*args, preset=case.preset, **case.jax_kwargs()).astype(jnp.float32))
    assert counting.calls == 0
    assert not np.any(slow[case.query.shape[0]:])
    for out in (fast, slow):
        failure = attention_failure(case, out[:case.query.shape[0]].astype(jnp.bfloat16))
        assert failure is None, failure


@pytest.mark.gpu
@needs_gluon
def test_gpu_jitted_decode_steps_compile_once(monkeypatch):
    """A jitted decode step of one shape traces (and so builds the kernel's call) once across steps."""
    case = _case("turboquant_4bit_nc", "steps", seq_lens=(100, 300))
    counting = CountingTraces(monkeypatch, gluon_decode, "decode")
    step = jax.jit(lambda *a: tq_jax.paged_attention(*a, preset=case.preset, sinks=case.jax_kwargs()["sinks"]))
    for _ in range(3):
        out = step(*case.jax_args())
    assert counting.calls == 1
    assert re.search("triton_kernel_call", step.lower(*case.jax_args()).as_text())
    failure = attention_failure(case, out)
    assert failure is None, failure


@pytest.mark.gpu
@needs_gluon
def test_gpu_vmap_over_queries_runs_the_gluon_decode_per_element(monkeypatch):
    """`jax.vmap` of the public op over a batch of queries (one cache): the Gluon kernel once per element, each
    output bit-identical to the unbatched call's and within the parity tolerance of the reference."""
    case = _case("turboquant_4bit_nc", "vmap", seq_lens=(40, 2000, 90))
    args = case.jax_args()
    kw = dict(preset=case.preset, **case.jax_kwargs())
    queries = jnp.stack([args[0], (-args[0]).astype(args[0].dtype)])
    counting = CountingTraces(monkeypatch, gluon_decode, "decode")
    batched = jax.vmap(lambda q: tq_jax.paged_attention(q, *args[1:], **kw))(queries)
    assert counting.calls == 1
    for i in range(2):
        one = tq_jax.paged_attention(queries[i], *args[1:], **kw)
        np.testing.assert_array_equal(np.asarray(batched[i].astype(jnp.float32)), np.asarray(one.astype(jnp.float32)))
    failure = attention_failure(case, batched[0])
    assert failure is None, failure
