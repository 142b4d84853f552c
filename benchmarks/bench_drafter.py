"""Drafter cost on SmolLM2-135M (fp32): time to draft one block, next to one target decode step.

For γ ∈ {7, 15}, 1 and 2 draft layers, Markov and RNN heads, at 1 and 16 requests (context
of 256 tokens each): ms per drafted block (timed inside one jitted loop, as the engine
drafts), and the sequential head's share, measured as the difference to the same drafter
with head "none" and no confidence head (the parallel DFlash drafter, identical backbone).
The target decode step is one packed step with one token per request. At each request
count all configurations run round-robin for `--repeats` rounds; tables give median
(min–max) and the machine's load average.

    python -m benchmarks.bench_drafter [--repeats 7] [--requests 1 16]
    python -m benchmarks.bench_drafter --levers [--repeats 7]

`--levers`: γ = 7, 2 draft layers, Markov r = 256, adding each cost lever in turn — full
vocabulary → draft vocabulary of 32k / 16k / 8k tokens → top-k sequential bias (k = 32) →
greedy (temperature 0) — as draft-block time ÷ target decode-step time.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import dspark_jax as ds
from benchmarks.common import hardware, interleaved, machine_load, median, spread, table
from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams
from dspark_jax.models.drafters import Drafter
from dspark_jax.models.transformer import KVCache

CTX, CACHE = 256, 512


INNER = 8  # calls per timed sample, chained inside one jit


def draft_fn(target, drafter, R, temperature=1.0):
    """A closure drafting INNER blocks for R requests in one jitted loop (blocks on the result).

    The engine drafts inside its on-device loop, so the timing does too: one call runs INNER
    blocks in a `fori_loop` (each anchored on the previous block's first draft, so nothing is
    loop-invariant) and a sample is its time / INNER — no per-call dispatch of the target's
    and drafter's parameter trees in the figure. Greedy drafting computes no logits (greedy
    verification never reads them), as in the engine."""
    cache = drafter.init_cache(drafter.params, R, CACHE)
    anchor = jnp.ones(R, jnp.int32)
    pos = jnp.full(R, CTX, jnp.int32)
    keys = jax.random.split(jax.random.key(0), R)
    sa = SamplingArrays.from_params([SamplingParams(temperature=temperature)] * R)
    with_logits = temperature > 0

    @jax.jit
    def loop(params, tstate, cache, anchor):
        t = nnx.merge(target.graphdef, tstate)

        def body(i, carry):
            a, acc = carry
            tok, logits, conf = drafter.draft(params, cache, t, a, pos, keys, sa, with_logits=with_logits)
            extra = jnp.sum(logits[:, :, 0]) if with_logits else 0.0
            return tok[:, 0], acc + jnp.sum(conf) + extra

        return jax.lax.fori_loop(0, INNER, body, (anchor, jnp.float32(0)))

    def run():
        jax.block_until_ready(loop(drafter.params, target.state, cache, anchor))

    return run


def target_step_fn(target, R):
    """INNER one-token target decode steps in one jitted loop (each token the previous step's argmax)."""
    toks, starts, counts = jnp.ones(R, jnp.int32), jnp.full(R, CTX, jnp.int32), jnp.ones(R, jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(tstate, cache, toks):
        t = nnx.merge(target.graphdef, tstate)

        def body(i, carry):
            c, x = carry
            lg, _, c = t(c, x, starts, counts, q_max=1)
            return c, jnp.argmax(lg, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, INNER, body, (cache, toks))

    state = {"c": KVCache.zeros(target.cfg, R, CACHE)}

    def run():
        state["c"], x = loop(target.state, state["c"], toks)
        jax.block_until_ready(x)

    return run


def per_call(times):
    return {k: [t / INNER for t in v] for k, v in times.items()}


LEVERS = (  # (label, draft vocabulary size, top-k bias, temperature)
    ("full vocabulary (49,152)", 0, 0, 1.0),
    ("draft vocab 32k", 32768, 0, 1.0),
    ("draft vocab 16k", 16384, 0, 1.0),
    ("draft vocab 8k", 8192, 0, 1.0),
    ("8k + top-k bias (k=32)", 8192, 32, 1.0),
    ("8k + top-k bias + greedy", 8192, 32, 0.0),
)


def levers(target, requests, repeats):
    rows = []
    base = ds.DrafterConfig.for_target(target.cfg, block_size=7, num_layers=2, markov_rank=256)
    for R in requests:
        configs = {"step": target_step_fn(target, R)}
        for label, dv, k, temp in LEVERS:
            d = Drafter.random(base.replace(draft_vocab_size=dv, draft_topk=k)).bind(target)
            configs[label] = draft_fn(target, d, R, temperature=temp)
        times = per_call(interleaved(configs, repeats=repeats))
        t_step = median(times["step"])
        for label, *_ in LEVERS:
            rows.append([R, label, spread(times[label], 1e3), spread(times["step"], 1e3),
                         f"{median(times[label]) / t_step:.2f}"])
            print(rows[-1], flush=True)
    print(f"\n# after: {machine_load()}; {repeats} interleaved rounds; ms as median (min–max)\n")
    print(table(["requests", "drafter (γ=7, 2 layers, Markov r=256)", "draft ms", "target step ms",
                 "draft / step (medians)"], rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds per configuration")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--levers", action="store_true", help="the cost-lever table (draft vocabulary, top-k, greedy)")
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m")
    if args.levers:
        print(f"# Drafting cost levers on SmolLM2-135M fp32 — {hardware()}")
        print(f"# before: {machine_load()}\n")
        return levers(target, args.requests, args.repeats)
    print(f"# Drafter block cost on SmolLM2-135M fp32 — {hardware()}")
    print(f"# before: {machine_load()}\n")
    rows = []
    for R in args.requests:
        # Everything compared at one request count runs round-robin: target step, and every
        # drafter with its parallel-only twin.
        configs = {"step": target_step_fn(target, R)}
        for gamma in (7, 15):
            for layers in (1, 2):
                base_cfg = ds.DrafterConfig.for_target(target.cfg, block_size=gamma, num_layers=layers,
                                                       markov_rank=256)
                for head in ("none", "markov", "rnn"):
                    cfg = (base_cfg.replace(head_type="none", markov_rank=0, confidence_head=False)
                           if head == "none" else base_cfg.replace(head_type=head))
                    configs[(gamma, layers, head)] = draft_fn(target, Drafter.random(cfg), R)
        times = per_call(interleaved(configs, repeats=args.repeats))
        t_step = median(times["step"])
        for (gamma, layers, head), ts in ((k, v) for k, v in times.items() if k != "step" and k[2] != "none"):
            t, t_par = median(ts), median(times[(gamma, layers, "none")])
            rows.append([R, gamma, layers, head, spread(ts, 1e3), spread(times[(gamma, layers, "none")], 1e3),
                         f"{100 * (t - t_par) / t:.1f}%", spread(times["step"], 1e3), f"{t / t_step:.2f}"])
            print(rows[-1], flush=True)
    print(f"\n# after: {machine_load()}; {args.repeats} interleaved rounds; ms as median (min–max)\n")
    print(table(["requests", "γ", "draft layers", "head", "draft ms", "parallel-only ms", "head share (medians)",
                 "target step ms", "draft / step (medians)"], rows))


if __name__ == "__main__":
    main()
