"""Greedy generation with a small Llama/Gemma-style NNX decoder on a paged TurboQuant cache.

    python -m tq_jax.examples.generate --tiny     # 2 layers, D=64: ~30 s on 2 CPU cores (Pallas interpret mode)
    python -m tq_jax.examples.generate            # 4 layers, D=128, every preset (GPU; ~2 min on CPU)
    python -m tq_jax.examples.generate --bf16-ends --presets turboquant_4bit_nc   # per-layer presets

Random weights; the point is the plumbing and the quality of the cache, not
the text. Per preset the same model (same weights) runs:

1. batched prefill of ragged prompts in one bucketed call (`tq_jax.paging`
   builds block tables, slot mappings, positions and last-token indices on
   device), then
2. a jitted on-device greedy loop (`lax.fori_loop`; paging, the model and
   the sampler all inside one compiled program; model state and page state
   donated),

and is compared with the same model on a dense unquantized cache
(`tq_jax.nnx.DenseKVCache`): worst-row logit cosine and argmax agreement
(teacher-forced on the dense model's tokens, so every row sees the same
context), the free-running greedy tokens' agreement (random weights give
nearly tied logits: one flip and the continuations part), decode tokens/s
(a GPU number; on CPU it measures the interpreter), and the cache memory.

The model: RMSNorm, GQA attention with RoPE (`tq_jax.nnx.Attention`), SwiGLU
MLP; layers alternate sliding window (with a logit soft cap) and global
(with learned sinks); with 4+ layers the last one shares the cache of the
last global layer (KV sharing / YOCO).

Sliding-window pages: the window layers keep their caches in a page pool of
their own (as vLLM's hybrid allocator does). After every step (prefill and
each decode step, inside the compiled loop) `tq_jax.paging.release_out_of_window`
returns the pages no future query can see to that pool, so it only needs
``ceil((W - 1) / P) + 1`` pages per sequence while decoding instead of the whole
context; the global layers' pool holds every page. The outputs do not change
(the block table keeps the released ids, which the kernels mask; the test
checks logits and tokens equal with and without release). ``--no-window-release``
puts every layer in one pool and releases nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tq_spec
from tq_jax import paging
from tq_jax.nnx import Attention, cache_bytes_per_token

ALL_PRESETS = ("bf16", "fp16") + tuple(p for p in tq_spec.PRESET_NAMES if p.startswith("turboquant_"))


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    embed_dim: int = 256
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    mlp_dim: int = 512
    window: int = 16
    soft_cap: float = 50.0
    page_size: int = 16
    prompt_lens: tuple = (37, 12, 50, 5)
    prefill_bucket: int = 128
    yoco: bool = True
    release_window: bool = True  # window layers: own page pool, pages behind the window released each step


TINY = Config(vocab=128, embed_dim=128, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=256,
              window=8, page_size=8, prompt_lens=(11, 5, 8), prefill_bucket=32, yoco=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * self.scale[...]
        return y.astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, preset, window, num_blocks, rngs, kv_source=None, pool="full"):
        lin = dict(use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
        self.pool = pool  # which page pool's metadata this layer's cache follows
        self.norm1, self.norm2 = RMSNorm(cfg.embed_dim), RMSNorm(cfg.embed_dim)
        self.attn = Attention(embed_dim=cfg.embed_dim, num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, preset=preset, num_blocks=num_blocks, block_size=cfg.page_size,
                              kv_source=kv_source, sliding_window=window,
                              logits_soft_cap=cfg.soft_cap if window else None, use_sinks=not window, rngs=rngs)
        if not window:  # nonzero sinks, identical for every preset (not drawn from rngs)
            self.attn.sinks[...] = jnp.linspace(-1.0, 1.0, cfg.num_q_heads, dtype=jnp.float32)
        self.gate = nnx.Linear(cfg.embed_dim, cfg.mlp_dim, **lin)
        self.up = nnx.Linear(cfg.embed_dim, cfg.mlp_dim, **lin)
        self.down = nnx.Linear(cfg.mlp_dim, cfg.embed_dim, **lin)

    def __call__(self, x, metas):
        x = x + self.attn(self.norm1(x), metas[self.pool])
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    """``tokens int32[T], metas -> logits float32[B, vocab]`` at each request's last new token.

    ``metas``: ``{"full": StepMetadata}``, plus ``"window"`` when the window layers have a pool of their own.
    ``preset``: one preset for every layer, or one per layer; ``"dense"`` is the unquantized reference.
    ``window_blocks``: pages of the window layers' own pool (None: they share the ``num_blocks`` pool).
    """

    def __init__(self, cfg: Config, preset, *, num_blocks: int, window_blocks: int | None = None, seed: int = 0):
        rngs = nnx.Rngs(seed)  # caches draw nothing: every preset gets the same weights
        presets = list(preset) if isinstance(preset, (list, tuple)) else [preset] * cfg.num_layers
        self.embed = nnx.Embed(cfg.vocab, cfg.embed_dim, dtype=jnp.bfloat16, rngs=rngs)
        blocks = []
        for i in range(cfg.num_layers):
            window = cfg.window if i % 2 == 0 else None
            shared = cfg.yoco and cfg.num_layers >= 4 and i == cfg.num_layers - 1
            src = blocks[i - 2].attn if shared else None  # the last global layer before it
            own_pool = window is not None and not shared and window_blocks is not None
            blocks.append(Block(cfg, preset=presets[i], window=None if shared else window,
                                num_blocks=window_blocks if own_pool else num_blocks, rngs=rngs, kv_source=src,
                                pool="window" if own_pool else "full"))
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
        self.norm = RMSNorm(cfg.embed_dim)

    def __call__(self, tokens, metas):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, metas)
        x = self.norm(x[metas["full"].last_token_index])
        return self.embed.attend(x).astype(jnp.float32)

    def cache_bytes(self) -> int:
        return sum(b.attn.cache.nbytes for b in self.blocks if b.attn.cache is not None)


# ----------------------------------------------------------------- the two compiled programs


def _paged_step(pools, seq_ids, new_tokens, rows):
    """Every pool grows the sequences by ``new_tokens``; returns the pools, their metadata and ``ok``."""
    ok, metas, grown = jnp.bool_(True), {}, {}
    for name, state in pools.items():
        state, ok_i = paging.append(state, seq_ids, new_tokens)
        grown[name], ok = state, ok & ok_i
        metas[name] = paging.step_metadata(state, seq_ids, new_tokens, num_tokens=rows)
    return grown, metas, ok


def _release(pools, seq_ids, window):
    """After a step: the window pool gets back the pages wholly behind every sequence's window."""
    if "window" in pools:
        pools = dict(pools, window=paging.release_out_of_window(pools["window"], seq_ids, window))
    return pools


