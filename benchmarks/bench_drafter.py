"""Drafter cost on SmolLM2-135M (fp32): time to draft one block, next to one target decode step.

For γ ∈ {7, 15}, 1 and 2 draft layers, Markov and RNN heads, at 1 and 16 requests (context
of 256 tokens each): ms per `draft_block` call, and the sequential head's share, measured as
the difference to the same drafter with head "none" and no confidence head (the parallel
DFlash drafter, identical backbone). The target decode step is one packed step with one
token per request.

    python -m benchmarks.bench_drafter
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import dspark_jax as ds
from benchmarks.common import hardware, table, time_call
from dspark_jax.decoding.drafting import Drafter, draft_block
from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams
from dspark_jax.models.transformer import KVCache, packed_step

CTX, CACHE = 256, 512


def draft_ms(target, drafter, R, temperature=1.0):
    cache = drafter.init_cache(drafter.params, R, CACHE)
    anchor = jnp.ones(R, jnp.int32)
    pos = jnp.full(R, CTX, jnp.int32)
    keys = jax.random.split(jax.random.key(0), R)
    sa = SamplingArrays.from_params([SamplingParams(temperature=temperature)] * R)

    def run():
        jax.block_until_ready(draft_block(drafter, drafter.params, target.graphdef, target.state, cache, anchor,
                                          pos, keys, sa))

    return time_call(run, reps=7) * 1e3


def target_step_ms(target, R):
    state = {"c": KVCache.zeros(target.cfg, R, CACHE)}
    toks, starts, counts = jnp.ones(R, jnp.int32), jnp.full(R, CTX, jnp.int32), jnp.ones(R, jnp.int32)

    def run():
        lg, _, state["c"] = packed_step(target.graphdef, target.state, state["c"], toks, starts, counts, q_max=1)
        jax.block_until_ready(lg)

    return time_call(run, reps=7) * 1e3


def main():
    target = ds.load_target("smollm2-135m")
    print(f"# Drafter block cost on SmolLM2-135M fp32 — {hardware()}\n")
    rows = []
    for R in (1, 16):
        t_step = target_step_ms(target, R)
        for gamma in (7, 15):
            for layers in (1, 2):
                base_cfg = ds.DrafterConfig.for_target(target.cfg, block_size=gamma, num_layers=layers,
                                                       markov_rank=256)
                parallel = Drafter.random(base_cfg.replace(head_type="none", markov_rank=0, confidence_head=False))
                t_par = draft_ms(target, parallel, R)
                for head in ("markov", "rnn"):
                    d = Drafter.random(base_cfg.replace(head_type=head))
                    t = draft_ms(target, d, R)
                    rows.append([R, gamma, layers, head, t, t_par, f"{100 * (t - t_par) / t:.1f}%", t_step,
                                 f"{t / t_step:.2f}"])
                    print(rows[-1], flush=True)
    print()
    print(table(["requests", "γ", "draft layers", "head", "draft ms", "parallel-only ms", "head share",
                 "target step ms", "draft / step"], rows))


if __name__ == "__main__":
    main()
