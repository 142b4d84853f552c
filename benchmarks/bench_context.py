"""Target step cost against the context actually used, the packed step against its bare
matmul chain, and decoding with finished requests (SmolLM2-135M fp32).

1. **Context** — one-token decode steps of 1 request with 128 / 512 / 2048 tokens of context
   in an 8,192-token cache: attention over the whole cache, over the attention window
   `generate()` uses (the smallest of 256, 512, … holding the context), and in a cache just
   big enough (the old best case), next to the weights-read floor (parameter bytes ÷ the
   machine's measured read bandwidth: no step can be faster).
2. **Packed step vs bare chain** — the packed step for 1..32 tokens at 1 and 8 requests
   (context 256, window 512) next to the same dense matmuls (Q/K/V/O, MLP, norms, LM head)
   on N tokens with no attention, cache write or grid gather: the difference is what the
   attention machinery costs.
3. **Decode vs bare chain** — one-token decode steps of S = 1 … 64 requests (context 256 in a
   512 cache by default; `--decode-contexts` picks other context:cache pairs, e.g. 240:256, a
   context the 256 window holds) next to the bare chain of S tokens.
4. **Finished requests** — `generate()` on 8 requests of which 7 stop after 8 tokens and one
   runs 256: with slot compaction (the long request decodes alone in a 1-slot bucket) and
   without (8 slots until the end).

Steps are timed inside one jitted `fori_loop` of 8 steps (as the engine runs them: no
per-call dispatch), configurations round-robin for `--repeats` rounds; median (min–max).

    python -m benchmarks.bench_context [--repeats 7] [--skip-compaction] [--skip-context] [--skip-packed]
        [--skip-decode] [--decode-sizes 1,4,16,64] [--decode-contexts 240:256,256:512] [--scan-layers]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import dspark_jax as ds
from benchmarks.common import hardware, interleaved, machine_load, median, spread, table
from dspark_jax.decoding.generate import attention_windows, pick_window
from dspark_jax.models.transformer import KVCache

INNER = 8


def step_loop(target, R, ctx, cache_len, window, q=1):
    """INNER packed steps of q tokens for each of R requests (context `ctx`), chained in one jit."""
    starts, counts = jnp.full(R, ctx, jnp.int32), jnp.full(R, q, jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(tstate, cache, toks):
        t = nnx.merge(target.graphdef, tstate)

        def body(i, carry):
            c, x = carry
            lg, _, c = t(c, x, starts, counts, q_max=q, kv_window=window)
            nxt = jnp.argmax(lg, -1).astype(jnp.int32)  # [R·q]
            return c, nxt

        return jax.lax.fori_loop(0, INNER, body, (cache, toks))

    state = {"c": KVCache.zeros(target.cfg, R, cache_len)}
    toks = jnp.ones(R * q, jnp.int32)

    def run():
        state["c"], x = loop(target.state, state["c"], toks)
        jax.block_until_ready(x)

    return run


def bare_loop(target, N):
    """INNER passes of the target's dense matmul chain over N tokens (no attention, no cache)."""

    @jax.jit
    def loop(tstate, x0):
        t = nnx.merge(target.graphdef, tstate)

        def body(i, x):
            h = t.embed(x)
            for layer in t.layers:
                a = layer.input_layernorm(h)
                q = layer.self_attn.q_proj(a)
                k, v = layer.self_attn.k_proj(a), layer.self_attn.v_proj(a)
                h = h + layer.self_attn.o_proj(q) + 0.0 * (k.sum() + v.sum())
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            return jnp.argmax(t.unembed(h), -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, INNER, body, x0)

    x0 = jnp.ones(N, jnp.int32)

    def run():
        jax.block_until_ready(loop(target.state, x0))

    return run


def read_bandwidth(n_bytes=512 << 20, repeats=5) -> float:
    """Bytes/s of one streaming read (a jitted sum over an fp32 array), median of `repeats`."""
    x = jnp.ones(n_bytes // 4, jnp.float32)
    f = jax.jit(jnp.sum)
    times = interleaved({"sum": lambda: jax.block_until_ready(f(x))}, repeats=repeats)
    return n_bytes / median(times["sum"])


def per_step(times):
    return {k: [t / INNER for t in v] for k, v in times.items()}


def context_table(target, repeats):
    big = 8192
    configs = {}
    for ctx in (128, 512, 2048):
        win = pick_window(attention_windows(big), ctx + 1) or big
        fit = max(128, 1 << ctx.bit_length())  # the smallest power-of-two cache holding ctx + 1
        configs[(ctx, "whole 8192 cache")] = step_loop(target, 1, ctx, big, None)
        configs[(ctx, f"window {win} of 8192")] = step_loop(target, 1, ctx, big, win)
        configs[(ctx, f"cache of {fit}")] = step_loop(target, 1, ctx, fit, None)
    times = per_step(interleaved(configs, repeats=repeats))
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(target.state))
    bw = read_bandwidth()
    floor = n_bytes / bw
    rows = [[ctx, how, spread(times[(ctx, how)], 1e3), f"{median(times[(ctx, how)]) / floor:.2f}"]
            for ctx, how in configs]
    return rows, floor, n_bytes, bw


