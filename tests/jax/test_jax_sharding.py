"""tq_jax.sharding: the ops under shard_map, cache and heads split along kv heads, bit for bit.

Every check compares the sharded result with the single-device op on the same inputs with
``np.array_equal`` (float32 queries, so a one-ulp difference shows): cache bytes after the store,
attention outputs on the decode path (a case where the per-shard automatic split count would
differ from the global one, so a shard left to its own heuristic fails) and on the extend path
(window, soft cap, sinks, GQA 3), the NNX `Attention` layer with ``mesh=`` through a donated
`nnx.jit` (outputs, cache bytes, and every device's cache shard keeping its address), a 2-D mesh
(replicated over a data axis; kv heads over a tuple of axes), and the argument errors.

On CPU the checks need 4 devices, which XLA only creates when
``--xla_force_host_platform_device_count=4`` is set before jax starts: the module runs this file
as a script in a child process with that flag (the parent test process keeps its one device).
The child also turns off XLA:CPU's YNNPACK fusions when the installed jaxlib knows the flag: they
compile the decode merge's multiply-reduce with blocking that depends on the array shape, so on
CPU even a single device gives one-ulp different merges for 4 and for 1 kv heads (measured with
jaxlib 0.10.2; XLA's own emitter and the GPU do not do that). The same checks run in-process on
2 GPUs under ``pytest -m gpu`` (skipped with "needs 2 GPUs" otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = ("store", "decode_global_splits", "decode_packed_operands", "extend_window_softcap_sinks",
          "nnx_attention_donated", "mesh_2d", "errors")
_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
# Eigen's multi-threaded contractions split a dot's work by the shape and the thread pool, so a
# shard's smaller dot can sum in another order than the whole one: on a 2-core AMD EPYC CI machine
# (2026-11-27) the fp32 decode checks differed by up to 3e-7 (decode_global_splits, mesh_2d), and
# passed bit for bit with this flag. The checks are about sharding, not about XLA's thread pool.
_SINGLE_THREAD_EIGEN = "--xla_cpu_multi_thread_eigen=false"


# ------------------------------------------------------------------ the checks (run in the child or on GPUs)


def traced_decode_splits(fn, *args) -> list:
    """Split counts of every decode-path launch traced by ``fn(*args)`` (``jax.eval_shape``: nothing runs,
    so the Triton variant can be traced on a CPU host too)."""
    import jax

    from tq_jax._src import attention as _attention

    seen, real = [], _attention.decode_partials

    def spy(cfg, *a, **k):
        seen.append(int(cfg.num_splits))
        return real(cfg, *a, **k)

    _attention.decode_partials = spy
    try:
        jax.clear_caches()  # the op is jitted: a cached trace would not call the spy
        jax.eval_shape(fn, *args)
    finally:
        _attention.decode_partials = real
    return seen


def run_checks(devices, names=CHECKS) -> dict:
    """Runs the named checks on a 1-D mesh ``("kv",)`` over ``devices``; ``{name: None or failure text}``."""
    import traceback

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from flax import nnx

    import tq_jax
    import tq_spec
    from tq_jax import paging, sharding
    from tq_jax.nnx import Attention

    n_dev = len(devices)
    mesh = Mesh(np.array(devices), ("kv",))
    rng = np.random.default_rng(0)
    hkv, d, page = 4, 64, 16
    preset = "turboquant_4bit_nc"

    def same(a, b, what):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
        if not np.array_equal(a, b, equal_nan=True):
            diff = np.argwhere(a != b)
            raise AssertionError(f"{what}: {len(diff)} of {a.size} elements differ, first at {diff[0].tolist()}")

    def filled_cache(seq_lens, num_blocks, cols, p=preset, heads=hkv):
        """A cache holding ``seq_lens`` tokens per sequence (pages in order) and its block table."""
        lay = tq_spec.layout(p, d)
        table = np.arange(len(seq_lens) * cols, dtype=np.int32).reshape(len(seq_lens), cols) % num_blocks
        sid = np.repeat(np.arange(len(seq_lens)), seq_lens)
        pos = np.concatenate([np.arange(s) for s in seq_lens])
        slots = (table[sid, pos // page] * page + pos % page).astype(np.int32)
        k = jnp.asarray(rng.standard_normal((len(slots), heads, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((len(slots), heads, d)), jnp.bfloat16)
        cache = jnp.zeros((num_blocks, page, heads, lay.slot_bytes), jnp.uint8)
        return tq_jax.store_kv(k, v, cache, slots, preset=p), table

    decode_splits = traced_decode_splits
    def check_store():
        t = 50
        for p in (preset, "turboquant_k8v4"):
            lay = tq_spec.layout(p, d)
            cache = jnp.asarray(rng.integers(0, 256, (8, page, hkv, lay.slot_bytes)), jnp.uint8)
            k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
            v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
            slots = rng.permutation(8 * page)[:t].astype(np.int32)
            slots[::7] = -1
            ref = tq_jax.store_kv(k, v, cache, slots, preset=p)
            placed = jax.device_put(cache, sharding.cache_sharding(mesh, "kv"))
            out = sharding.store_kv(k, v, placed, slots, mesh=mesh, axis="kv", preset=p)
            same(out, ref, f"store {p}")
            if out.sharding.spec != sharding.kv_cache_spec("kv"):
                raise AssertionError(f"store {p}: output sharding {out.sharding}")
            # Under jit with the cache donated: in place on every device.
            step = jax.jit(lambda k, v, c, s: sharding.store_kv(k, v, c, s, mesh=mesh, preset=p), donate_argnums=2)
            placed = jax.device_put(cache, sharding.cache_sharding(mesh, "kv"))
            before = sorted(s.data.unsafe_buffer_pointer() for s in placed.addressable_shards)
            out = step(k, v, placed, slots)
            same(out, ref, f"donated store {p}")
            after = sorted(s.data.unsafe_buffer_pointer() for s in out.addressable_shards)
            if before != after:
                raise AssertionError(f"donated store {p}: shard buffers moved {before} -> {after}")

    def check_decode_global_splits():
        seq_lens = np.array([576, 37, 9, 200], np.int32)
        cols = 36
        cache, table = filled_cache(seq_lens, 4 * cols, cols)
        q = jnp.asarray(rng.standard_normal((4, 8, d)), jnp.float32)
        qsl = np.arange(5, dtype=np.int32)
        sinks = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
        placed = jax.device_put(cache, sharding.cache_sharding(mesh, "kv"))
        for kw in (dict(), dict(sinks=sinks, sliding_window=300, logits_soft_cap=30.0)):
            ref = tq_jax.paged_attention(q, cache, table, seq_lens, qsl, preset=preset, **kw)
            out = sharding.paged_attention(q, placed, table, seq_lens, qsl, mesh=mesh, axis="kv", preset=preset, **kw)
            same(out, ref, f"decode {sorted(kw)}")
            jitted = jax.jit(lambda q, c: sharding.paged_attention(q, c, table, seq_lens, qsl, mesh=mesh,
                                                                     preset=preset, **kw))(q, placed)
            same(jitted, ref, f"decode under jit {sorted(kw)}")
        # The plan on both kinds of platform, traced only (the Triton one cannot run here): every
        # shard gets the global problem's split count, where the shard's own automatic count differs
        # (on a GPU it grows as the kv heads per call shrink).
        # 16 sequences x 4800-token capacity: the global count is capped neither by key tiles nor by
        # the split limit, and a shard's (fewer kv heads) is larger.
        nb = 16
        wide = np.zeros((nb, 300), np.int32)
        q_b, lens_b = jnp.zeros((nb, 8, d), jnp.float32), np.full(nb, 100, np.int32)
        qsl_b = np.arange(nb + 1, dtype=np.int32)
        local_q = jax.ShapeDtypeStruct((nb, 8 // n_dev, d), jnp.float32)
        local_c = jax.ShapeDtypeStruct(cache.shape[:2] + (hkv // n_dev,) + cache.shape[3:], jnp.uint8)
        for interp in (False, True):
            glob = decode_splits(lambda: tq_jax.paged_attention(q_b, cache, wide, lens_b, qsl_b, preset=preset,
                                                                interpret=interp))
            shard = decode_splits(lambda: sharding.paged_attention(q_b, placed, wide, lens_b, qsl_b, mesh=mesh,
                                                                   preset=preset, interpret=interp))
            own = decode_splits(lambda q_, c_: tq_jax.paged_attention(q_, c_, wide, lens_b, qsl_b, preset=preset,
                                                                      interpret=interp), local_q, local_c)
            if len(glob) != 1 or shard != glob:
                raise AssertionError(f"interpret={interp}: shards split {shard}, the single-device op {glob}")
            if not interp and own == glob:
                raise AssertionError(f"case too weak: a shard's own split count equals the global one {glob}")

    def check_decode_packed_operands():
        # A 16-bit query over 8 sequences: the single-device op's packed-operand decode on a GPU
        # (constant key-table entries and their own tile settings, `attention._default_key_entries`);
        # every shard must run the same.
        seq_lens = np.array([96, 37, 9, 200, 1, 64, 17, 130], np.int32)
        cols = 13
        cache, table = filled_cache(seq_lens, 8 * cols, cols)
        q = jnp.asarray(rng.standard_normal((8, 8, d)), jnp.bfloat16)
        qsl = np.arange(9, dtype=np.int32)
        assert sharding._global_key_entries(tq_spec.layout(preset, d), q, table, "decode", None, None) is not None
        placed = jax.device_put(cache, sharding.cache_sharding(mesh, "kv"))
        ref = tq_jax.paged_attention(q, cache, table, seq_lens, qsl, preset=preset)
        out = sharding.paged_attention(q, placed, table, seq_lens, qsl, mesh=mesh, axis="kv", preset=preset)
        same(out, ref, "decode, packed operands")

    def check_extend():
        seq_lens = np.array([40, 9, 23], np.int32)
        q_lens = np.array([12, 9, 1], np.int32)
        cols = 3
        cache, table = filled_cache(seq_lens, 3 * cols, cols)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q = jnp.asarray(rng.standard_normal((int(qsl[-1]) + 3, 12, d)), jnp.float32)  # 3 padding rows
        sinks = jnp.linspace(-2.0, 1.0, 12, dtype=jnp.float32)
        kw = dict(preset=preset, sliding_window=5, logits_soft_cap=30.0, sinks=sinks)
        placed = jax.device_put(cache, sharding.cache_sharding(mesh, "kv"))
        for path in ("auto", "decode"):
            ref = tq_jax.paged_attention(q, cache, table, seq_lens, qsl, path=path, **kw)
            out = sharding.paged_attention(q, placed, table, seq_lens, qsl, mesh=mesh, path=path, **kw)
            same(out, ref, f"extend path={path}")

    def check_nnx():
        # fp32 projections at full precision. With TF32 (XLA's default for fp32 dots on GPUs) an
        # operand one fp32 ulp away can round to another TF32 value (2**-11 apart), so last-bit
        # differences (GEMM tilings change with the heads per device) came out of the output
        # projection as ~5e-5 ones on 2 H200s.
        with jax.default_matmul_precision("highest"):
            _check_nnx()

    def _check_nnx():
        e, n_blocks = 64, 12

        def layer(mesh_):
            return Attention(embed_dim=e, num_q_heads=8, num_kv_heads=hkv, head_dim=d, preset=preset,
                             num_blocks=n_blocks, block_size=4, sliding_window=6, logits_soft_cap=30.0,
                             use_sinks=True, dtype=jnp.float32, rngs=nnx.Rngs(3), mesh=mesh_, kv_axis="kv")

        layers = [layer(None), layer(mesh)]
        for lyr in layers:
            lyr.sinks[...] = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)

        @nnx.jit(donate_argnums=0, static_argnames="rows")
        def step(lyr, pages, x, ids, new, rows):
            pages, ok = paging.append(pages, ids, new)
            return lyr(x, paging.step_metadata(pages, ids, new, num_tokens=rows)), pages, ok

        ids = np.array([0, 1], np.int32)
        schedule = [(np.array([9, 4], np.int32), 16), (np.array([1, 1], np.int32), 2)]
        outs = [[], []]
        for j, lyr in enumerate(layers):
            pages = paging.init_pages(n_blocks, 2, 4, 4)
            for i, (new, rows) in enumerate(schedule):
                x = jnp.asarray(np.random.default_rng(i).standard_normal((rows, e)), jnp.float32)
                shards = lyr.cache.kv_cache[...].addressable_shards
                before = sorted(s.data.unsafe_buffer_pointer() for s in shards)
                out, pages, ok = step(lyr, pages, x, ids, new, rows=rows)
                assert bool(ok)
                after = sorted(s.data.unsafe_buffer_pointer() for s in lyr.cache.kv_cache[...].addressable_shards)
                if before != after:
                    raise AssertionError(f"nnx step {i} (mesh={j == 1}): cache shard buffers moved")
                # Copies: a numpy view of a CPU buffer would keep the next donation from reusing it.
                outs[j].append((np.array(out), np.array(lyr.cache.kv_cache[...])))
        cache = layers[1].cache.kv_cache[...]
        if len(cache.addressable_shards) != n_dev or cache.sharding.spec != sharding.kv_cache_spec("kv"):
            raise AssertionError(f"nnx cache sharding: {cache.sharding}")
        for i, ((o1, c1), (o2, c2)) in enumerate(zip(*outs)):
            same(c2, c1, f"nnx cache after step {i}")  # projections, RoPE and the store: bit for bit
            # The output projection contracts over all heads; XLA splits that contraction over the
            # devices holding the heads (partial sums, then an all-reduce), so only its summation
            # order differs. The attention itself is compared bit for bit below.
            np.testing.assert_allclose(o2, o1, rtol=1e-5, atol=1e-5, err_msg=f"nnx output of step {i}")
        meta = paging.step_metadata(pages, ids, np.array([1, 1], np.int32), num_tokens=2)
        q = jnp.asarray(rng.standard_normal((2, 8, d)), jnp.float32)
        attn = [nnx.jit(lambda c, q: c.attend(q, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                               sliding_window=6, logits_soft_cap=30.0, sinks=lyr.sinks[...]))(
                    lyr.cache, q) for lyr in layers]
        same(attn[1], attn[0], "nnx PagedKVCache.attend")


    def check_mesh_2d():
        if n_dev != 4:
            return
        mesh2 = Mesh(np.array(devices).reshape(2, 2), ("data", "kv"))
        seq_lens = np.array([30, 7], np.int32)
        cache, table = filled_cache(seq_lens, 6, 3)
        q = jnp.asarray(rng.standard_normal((2, 8, d)), jnp.float32)
        qsl = np.arange(3, dtype=np.int32)
        ref = tq_jax.paged_attention(q, cache, table, seq_lens, qsl, preset=preset)
        for axis in ("kv", ("data", "kv")):  # kv heads over 2 devices (replicated over data), or over all 4
            out = sharding.paged_attention(q, cache, table, seq_lens, qsl, mesh=mesh2, axis=axis, preset=preset)
            same(out, ref, f"2-D mesh, axis={axis}")
        k = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
        slots = np.array([3, 50, -1, 7, 90], np.int32)
        same(sharding.store_kv(k, k, cache, slots, mesh=mesh2, axis="kv", preset=preset),
             tq_jax.store_kv(k, k, cache, slots, preset=preset), "2-D mesh store")

    def check_errors():
        import pytest as _pytest

        cache = jnp.zeros((4, page, 3, tq_spec.layout(preset, d).slot_bytes), jnp.uint8)
        q = jnp.zeros((1, 3, d), jnp.float32)
        meta = (np.zeros((1, 1), np.int32), np.ones(1, np.int32), np.array([0, 1], np.int32))
        if n_dev > 1:
            with _pytest.raises(ValueError, match="num_kv_heads divisible"):
                sharding.paged_attention(q, cache, *meta, mesh=mesh, preset=preset)
            with _pytest.raises(ValueError, match="num_kv_heads divisible"):
                sharding.store_kv(q, q, cache, np.zeros(1, np.int32), mesh=mesh, preset=preset)
            with _pytest.raises(ValueError, match="num_kv_heads"):
                Attention(embed_dim=32, num_q_heads=3, num_kv_heads=3, head_dim=d, num_blocks=4, block_size=4,
                          rngs=nnx.Rngs(0), mesh=mesh)
        with _pytest.raises(ValueError, match="mesh axis"):
            sharding.paged_attention(q, cache, *meta, mesh=mesh, axis="tp", preset=preset)

    table = {"store": check_store, "decode_global_splits": check_decode_global_splits,
             "decode_packed_operands": check_decode_packed_operands, "extend_window_softcap_sinks": check_extend,
             "nnx_attention_donated": check_nnx, "mesh_2d": check_mesh_2d, "errors": check_errors}
    results = {}
    for name in names:
        try:
            table[name]()
            results[name] = None
        except Exception:  # reported per check by the parent
            results[name] = traceback.format_exc()
    return results


# ------------------------------------------------------------------ CPU: 4 host devices in a child process


def _child_env(extra_flags: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), extra_flags) if f)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _flag_known(flag: str) -> bool:
    """Whether this jaxlib accepts an XLA flag (XLA aborts on unknown XLA_FLAGS)."""
    p = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=_child_env(flag),
                       capture_output=True, text=True, timeout=120)
    return p.returncode == 0


@pytest.fixture(scope="module")
def cpu4_results():
    flags = "--xla_force_host_platform_device_count=4"
    for flag in (_NO_YNN, _SINGLE_THREAD_EIGEN):
        if _flag_known(flag):
            flags += " " + flag
    p = subprocess.run([sys.executable, os.path.abspath(__file__)], env=_child_env(flags), capture_output=True,
                       text=True, timeout=1200, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, f"child failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = json.loads(lines[-1])
    assert res.pop("__devices__") == 4, res
    return res


@pytest.mark.parametrize("name", CHECKS)
def test_sharded_ops_match_single_device_on_4_cpu_devices(cpu4_results, name):
    assert cpu4_results[name] is None, cpu4_results[name]


@pytest.mark.parametrize("interpret", [False, True], ids=["triton", "interpret"])
def test_split_count_mirror_matches_the_op(interpret):
    """`tq_jax.sharding` gives every shard the split count the single-device op picks for the global
    shapes; its mirror of the kernels' heuristic must agree with what the op really launches,
    including the packed-operand tiles of 4bit_nc batches of 8+ sequences (their own settings)."""
    import jax
    import jax.numpy as jnp

    import tq_jax
    import tq_spec
    from tq_jax import sharding

    cases = [  # (T, Hq, Hkv, D, B, max_blocks, page, preset)
        (4, 8, 4, 64, 4, 300, 16, "turboquant_4bit_nc"), (1, 32, 8, 128, 1, 2048, 16, "turboquant_3bit_nc"),
        (64, 16, 2, 128, 64, 64, 16, "turboquant_k8v4"), (8, 14, 2, 64, 8, 9, 16, "bf16"),
        (3, 28, 4, 256, 3, 40, 32, "fp16"), (16, 64, 4, 128, 16, 512, 16, "turboquant_4bit_nc"),
        (8, 8, 8, 128, 8, 512, 16, "turboquant_4bit_nc")]
    packed = 0
    for t, hq, hkv, d, b, cols, page, preset in cases:
        lay = tq_spec.layout(preset, d)
        q = jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16)
        cache = jax.ShapeDtypeStruct((8, page, hkv, lay.slot_bytes), jnp.uint8)
        meta = (jax.ShapeDtypeStruct((b, cols), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
                jax.ShapeDtypeStruct((b + 1,), jnp.int32))
        seen = traced_decode_splits(lambda *a: tq_jax.paged_attention(*a, preset=preset, path="decode",
                                                                      interpret=interpret), q, cache, *meta)
        entries = sharding._global_key_entries(lay, q, meta[0], "decode", None, None)
        packed += entries is not None
        want = sharding._auto_num_splits(lay, q.shape, cache.shape, meta[0].shape, interpret=interpret,
                                         key_entries=entries)
        assert seen == [want], (t, hq, hkv, d, b, cols, page, preset, seen, want)
    assert packed == 2


def test_path_mirror_matches_the_op():
    """The path `tq_jax.sharding` forces on every shard is the one the single-device op launches."""
    import jax
    import jax.numpy as jnp

    import tq_jax
    import tq_spec
    from tq_jax import sharding
    from tq_jax._src import attention as _attention

    cases = [  # (T, Hq, Hkv, B, max_blocks, preset, query dtype, window)
        (4, 8, 4, 4, 8, "turboquant_4bit_nc", jnp.bfloat16, None), (64, 8, 2, 2, 8, "turboquant_4bit_nc",
                                                                    jnp.bfloat16, 16),
        (64, 8, 2, 2, 8, "turboquant_k8v4", jnp.float32, None), (512, 16, 8, 4, 2048, "turboquant_3bit_nc",
                                                                 jnp.float16, None),
        (9, 4, 4, 8, 4, "bf16", jnp.bfloat16, 4), (40, 4, 1, 2, 4, "fp16", jnp.float16, None)]
    for t, hq, hkv, b, cols, preset, dtype, window in cases:
        lay = tq_spec.layout(preset, 64)
        args = (jax.ShapeDtypeStruct((t, hq, 64), dtype), jax.ShapeDtypeStruct((8, 16, hkv, lay.slot_bytes), jnp.uint8),
                jax.ShapeDtypeStruct((b, cols), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
                jax.ShapeDtypeStruct((b + 1,), jnp.int32))
        seen, real = [], _attention._paged_attention

        def spy(*a, **k):
            seen.append(k["path"])
            return real(*a, **k)

        _attention._paged_attention = spy
        try:
            jax.eval_shape(lambda *a: tq_jax.paged_attention(*a, preset=preset, sliding_window=window), *args)
        finally:
            _attention._paged_attention = real
        want = sharding._global_path(lay, args[0], args[1], args[2], sliding_window=window, path="auto")
        assert seen == [want], (t, hq, hkv, b, cols, preset, dtype, seen, want)


def test_shard_map_entry_point_for_this_jax():
    import jax

    from tq_jax import sharding

    fn, check = sharding._shard_map_impl()
    assert check in ("check_vma", "check_rep")
    if hasattr(jax, "shard_map"):
        assert fn is jax.shard_map


@pytest.mark.gpu
def test_sharded_ops_match_single_device_on_2_gpus():
    import jax

    gpus = [dv for dv in jax.devices() if dv.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    res = run_checks(gpus[:2])
    failed = {k: v for k, v in res.items() if v is not None}
    assert not failed, "\n".join(f"--- {k}\n{v}" for k, v in failed.items())


if __name__ == "__main__":
    import jax

    devs = jax.devices()[:4]
    out = run_checks(devs)
    out["__devices__"] = len(devs)
    print(json.dumps(out))