@functools.partial(jax.jit, static_argnames=("window",))
def _prefill(graphdef, state, pools, tokens, seq_ids, prompt_lens, *, window):
    model = nnx.merge(graphdef, state)
    pools, metas, ok = _paged_step(pools, seq_ids, prompt_lens, tokens.shape[0])
    logits = model(tokens, metas)
    return logits, nnx.state(model), _release(pools, seq_ids, window), ok


def _decode_loop(graphdef, state, pools, first, forced, use_forced, seq_ids, *, rows, window):
    """``forced.shape[0]`` greedy steps; step ``i`` feeds ``forced[i-1]`` instead of the argmax when ``use_forced``.

    Also returns the fewest free pages each pool had right after a step's allocation.
    """
    steps, b = forced.shape
    ones = jnp.where(seq_ids >= 0, 1, 0).astype(jnp.int32)

    def body(i, carry):
        state, pools, tok, all_logits, all_tok, ok, low = carry
        model = nnx.merge(graphdef, state)
        pools, metas, ok_i = _paged_step(pools, seq_ids, ones, rows)
        low = {k: jnp.minimum(low[k], pools[k].num_free) for k in low}
        tokens = jnp.zeros((rows,), jnp.int32).at[:b].set(tok)
        logits = model(tokens, metas)
        nxt = jnp.where(use_forced, forced[i], jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return (nnx.state(model), _release(pools, seq_ids, window), nxt, all_logits.at[i].set(logits),
                all_tok.at[i].set(nxt), ok & ok_i, low)

    vocab = nnx.merge(graphdef, state).embed.num_embeddings
    init = (state, pools, first, jnp.zeros((steps, b, vocab), jnp.float32), jnp.zeros((steps, b), jnp.int32),
            jnp.bool_(True), {k: p.num_free for k, p in pools.items()})
    state, pools, _, logits, toks, ok, low = jax.lax.fori_loop(0, steps, body, init)
    return logits, toks, state, pools, ok, low


_decode = jax.jit(_decode_loop, static_argnames=("rows", "window"), donate_argnums=(1, 2))


def window_pool_pages(cfg: Config) -> int:
    """Pages the window layers' own pool needs: the whole ragged prefill, then while decoding (one token
    per step, released after each step) at most ``ceil((W - 1) / P) + 1`` per sequence."""
    p = cfg.page_size
    prefill = sum(-(-n // p) for n in cfg.prompt_lens)
    return max(prefill, len(cfg.prompt_lens) * (-(-(cfg.window - 1) // p) + 1))


def run(cfg: Config, preset, *, steps: int, forced=None, seed: int = 0):
    """Prefill + ``steps`` greedy decode steps. Returns a dict of logits ``[steps + 1, B, V]``, tokens,
    decode seconds (compiled, excluding compilation), cache bytes, and per page pool its size and the
    fewest free pages seen after any decode step's allocation (``pools``)."""
    b = len(cfg.prompt_lens)
    max_len = max(cfg.prompt_lens) + steps + 1
    max_pages = -(-max_len // cfg.page_size)
    num_blocks = b * max_pages
    split = cfg.release_window and cfg.window and cfg.num_layers > 1
    window_blocks = window_pool_pages(cfg) if split else None
    model = Decoder(cfg, preset, num_blocks=num_blocks, window_blocks=window_blocks, seed=seed)
    graphdef, state = nnx.split(model)
    pools = {"full": paging.init_pages(num_blocks, b, max_pages, cfg.page_size)}
    if split:
        pools["window"] = paging.init_pages(window_blocks, b, max_pages, cfg.page_size)
    sizes = {k: int(v.free_pages.shape[0]) for k, v in pools.items()}
    window = cfg.window if split else None
    rng = np.random.default_rng(1234)  # same prompts for every preset
    prompts = [rng.integers(0, cfg.vocab, n) for n in cfg.prompt_lens]
    tokens = np.zeros(cfg.prefill_bucket, np.int32)
    tokens[:sum(cfg.prompt_lens)] = np.concatenate(prompts)
    seq_ids = np.arange(b, dtype=np.int32)
    logits0, state, pools, ok = _prefill(graphdef, state, pools, tokens, seq_ids,
                                         np.array(cfg.prompt_lens, np.int32), window=window)
    assert bool(ok), "prefill: out of pages"
    first = jnp.argmax(logits0, axis=-1).astype(jnp.int32)
    use_forced = forced is not None
    if use_forced:
        first = jnp.asarray(forced[0])
        forced_rest = jnp.asarray(forced[1:])
    else:
        forced_rest = jnp.zeros((steps, b), jnp.int32)
    rows = -(-b // 8) * 8  # decode bucket: B rows rounded up to 8 (padding rows exercise the masking)
    args = (graphdef, state, pools, first, forced_rest, jnp.bool_(use_forced), seq_ids)
    compiled = _decode.lower(*args, rows=rows, window=window).compile()
    t0 = time.perf_counter()
    logits, toks, state, pools, ok, low = compiled(*args)
    logits.block_until_ready()
    seconds = time.perf_counter() - t0
    assert bool(ok), "decode: out of pages"
    all_logits = np.concatenate([np.asarray(logits0)[None], np.asarray(logits)])
    all_tokens = np.concatenate([np.asarray(first)[None], np.asarray(toks)])
    return dict(logits=all_logits, tokens=all_tokens, seconds=seconds, cache_bytes=model.cache_bytes(),
                decode_tokens=steps * b, pools={k: dict(pages=sizes[k], min_free=int(low[k])) for k in sizes})


def compare(cfg: Config, presets, *, steps: int, seed: int = 0, verbose: bool = True):
    """Per preset: worst-row cosine and argmax agreement of logits against the dense model (teacher-forced on
    its tokens), free-running greedy token agreement, decode tokens/s, cache bytes and bytes per token."""
    dense = run(cfg, "dense", steps=steps, seed=seed)
    per_tok_layers = cfg.num_layers - (1 if cfg.yoco and cfg.num_layers >= 4 else 0)
    results = {}
    if verbose:
        print(f"model: {cfg.num_layers} layers, E={cfg.embed_dim}, Hq={cfg.num_q_heads}, Hkv={cfg.num_kv_heads}, "
              f"D={cfg.head_dim}, window={cfg.window} (even layers), vocab={cfg.vocab}; prompts {cfg.prompt_lens}, "
              f"{steps} greedy steps; backend {jax.default_backend()}")
        pools = dense["pools"]
        if "window" in pools:
            held = sum(-(-(n + steps) // cfg.page_size) for n in cfg.prompt_lens)
            print(f"page pools: global layers {pools['full']['pages']} pages; window layers "
                  f"{pools['window']['pages']} pages, pages behind the window released every step (fewest free "
                  f"after a step: {pools['window']['min_free']}; kept, the sequences would hold {held})")
        else:
            print(f"page pool: {pools['full']['pages']} pages for every layer (no window release)")
        print(f"{'preset':20s} {'worst cos':>10s} {'mean cos':>9s} {'argmax':>7s} {'greedy':>7s} {'tok/s':>9s} "
              f"{'cache KiB':>10s} {'B/token':>8s}")
    for preset in presets:
        name = preset if isinstance(preset, str) else "+".join(dict.fromkeys(preset))
        layer_presets = [preset] * cfg.num_layers if isinstance(preset, str) else list(preset)
        forced = run(cfg, preset, steps=steps, forced=dense["tokens"], seed=seed)
        free = run(cfg, preset, steps=steps, seed=seed)
        a, d = forced["logits"].reshape(-1, cfg.vocab), dense["logits"].reshape(-1, cfg.vocab)
        cos = np.sum(a * d, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(d, axis=-1))
        r = dict(worst_cosine=float(cos.min()), mean_cosine=float(cos.mean()),
                 argmax_agreement=float(np.mean(a.argmax(-1) == d.argmax(-1))),
                 greedy_agreement=float(np.mean(free["tokens"] == dense["tokens"])),
                 tokens_per_s=free["decode_tokens"] / free["seconds"], cache_bytes=free["cache_bytes"],
                 bytes_per_token=cache_bytes_per_token(layer_presets[:per_tok_layers], head_dim=cfg.head_dim,
                                                       num_kv_heads=cfg.num_kv_heads))
        results[name] = r
        if verbose:
            print(f"{name:20s} {r['worst_cosine']:10.6f} {r['mean_cosine']:9.6f} {r['argmax_agreement']:7.3f} "
                  f"{r['greedy_agreement']:7.3f} {r['tokens_per_s']:9.1f} {r['cache_bytes'] / 1024:10.1f} "
                  f"{r['bytes_per_token']:8d}")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model (2 layers, D=64), default presets bf16 "
                                                        "and turboquant_4bit_nc")
    ap.add_argument("--presets", default=None, help=f"comma-separated, from {','.join(ALL_PRESETS)}")
    ap.add_argument("--steps", type=int, default=None, help="greedy decode steps (default 8 tiny, 32 otherwise)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16-ends", action="store_true",
                    help="first and last layer keep a bf16 cache (vLLM's boundary layers), the others the preset")
    ap.add_argument("--no-window-release", action="store_true",
                    help="one page pool for every layer, nothing released (default: the window layers have their "
                         "own pool and give back the pages behind the window after every step)")
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else Config()
    if args.no_window_release:
        cfg = dataclasses.replace(cfg, release_window=False)
    default = "bf16,turboquant_4bit_nc" if args.tiny else ",".join(ALL_PRESETS)
    presets = [p.strip() for p in (args.presets or default).split(",") if p.strip()]
    for p in presets:
        if p not in ALL_PRESETS:
            ap.error(f"--presets: unknown preset {p!r}; expected some of {', '.join(ALL_PRESETS)}")
    steps = args.steps if args.steps is not None else (8 if args.tiny else 32)
    if args.bf16_ends:
        n = cfg.num_layers
        presets = [p if p in ("bf16", "fp16") else tuple("bf16" if i in (0, n - 1) else p for i in range(n))
                   for p in presets]
    return compare(cfg, presets, steps=steps, seed=args.seed)


if __name__ == "__main__":
    main()
