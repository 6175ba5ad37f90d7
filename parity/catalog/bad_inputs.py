"""Bad inputs, as data: the table behind ``python -m parity``'s ``errors`` op and tests/test_bad_inputs.py.

Every row is one class of invalid (or edge-case valid) input to `store_kv` or
`paged_attention`, applied to one small, valid base problem (`base_problem`):
a dtype, rank, shape, preset, window, soft cap, scale or sinks argument error
(checked always, without a device sync), a metadata *value* error
(``slot_mapping``, ``block_table``, ``seq_lens``, ``query_start_loc``: checked
only under ``validate=True`` / ``TQ_VALIDATE=1``), a framework mix-up (torch
tensors given to tq_jax), or a valid edge case (q_len 0, seq_len 0, padding
rows, an empty batch) that must run and match the reference.

What each leg must do with a row (`parity.checks.errors` runs it):

* ``validated`` (``validate=True``): raise the exception class the float64
  reference raises, naming the same argument (the text before the first
  ``:`` of the message); a valid row runs and matches the reference.
* ``unvalidated`` (``validate=False``): an argument error still raises as
  above. A metadata error must not crash the process (rows run in a
  subprocess), nor write outside the cache or the op's own output (the torch
  cache and output are views into larger canary-filled buffers; the JAX
  store must leave every slot no in-range entry names unchanged, and neither
  op may change its input cache), and the rows of sequences the bad value
  does not touch must still match the reference. Raising the reference's
  error (a host-side check that needs no sync, e.g. tq_jax refusing an int64
  slot that does not fit in int32) is safe too.
* torch and jax agree on every row: the same outcome (the same exception
  class and argument, or outputs that agree element by element, NaN where
  the other has NaN).

``known`` lists the rows a leg is known to fail today, with the reason: the
errors op reports them as ``xfailed`` (a pass then fails as ``xpassed``, so
the mark is removed when the kernel is fixed), and the pytest module marks
them ``xfail(strict=True)``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np

import tq_spec
from tq_spec import reference

from .sweeps import rng_for

# The base problem: preset, D, Hq, Hkv, P, N and the batch ((seq_len, q_len) per sequence).
BASE_PRESET = "turboquant_4bit_nc"
BASE_D, BASE_HQ, BASE_HKV, BASE_P, BASE_N = 64, 4, 2, 4, 8
BASE_SEQS = ((5, 1), (7, 2), (3, 1))  # T = 4 <= 3 * 8 (G = 2): auto picks decode; both paths are forced too
BASE_WIDTH = 3  # block_table columns: capacity 12 tokens per sequence
MODES = ("validated", "unvalidated")
LEGS = ("torch", "jax")
PAIR = "torch|jax"
KINDS = ("argument", "metadata", "framework", "valid")


@dataclass
class BaseProblem:
    """The valid problem every row changes (numpy arrays; float32 data).

    ``store`` holds the keyword arguments of a valid `store_kv` (4 new tokens,
    one of them ``-1``, written into spare pages); ``attention`` those of a
    valid `paged_attention` over ``cache`` (every token of every sequence
    stored by the reference, every other byte 0xFF). ``rows_of[b]`` are the
    query rows of sequence ``b``.
    """

    store: dict
    attention: dict
    rows_of: tuple

    @property
    def n_slots(self) -> int:
        return BASE_N * BASE_P


def base_problem(seed: int = 0) -> BaseProblem:
    """The base problem (deterministic in `seed`)."""
    rng = rng_for("bad-inputs", seed)
    lay = tq_spec.layout(BASE_PRESET, BASE_D)
    cache = np.full((BASE_N, BASE_P, BASE_HKV, lay.slot_bytes), 0xFF, np.uint8)
    pages = rng.permutation(BASE_N)
    need = [-(-s // BASE_P) for s, _ in BASE_SEQS]
    table = np.empty((len(BASE_SEQS), BASE_WIDTH), np.int32)
    used, slots = 0, []
    for b, (s, _) in enumerate(BASE_SEQS):
        own = pages[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = own
        table[b, need[b]:] = own[0]  # unused columns name a valid page (never read)
        pos = np.arange(s)
        slots.append(own[pos // BASE_P].astype(np.int64) * BASE_P + pos % BASE_P)
    spare = pages[used:]
    sm_all = np.concatenate(slots)
    k_all = rng.standard_normal((len(sm_all), BASE_HKV, BASE_D)).astype(np.float32)
    v_all = rng.standard_normal((len(sm_all), BASE_HKV, BASE_D)).astype(np.float32)
    cache = reference.store_kv(k_all, v_all, cache, sm_all, preset=BASE_PRESET)

    new_slots = np.array([spare[0] * BASE_P + 1, spare[1] * BASE_P, -1, spare[2] * BASE_P + 3], np.int64)
    store = dict(key=rng.standard_normal((4, BASE_HKV, BASE_D)).astype(np.float32),
                 value=rng.standard_normal((4, BASE_HKV, BASE_D)).astype(np.float32),
                 kv_cache=cache, slot_mapping=new_slots, preset=BASE_PRESET)
    q_lens = [q for _, q in BASE_SEQS]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    attention = dict(query=rng.standard_normal((int(qsl[-1]), BASE_HQ, BASE_D)).astype(np.float32),
                     kv_cache=cache, block_table=table, seq_lens=np.array([s for s, _ in BASE_SEQS], np.int32),
                     query_start_loc=qsl, preset=BASE_PRESET)
    rows_of = tuple(tuple(range(int(qsl[b]), int(qsl[b + 1]))) for b in range(len(BASE_SEQS)))
    return BaseProblem(store, attention, rows_of)


# Wrappers for values that must reach a leg as they are, or as another framework's array.
@dataclass(frozen=True)
class AsIs:
    """Passed to every leg unchanged (a list, a string): never converted to the leg's arrays."""

    value: Any


