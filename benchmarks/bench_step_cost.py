"""What one decode step of each verification bucket costs, and why: XLA's own count of the
step's arithmetic and memory traffic next to its measured time.

For S slots, K drafts per slot and a cache of T positions, every piece of the scheduler's
step-rate table (`dspark_jax.decoding.profiling`): the drafter's block, the step without drafts
(one query per slot) and each packed verification bucket of N tokens, compiled as the decode
loop compiles it (writes deferred past the bucket switch) and read back through
`Compiled.cost_analysis()` — GFLOP and MB accessed per step, deterministic, whatever the
machine's load — and the matmul rows each step multiplies (N, or 3·N with bf16 weights, whose
`narrow_weight_dot` stacks each activation's three bf16 terms as rows). `--time` adds the
measured table (`measure_step_rates`, round-robin medians; needs a quiet machine).

    python -m benchmarks.bench_step_cost [--slots 8] [--cache-len 256,512] [--weight-dtype bfloat16]
        [--weight-terms 3] [--drafter smollm2-135m-dspark+ngram] [--sampled] [--time]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import dspark_jax as ds
from benchmarks.common import hardware, machine_load, table
from dspark_jax.decoding.decode_loop import verify_bucket
from dspark_jax.decoding.profiling import default_buckets, measure_step_rates, spread_drafts, step_inputs


@functools.partial(jax.jit, static_argnames=("tgraph", "drafter", "num_tokens", "q_max", "defer_to"),
                   donate_argnames=("cache", "dcache"))
def _one_verify(tgraph, tstate, drafter, dparams, cache, dcache, seq_len_S, anchor_S, sa, keys, d_tok, d_logits, nv,
                active, *, num_tokens, q_max, defer_to):
    target = nnx.merge(tgraph, tstate)
    accepted, emitted, writes = verify_bucket(target, drafter, dparams, cache, dcache, seq_len_S, anchor_S, sa, keys,
                                              d_tok, d_logits, nv, active, num_tokens=num_tokens, q_max=q_max,
                                              defer_to=defer_to)
    cache, dcache = writes.apply(target, drafter, dparams, cache, dcache)
    return cache, dcache, accepted, emitted


@functools.partial(jax.jit, static_argnames=("tgraph", "drafter"))
def _one_draft(tgraph, tstate, drafter, dparams, dcache, anchor_S, pos_S, keys, sa):
    target = nnx.merge(tgraph, tstate)
    tok, logits, conf = drafter.draft(dparams, dcache, target, anchor_S, pos_S, keys, sa)
    return tok, conf, (None if sa.all_greedy else logits)


def _cost(compiled) -> tuple[float, float]:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list) else c
    return float(c.get("flops", 0.0)) / 1e9, float(c.get("bytes accessed", 0.0)) / 1e6


def step_costs(target, drafter, *, slots: int, num_draft: int, cache_len: int, greedy: bool):
    """[(piece, packed tokens, GFLOP, MB accessed)] for the draft, the no-draft step and each bucket."""
    S, K, T = slots, num_draft, cache_len
    buckets = default_buckets(S, K)
    x = step_inputs(target, drafter, slots=S, num_draft=K, cache_len=T, greedy=greedy)
    dparams, cache, dcache, sa, keys, pos, anchor = (x[k] for k in ("dparams", "cache", "dcache", "sa", "keys", "pos",
                                                                    "anchor"))
    d_tok, d_logits, active = x["d_tok"], x["d_logits"], x["active"]
    tg, ts = target.graphdef, target.state
    rows = [("draft", S, *_cost(_one_draft.lower(tg, ts, drafter, dparams, dcache, anchor, pos, keys, sa).compile()))]
    for name, n, q in [("no drafts", S, 1)] + [("verify", b, K + 1) for b in buckets]:
        nv = jnp.asarray(spread_drafts(n - S, S, K))
        low = _one_verify.lower(tg, ts, drafter, dparams, cache, dcache, pos, anchor, sa, keys, d_tok, d_logits, nv,
                                active, num_tokens=n, q_max=q, defer_to=max(buckets))
        rows.append((name, n, *_cost(low.compile())))
    return rows, buckets


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default="smollm2-135m-dspark+ngram")
    ap.add_argument("--weight-dtype", default="bfloat16", help="bfloat16 or float32 (the weights as stored)")
    ap.add_argument("--weight-terms", type=int, default=3,
                    help="bf16 terms per activation under bf16 weights (ModelConfig.weight_terms; 1 = rounded)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--num-draft", type=int, default=7)
    ap.add_argument("--cache-len", default="256,512", help="comma-separated cache lengths (attention windows)")
    ap.add_argument("--sampled", action="store_true", help="the sampled cycle (default: all greedy)")
    ap.add_argument("--time", action="store_true", help="also measure the step-rate table (quiet machine)")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    wd = None if a.weight_dtype == "float32" else a.weight_dtype
    target = ds.load_target(a.target, weight_dtype=wd, weight_terms=a.weight_terms)
    drafter = ds.load_drafter(a.drafter, target)
    terms = 1 if wd is None else a.weight_terms
    print(f"{hardware()}; {a.target} weights {a.weight_dtype} ({terms} term(s) a row), drafter {a.drafter}, "
          f"S = {a.slots}, K = {a.num_draft}, "
          f"{'sampled' if a.sampled else 'greedy'}; {machine_load()}")
    for T in (int(t) for t in a.cache_len.split(",")):
        rows, buckets = step_costs(target, drafter, slots=a.slots, num_draft=a.num_draft, cache_len=T,
                                   greedy=not a.sampled)
        ms = {}
        if a.time:
            r = measure_step_rates(target, drafter, slots=a.slots, num_draft=a.num_draft, cache_len=T,
                                   buckets=buckets, repeats=a.repeats, greedy=not a.sampled)
            ms = {("draft", a.slots): r.draft_s, ("no drafts", a.slots): r.ar_s}
            ms.update({("verify", b): v for b, v in zip(buckets, r.verify_s)})
        out = [[name, n, "–" if name == "draft" else n * terms, f"{gf:.2f}", f"{mb:.0f}",
                f"{ms[(name, n)] * 1e3:.1f}" if (name, n) in ms else "–"] for name, n, gf, mb in rows]
        print(f"\ncache length {T}:")
        print(table(["piece", "packed tokens", "matmul rows", "GFLOP", "MB accessed (XLA)", "measured ms"], out))
    print(f"\n{machine_load()} at end")


if __name__ == "__main__":
    main()
