"""Strip the always-on attention metadata guards from a copy of the tree, to measure their cost.

Usage: `python docs/bench/strip_guards.py DIR` patches DIR/tq_torch and DIR/tq_jax in place (DIR a
`git archive` of main). Valid metadata gives the same output with or without the guards; then run
`python -m parity.bench --quick --ops decode` in both trees in one device call (docs/bench/steps.md).
"""
import pathlib
import sys

root = pathlib.Path(sys.argv[1])

def patch(rel, pairs):
    p = root / rel
    s = p.read_text()
    for old, new in pairs:
        assert old in s, (rel, old)
        s = s.replace(old, new)
    p.write_text(s)

patch("tq_torch/_src/attention_kernel.py", [
    ("    seq, q_start, q_len = _find_sequence(qsl_ptr, pid, num_seqs, num_tokens, block_q, SEQ_CHUNK)\n",
     """    lo = pid * 0
    hi = pid * 0 + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        take = tl.load(qsl_ptr + mid) // block_q + mid <= pid
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
"""),
    ("    seq_len = _clamp(tl.load(seq_lens_ptr + seq), 0, max_seq_len)\n",
     "    seq_len = tl.load(seq_lens_ptr + seq)\n"),
])
patch("tq_torch/_src/kv_tiles.py", [
    ("    return tl.where((blk >= 0) & (blk < num_blocks), blk, -1)\n", "    return blk\n"),
])
patch("tq_jax/_src/attention_kernel.py", [
    ("    b, q_start, q_len = _find_sequence(qsl_ref, p, num_seqs, t_total, bq)\n",
     """    seq = lax.broadcasted_iota(jnp.int32, (km.next_pow2(max(num_seqs, 2)),), 0)
    seq_c = jnp.minimum(seq, num_seqs - 1)
    first_tile = km.div_nonneg(qsl_ref[seq_c], bq) + seq_c
    b = jnp.maximum(jnp.sum(jnp.where((seq < num_seqs) & (first_tile <= p), 1, 0)) - 1, 0)
    q_start = qsl_ref[b]
    q_len = qsl_ref[b + 1] - q_start
"""),
    ("        seq_len = jnp.clip(sl_ref[b], 0, spec.max_blocks * spec.block_size)\n",
     "        seq_len = sl_ref[b]\n"),
])
patch("tq_jax/_src/kv_tiles.py", [
    ("    return jnp.where((blk >= 0) & (blk < spec.num_blocks), blk, -1)\n", "    return blk\n"),
])
print("guards stripped in", root)