@dataclass(frozen=True)
class AsTorch:
    """A torch tensor for every leg (tq_jax must refuse it with a TypeError naming the argument)."""

    value: np.ndarray


@dataclass(frozen=True)
class AsNumpy:
    """A numpy array for every leg (tq_torch must refuse it with a TypeError naming the argument)."""

    value: np.ndarray


@dataclass(frozen=True)
class BadInput:
    """One class of bad (or edge-case) input.

    Attributes:
      name: short stable name; the row's id is ``<op>/<name>``.
      op: ``store_kv`` or ``paged_attention``.
      kind: one of `KINDS` (argument: checked always; metadata: a value checked
        only by validation; framework: a foreign array type; valid: must run).
      what: what the row feeds in, in words.
      change: ``base -> {argument: new value}`` applied to the base call.
      expect: ``(exception class name, argument)`` where the reference cannot
        say (arguments it does not have, foreign arrays); else None.
      legs: the kernel legs the row applies to.
      affected: for metadata rows, the sequences whose rows have no defined
        output without validation (None: every row; rows of the other
        sequences must match the reference).
      accepts: ``((leg, reason), ...)``: legs that accept this input by design (documented), so
        must run it and match the reference on the base problem (e.g. tq_jax converting numpy
        int64 metadata to int32 when lossless).
      known: ``((leg or "torch|jax", where, reason), ...)`` known failures (from `KNOWN`); ``where``
        is a glob over the record's path ``<mode>:<path>`` (``"unvalidated:decode"``,
        ``"unvalidated:*"``, ``"*"``).
    """

    name: str
    op: str
    kind: str
    what: str
    change: Callable[[BaseProblem], dict]
    expect: Optional[tuple[str, str]] = None
    legs: tuple[str, ...] = LEGS
    affected: Optional[tuple[int, ...]] = None
    accepts: tuple = ()
    known: tuple = ()

    @property
    def id(self) -> str:
        return f"{'store' if self.op == 'store_kv' else 'attention'}/{self.name}"

    def accepted_by(self, leg: str) -> Optional[str]:
        for a_leg, reason in self.accepts:
            if a_leg == leg:
                return reason
        return None

    def known_reason(self, leg: str, path: str) -> Optional[str]:
        """The reason `leg` is known to fail the record with path `path` (``<mode>:<path>``), if it is."""
        for k_leg, where, reason in self.known:
            if k_leg == leg and fnmatch.fnmatchcase(path, where):
                return reason
        return None

    def call_kwargs(self, base: BaseProblem) -> dict:
        """The base keyword arguments with this row's changes applied (numpy / wrapped values)."""
        kw = dict(base.store if self.op == "store_kv" else base.attention)
        kw.update(self.change(base))
        return kw