def packed_vs_bare(target, bare_target, repeats, sizes=(1, 2, 4, 8, 16, 32), requests=(1, 8)):
    configs = {}
    for R in requests:
        for N in sizes:
            if N % R:
                continue
            configs[("packed", R, N)] = step_loop(target, R, 256, 512, None, q=N // R)
    for N in sizes:
        configs[("bare", 0, N)] = bare_loop(bare_target, N)
    times = per_step(interleaved(configs, repeats=repeats))
    rows = []
    for kind, R, N in configs:
        if kind != "packed":
            continue
        t, b = median(times[(kind, R, N)]), median(times[("bare", 0, N)])
        rows.append([R, N, spread(times[(kind, R, N)], 1e3), spread(times[("bare", 0, N)], 1e3), f"{t / b:.2f}"])
    return rows


def decode_vs_bare(target, bare_target, repeats, sizes=(1, 4, 16, 64), ctx=256, cache_len=512):
    """One-token decode steps of S requests (context `ctx`, window = cache) next to the bare
    chain of S tokens: the issue's "≤ 1.3× the matmuls" ratio for S = 1 … 64."""
    configs = {}
    for S in sizes:
        configs[("decode", S)] = step_loop(target, S, ctx, cache_len, None)
        configs[("bare", S)] = bare_loop(bare_target, S)
    times = per_step(interleaved(configs, repeats=repeats))
    rows = []
    for S in sizes:
        t, b = median(times[("decode", S)]), median(times[("bare", S)])
        rows.append([S, spread(times[("decode", S)], 1e3), spread(times[("bare", S)], 1e3), f"{t / b:.2f}",
                     f"{S / t:.0f}"])
    return rows


def compaction_table(target, repeats):
    from benchmarks.common import eval_prompts
    ps = eval_prompts("mt-bench", 8)
    sp = [ds.SamplingParams(temperature=0.0, max_new_tokens=256 if i == 0 else 8, ignore_eos=True)
          for i in range(8)]
    outs = {}

    def gen(compact):
        def run():
            outs[compact] = ds.generate(target, ps, sampling=sp, compact_slots=compact)
        return run

    configs = {"slot compaction": gen(True), "no compaction": gen(False)}
    times = interleaved(configs, repeats=repeats)
    same = outs[True].token_ids == outs[False].token_ids
    rows = []
    for (name, ts), key in zip(times.items(), (True, False)):
        n = outs[key].stats["new_tokens"]
        rows.append([name, spread(ts, 1.0), f"{n / median(ts):.1f}", outs[key].stats["buckets"]["slot_buckets"]])
    return rows, same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-compaction", action="store_true")
    ap.add_argument("--skip-context", action="store_true")
    ap.add_argument("--skip-packed", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--decode-sizes", default="1,4,16,64")
    ap.add_argument("--decode-contexts", default="256:512",
                    help="CONTEXT:CACHE pairs for the decode table, comma-separated (e.g. 240:256,256:512: "
                         "a context the 256 window holds, and one that rounds up to 512)")
    ap.add_argument("--scan-layers", action="store_true", help="the scanned-layers target (default: unrolled)")
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m", scan_layers=args.scan_layers)
    # The bare chain walks the layers one by one: always from the unrolled target.
    bare_target = ds.load_target("smollm2-135m") if args.scan_layers else target
    print(f"# SmolLM2-135M-Instruct fp32 — {hardware()}")
    print(f"# before: {machine_load()}\n")
    if not args.skip_context:
        rows, floor, n_bytes, bw = context_table(target, args.repeats)
        print(f"## One-token step vs context (1 request; weights {n_bytes / 2**20:.0f} MiB, read bandwidth "
              f"{bw / 1e9:.1f} GB/s → floor {floor * 1e3:.2f} ms)\n")
        print(table(["context", "attention over", "ms / step", "× weights-read floor"], rows), flush=True)
    if not args.skip_packed:
        print("\n## Packed step vs the bare matmul chain (context 256, cache 512)\n")
        print(table(["requests", "packed tokens", "packed step ms", "bare chain ms", "packed / bare"],
                    packed_vs_bare(target, bare_target, args.repeats)), flush=True)
    if not args.skip_decode:
        sizes = tuple(int(x) for x in args.decode_sizes.split(","))
        for pair in args.decode_contexts.split(","):
            ctx, cache_len = (int(x) for x in pair.split(":"))
            if ctx + 1 > cache_len:
                raise SystemExit(f"--decode-contexts {pair}: context {ctx} + 1 does not fit a cache of {cache_len}")
            print(f"\n## Decode step of S one-token requests vs the bare chain of S tokens (context {ctx}, "
                  f"cache {cache_len}, scan_layers={args.scan_layers})\n")
            print(table(["requests S", "decode step ms", "bare chain ms", "decode / bare", "tokens / s"],
                        decode_vs_bare(target, bare_target, args.repeats, sizes, ctx=ctx, cache_len=cache_len)),
                  flush=True)
    if not args.skip_compaction:
        rows, same = compaction_table(target, max(3, args.repeats // 2))
        print(f"\n## 8 requests, 7 stop after 8 tokens, one runs 256 (greedy; outputs identical: {same})\n")
        print(table(["generate()", "seconds, median (min–max)", "tokens / s", "slot buckets"], rows))
    print(f"\n# after: {machine_load()}")


if __name__ == "__main__":
    main()