def reference_outcome(row: BadInput, base: BaseProblem):
    """``(None, result)`` if the reference accepts the row, else ``((class name, argument, message), None)``.

    Rows with an explicit ``expect`` (arguments the reference does not take,
    foreign arrays) return ``expect`` without calling it.
    """
    if row.expect is not None:
        return (row.expect[0], row.expect[1], "(expected by the catalog)"), None
    kw = row.call_kwargs(base)
    fn = reference.store_kv if row.op == "store_kv" else reference.paged_attention
    kw = {k: (v.value if isinstance(v, AsIs) else v) for k, v in kw.items()}
    try:
        with np.errstate(all="ignore"):
            return None, fn(**kw)
    except (TypeError, ValueError, NotImplementedError) as e:
        return (type(e).__name__, error_argument(e), str(e)), None


def error_argument(e: BaseException) -> str:
    """The argument an error names: the text before the first ``:`` of its message ('' if none)."""
    msg = str(e).strip()
    head = msg.split(":", 1)[0].strip() if ":" in msg else ""
    return head if head.replace("_", "").isalnum() else ""


# ----------------------------------------------------------------------------- the table


def _arr(base_kw: str, op: str = "attention"):
    return lambda b: (b.store if op == "store" else b.attention)[base_kw]


def _set(op: str, name: str, fn):
    """A change that replaces argument `name` of the base call by ``fn(base)``."""
    return lambda b: {name: fn(b)}


def _sm(values):
    """slot_mapping with entry 1 replaced (values: a function of the base, or a number), dtype int64."""
    def change(b):
        sm = b.store["slot_mapping"].copy()
        v = values(b) if callable(values) else values
        sm[1] = v
        return {"slot_mapping": sm}
    return change


def _sm32(value):
    def change(b):
        sm = b.store["slot_mapping"].astype(np.int32)
        sm[1] = value
        return {"slot_mapping": sm}
    return change


def _bt(row, col, value):
    def change(b):
        bt = b.attention["block_table"].copy()
        bt[row, col] = value(b) if callable(value) else value
        return {"block_table": bt}
    return change


def _sl(seq, value):
    def change(b):
        sl = b.attention["seq_lens"].copy()
        sl[seq] = value(b) if callable(value) else value
        return {"seq_lens": sl}
    return change


def _qsl(values):
    return lambda b: {"query_start_loc": np.array(values, np.int32)}


def _cast(op, name, dtype):
    def change(b):
        src = b.store if op == "store" else b.attention
        return {name: src[name].astype(dtype)}
    return change


def _reshape(op, name, fn):
    def change(b):
        src = b.store if op == "store" else b.attention
        return {name: fn(src[name])}
    return change


def _kw(**values):
    return lambda b: dict(values)


def _sinks(fn):
    return lambda b: {"sinks": fn(b)}


def _both_kv(fn):
    return lambda b: {"key": fn(b.store["key"]), "value": fn(b.store["value"])}


def _other_cache(d, preset=BASE_PRESET, hkv=BASE_HKV, n=BASE_N, extra_bytes=0, dtype=np.uint8):
    slot = tq_spec.layout(preset, d).slot_bytes + extra_bytes
    return np.full((n, BASE_P, hkv, slot), 0xFF, np.uint8).astype(dtype)


def _padded_query(extra):
    """The base query with `extra` padding rows past query_start_loc[B] (NaN: they must come back zeros)."""
    def change(b):
        q = b.attention["query"]
        pad = np.full((extra, *q.shape[1:]), np.nan, np.float32)
        return {"query": np.concatenate([q, pad])}
    return change


def _with_empty_request(b):
    """A fourth request with q_len 0 and seq_len 0 (a padded batch's filler). Its table row is all -1:
    a sequence of length 0 uses no block, so its ids are never read and any value is valid."""
    bt = np.concatenate([b.attention["block_table"], np.full((1, BASE_WIDTH), -1, np.int32)])
    sl = np.concatenate([b.attention["seq_lens"], [0]]).astype(np.int32)
    qsl = np.concatenate([b.attention["query_start_loc"], b.attention["query_start_loc"][-1:]]).astype(np.int32)
    return {"block_table": bt, "seq_lens": sl, "query_start_loc": qsl}


def _empty_batch(b):
    return {"block_table": np.zeros((0, BASE_WIDTH), np.int32), "seq_lens": np.zeros(0, np.int32),
            "query_start_loc": np.zeros(1, np.int32)}


def _empty_query(b):
    return {"query": b.attention["query"][:0], "query_start_loc": np.zeros(4, np.int32)}


def _store_rows() -> list[BadInput]:
    S = "store_kv"
    f32 = np.float32
    rows = [
        # ---- argument errors (always checked)
        BadInput("key-int32", S, "argument", "key of dtype int32", _cast("store", "key", np.int32)),
        BadInput("key-float64", S, "argument", "key of dtype float64", _cast("store", "key", np.float64)),
        BadInput("key-rank2", S, "argument", "key of rank 2", _reshape("store", "key", lambda k: k[:, 0])),
        BadInput("key-list", S, "argument", "key given as a Python list",
                 lambda b: {"key": AsIs(b.store["key"].tolist())}),
        BadInput("value-shape", S, "argument", "value with one token fewer than key",
                 _reshape("store", "value", lambda v: v[:-1])),
        BadInput("value-dtype", S, "argument", "value float16, key float32", _cast("store", "value", np.float16)),
        BadInput("cache-int8", S, "argument", "kv_cache of dtype int8",
                 lambda b: {"kv_cache": b.store["kv_cache"].view(np.int8)}),
        BadInput("cache-rank3", S, "argument", "kv_cache of rank 3",
                 _reshape("store", "kv_cache", lambda c: c.reshape(c.shape[0], -1, c.shape[-1]))),
        BadInput("cache-slot-bytes", S, "argument", "kv_cache slot_bytes 2 more than the preset's",
                 lambda b: {"kv_cache": _other_cache(BASE_D, extra_bytes=2)}),
        BadInput("cache-heads", S, "argument", "kv_cache with 1 kv head, key with 2",
                 lambda b: {"kv_cache": _other_cache(BASE_D, hkv=1)}),
        BadInput("cache-no-blocks", S, "argument", "kv_cache with num_blocks 0",
                 lambda b: {"kv_cache": _other_cache(BASE_D, n=0)}),
        BadInput("slots-float", S, "argument", "slot_mapping of dtype float32", _cast("store", "slot_mapping", f32)),
        BadInput("slots-int16", S, "argument", "slot_mapping of dtype int16",
                 _cast("store", "slot_mapping", np.int16)),
        BadInput("slots-rank2", S, "argument", "slot_mapping of rank 2",
                 _reshape("store", "slot_mapping", lambda s: s[:, None])),
        BadInput("slots-length", S, "argument", "slot_mapping one entry longer than T",
                 _reshape("store", "slot_mapping", lambda s: np.concatenate([s, [-1]]))),
        BadInput("preset-unknown", S, "argument", "preset 'turboquant_5bit'", _kw(preset="turboquant_5bit")),
        BadInput("preset-type", S, "argument", "preset given as an int", _kw(preset=4)),
        BadInput("mse-head-dim-96", S, "argument", "mse preset at head_dim 96 (not a power of two)",
                 _both_kv(lambda x: np.concatenate([x, x[..., :32]], -1))),
        BadInput("k8v4-head-dim-20", S, "argument", "turboquant_k8v4 at head_dim 20 (not a multiple of 8)",
                 lambda b: {"key": b.store["key"][..., :20], "value": b.store["value"][..., :20],
                            "preset": "turboquant_k8v4"}),
        BadInput("rotation-non-mse", S, "argument", "a rotation for turboquant_k8v4 (which does not rotate)",
                 lambda b: {"preset": "turboquant_k8v4", "kv_cache": _other_cache(BASE_D, "turboquant_k8v4"),
                            "rotation": np.eye(BASE_D, dtype=f32)}),
        BadInput("rotation-shape", S, "argument", "a rotation of shape [32, 32] at head_dim 64",
                 _kw(rotation=np.eye(32, dtype=f32))),
        BadInput("codebook-bits", S, "argument", "a 3-bit codebook for the 4-bit preset",
                 _kw(codebook=tq_spec.codebook(BASE_D, 3))),
        BadInput("validate-type", S, "argument", "validate='yes'", _kw(validate="yes"),
                 expect=("TypeError", "validate")),
        # ---- metadata values (checked by validation only)
        BadInput("slot-eq-NP", S, "metadata", "slot_mapping entry N*P (one past the cache)",
                 _sm(lambda b: b.n_slots)),
        BadInput("slot-past-NP", S, "metadata", "slot_mapping entry N*P + 5", _sm(lambda b: b.n_slots + 5)),
        BadInput("slot-int32-max", S, "metadata", "int32 slot_mapping entry 2**31 - 1", _sm32(2**31 - 1)),
        BadInput("slot-2pow40", S, "metadata", "int64 slot_mapping entry 2**40", _sm(2**40)),
        BadInput("slot-m2", S, "metadata", "slot_mapping entry -2", _sm(-2)),
        BadInput("slot-int32-min", S, "metadata", "int32 slot_mapping entry -2**31", _sm32(-2**31)),
        BadInput("slot-m2pow40", S, "metadata", "int64 slot_mapping entry -2**40", _sm(-2**40)),
        BadInput("slot-duplicate", S, "metadata", "slot_mapping naming one slot twice",
                 _sm(lambda b: b.store["slot_mapping"][0])),
        # ---- valid edge cases
        BadInput("slots-all-skip", S, "valid", "every slot_mapping entry -1 (nothing written)",
                 lambda b: {"slot_mapping": np.full(4, -1, np.int64)}),
        BadInput("slot-last", S, "valid", "slot_mapping entry N*P - 1 (the last slot)",
                 _sm(lambda b: b.n_slots - 1)),
        BadInput("no-tokens", S, "valid", "T = 0 tokens",
                 lambda b: {"key": b.store["key"][:0], "value": b.store["value"][:0],
                            "slot_mapping": b.store["slot_mapping"][:0]}),
        # ---- framework mix-ups
        BadInput("torch-key-to-jax", S, "framework", "a torch tensor as tq_jax's key",
                 lambda b: {"key": AsTorch(b.store["key"])}, expect=("TypeError", "key"), legs=("jax",)),
        BadInput("numpy-key-to-torch", S, "framework", "a numpy array as tq_torch's key",
                 lambda b: {"key": AsNumpy(b.store["key"])}, expect=("TypeError", "key"), legs=("torch",)),
    ]
    return rows


# Without jax_enable_x64 there are no int64 jax arrays; tq_jax takes numpy metadata and converts it.
_JAX_CONVERTS = (("jax", "tq_jax converts numpy integer metadata to int32 when lossless (documented in "
                          "tq_jax.paged_attention); int64 jax arrays do not exist without jax_enable_x64"),)


def _attention_rows() -> list[BadInput]:
    A = "paged_attention"
    f32 = np.float32
    rows = [
        # ---- argument errors (always checked)
        BadInput("query-int32", A, "argument", "query of dtype int32", _cast("attn", "query", np.int32)),
        BadInput("query-float64", A, "argument", "query of dtype float64", _cast("attn", "query", np.float64)),
        BadInput("query-rank2", A, "argument", "query of rank 2", _reshape("attn", "query", lambda q: q[:, 0])),
        BadInput("query-head-dim", A, "argument", "query head_dim 128 over a head_dim-64 cache",
                 _reshape("attn", "query", lambda q: q.repeat(2, -1))),
        BadInput("query-heads-not-multiple", A, "argument", "Hq = 3 with Hkv = 2",
                 _reshape("attn", "query", lambda q: q[:, :3])),
        BadInput("cache-float", A, "argument", "kv_cache of dtype float32",
                 lambda b: {"kv_cache": b.attention["kv_cache"].astype(f32)}),
        BadInput("cache-slot-bytes", A, "argument", "kv_cache slot_bytes of another preset",
                 lambda b: {"kv_cache": _other_cache(BASE_D, "turboquant_k8v4")}),
        BadInput("block-table-int64", A, "argument", "block_table of dtype int64",
                 _cast("attn", "block_table", np.int64), accepts=_JAX_CONVERTS),
        BadInput("block-table-rank1", A, "argument", "block_table of rank 1",
                 _reshape("attn", "block_table", lambda t: t[:, 0])),
        BadInput("seq-lens-int64", A, "argument", "seq_lens of dtype int64", _cast("attn", "seq_lens", np.int64),
                 accepts=_JAX_CONVERTS),
        BadInput("seq-lens-length", A, "argument", "seq_lens with B + 1 entries",
                 _reshape("attn", "seq_lens", lambda s: np.concatenate([s, [1]]).astype(np.int32))),
        BadInput("qsl-int64", A, "argument", "query_start_loc of dtype int64",
                 _cast("attn", "query_start_loc", np.int64), accepts=_JAX_CONVERTS),
        BadInput("qsl-length", A, "argument", "query_start_loc with B entries (not B + 1)",
                 _reshape("attn", "query_start_loc", lambda s: s[:-1])),
        BadInput("preset-unknown", A, "argument", "preset 'fp8'", _kw(preset="fp8")),
        BadInput("mse-head-dim-96", A, "argument", "mse preset at head_dim 96",
                 lambda b: {"query": b.attention["query"].repeat(2, -1)[..., :96],
                            "kv_cache": _other_cache(96, "turboquant_k8v4")}),
        BadInput("scale-nan", A, "argument", "scale NaN", _kw(scale=float("nan"))),
        BadInput("scale-inf", A, "argument", "scale inf", _kw(scale=float("inf"))),
        BadInput("scale-str", A, "argument", "scale given as a string", _kw(scale="0.125")),
        BadInput("window-0", A, "argument", "sliding_window 0", _kw(sliding_window=0)),
        BadInput("window-negative", A, "argument", "sliding_window -4", _kw(sliding_window=-4)),
        BadInput("window-float", A, "argument", "sliding_window 4.0 (a float)", _kw(sliding_window=4.0)),
        BadInput("window-bool", A, "argument", "sliding_window True", _kw(sliding_window=True)),
        BadInput("softcap-0", A, "argument", "logits_soft_cap 0", _kw(logits_soft_cap=0.0)),
        BadInput("softcap-negative", A, "argument", "logits_soft_cap -5", _kw(logits_soft_cap=-5.0)),
        BadInput("softcap-inf", A, "argument", "logits_soft_cap inf", _kw(logits_soft_cap=float("inf"))),
        BadInput("sinks-shape", A, "argument", "sinks with Hq + 1 entries",
                 _sinks(lambda b: np.zeros(BASE_HQ + 1, f32))),
        BadInput("sinks-float16", A, "argument", "sinks of dtype float16",
                 _sinks(lambda b: np.zeros(BASE_HQ, np.float16))),
        BadInput("sinks-rank2", A, "argument", "sinks of rank 2", _sinks(lambda b: np.zeros((1, BASE_HQ), f32))),
        BadInput("rotation-non-mse", A, "argument", "a rotation for bf16 (which does not rotate)",
                 lambda b: {"preset": "bf16", "kv_cache": _other_cache(BASE_D, "bf16"),
                            "rotation": np.eye(BASE_D, dtype=f32)}),
        BadInput("path-unknown", A, "argument", "path 'prefill'", _kw(path="prefill"),
                 expect=("ValueError", "path")),
        BadInput("path-type", A, "argument", "path given as an int", _kw(path=1), expect=("TypeError", "path")),
        BadInput("validate-type", A, "argument", "validate=1", _kw(validate=1), expect=("TypeError", "validate")),
        # ---- metadata values (checked by validation only)
        BadInput("block-id-eq-N", A, "metadata", "block_table id N (one past the cache) in a used column",
                 _bt(1, 0, BASE_N), affected=(1,)),
        BadInput("block-id-past-N", A, "metadata", "block_table id N + 3 in a used column",
                 _bt(1, 1, BASE_N + 3), affected=(1,)),
        BadInput("block-id-m1", A, "metadata", "block_table id -1 in a used column", _bt(1, 0, -1), affected=(1,)),
        BadInput("block-id-int32-min", A, "metadata", "block_table id -2**31 in a used column",
                 _bt(1, 0, -2**31), affected=(1,)),
        BadInput("block-id-1e6", A, "metadata", "block_table id 10**6 in a used column",
                 _bt(1, 0, 10**6), affected=(1,)),
        BadInput("block-id-int32-max", A, "metadata", "block_table id 2**31 - 1 in a used column",
                 _bt(0, 1, 2**31 - 1), affected=(0,)),
        BadInput("seq-len-past-capacity", A, "metadata", "seq_lens one past the block table's capacity",
                 _sl(1, BASE_WIDTH * BASE_P + 1), affected=(1,)),
        BadInput("seq-len-int32-max", A, "metadata", "seq_lens 2**31 - 1", _sl(1, 2**31 - 1), affected=(1,)),
        BadInput("seq-len-negative", A, "metadata", "seq_lens -1 for a sequence without queries",
                 lambda b: {"seq_lens": np.array([5, 7, -1], np.int32),
                            "query_start_loc": np.array([0, 1, 3, 3], np.int32)}, affected=(2,)),
        BadInput("seq-len-int32-min", A, "metadata", "seq_lens -2**31", _sl(1, -2**31), affected=(1,)),
        BadInput("q-len-past-seq-len", A, "metadata", "q_len 2 > seq_len 1", _sl(1, 1), affected=(1,)),
        BadInput("qsl-decreasing", A, "metadata", "query_start_loc decreasing ([0, 3, 1, 4])",
                 _qsl([0, 3, 1, 4])),
        BadInput("qsl-not-from-0", A, "metadata", "query_start_loc starting at 1", _qsl([1, 2, 4, 4])),
        BadInput("qsl-negative-start", A, "metadata", "query_start_loc starting at -1", _qsl([-1, 1, 3, 4])),
        BadInput("qsl-past-T", A, "metadata", "query_start_loc ending at T + 1", _qsl([0, 1, 3, 5])),
        BadInput("qsl-far-past-T", A, "metadata", "query_start_loc ending at 2**30", _qsl([0, 1, 3, 2**30])),
        BadInput("qsl-int32-extremes", A, "metadata", "query_start_loc [0, 2**31 - 1, -2**31, 4]",
                 _qsl([0, 2**31 - 1, -2**31, 4])),
        # ---- valid edge cases
        BadInput("block-id-unused-column", A, "valid", "an out-of-range block id in a column no token uses",
                 _bt(2, BASE_WIDTH - 1, 10**6)),
        BadInput("padding-rows", A, "valid", "3 NaN query rows past query_start_loc[B] (must be zeros)",
                 _padded_query(3)),
        BadInput("empty-request", A, "valid", "a request with q_len 0 and seq_len 0 (table row all -1)",
                 _with_empty_request),
        BadInput("q-len-0", A, "valid", "a request with q_len 0 and seq_len 5 (no rows)",
                 lambda b: {"query": b.attention["query"][:3],
                            "query_start_loc": np.array([0, 1, 3, 3], np.int32)}),
        BadInput("all-padding", A, "valid", "query_start_loc all 0: every row is padding",
                 _qsl([0, 0, 0, 0])),
        BadInput("empty-batch", A, "valid", "B = 0 sequences (every row padding)", _empty_batch),
        BadInput("no-queries", A, "valid", "T = 0 query rows", _empty_query),
        # ---- framework mix-ups
        BadInput("torch-query-to-jax", A, "framework", "a torch tensor as tq_jax's query",
                 lambda b: {"query": AsTorch(b.attention["query"])}, expect=("TypeError", "query"), legs=("jax",)),
        BadInput("torch-table-to-jax", A, "framework", "a torch tensor as tq_jax's block_table",
                 lambda b: {"block_table": AsTorch(b.attention["block_table"])},
                 expect=("TypeError", "block_table"), legs=("jax",)),
        BadInput("numpy-query-to-torch", A, "framework", "a numpy array as tq_torch's query",
                 lambda b: {"query": AsNumpy(b.attention["query"])}, expect=("TypeError", "query"),
                 legs=("torch",)),
        BadInput("numpy-sinks-to-torch", A, "framework", "numpy sinks given to tq_torch",
                 lambda b: {"sinks": AsNumpy(np.zeros(BASE_HQ, f32))}, expect=("TypeError", "sinks"),
                 legs=("torch",)),
    ]
    return rows


# Known failures: row id -> ((leg or "torch|jax", mode or "*", reason), ...). The errors op reports
# them as xfailed and tests/test_bad_inputs.py marks them xfail(strict=True); remove an entry when
# the kernel is fixed (a pass is reported as xpassed, a failure).
KNOWN: dict[str, tuple] = {
}


def bad_inputs() -> list[BadInput]:
    """Every row, store rows first (ids unique), with its `KNOWN` failures."""
    rows = [replace(r, known=KNOWN.get(r.id, ())) for r in _store_rows() + _attention_rows()]
    unknown = set(KNOWN) - {r.id for r in rows}
    if unknown:
        raise ValueError(f"KNOWN names rows that do not exist: {sorted(unknown)}")
    ids = [r.id for r in rows]
    if len(ids) != len(set(ids)):
        raise ValueError(f"bad-input ids must be unique: {sorted(i for i in ids if ids.count(i) > 1)}")
    return rows


def row_by_id(row_id: str) -> BadInput:
    for r in bad_inputs():
        if r.id == row_id:
            return r
    raise KeyError(f"no bad-input row {row_id!r}")
