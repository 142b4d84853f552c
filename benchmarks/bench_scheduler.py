"""Confidence-scheduled verification vs fixed policies on SmolLM2-135M (fp32, greedy).

For each concurrency (requests decoded together), every policy runs the same prompts once
to compile (and to profile the step-rate table, cached on disk) and once timed; we report
output tokens/s, τ (tokens per request-cycle), the mean drafts verified per request-cycle,
the packed tokens paid for per step and the share of steps that drafted. Every output is
checked token-identical to autoregressive decoding.

Drafters: *oracle* (the target's own greedy continuation with confidence 1: the
"everything accepted" bound; a trained drafter sits between the two) and *random*
(untrained: the no-regret check, async must not fall far below autoregressive).

    python -m benchmarks.bench_scheduler [--concurrency 1,4] [--new-tokens 32] [--drafter both] [--repeats 3]
"""

from __future__ import annotations

import argparse

import dspark_jax as ds
from benchmarks.common import eval_prompts, hardware, table
from dspark_jax.decoding.generate import encode_prompt
from dspark_jax.models.drafters import Drafter, OracleDrafter

POLICIES = {
    "fixed k=1": dict(policy="fixed", num_draft=1),
    "fixed k=3": dict(policy="fixed", num_draft=3),
    "fixed k=γ": dict(policy="fixed"),
    "threshold 0.5": dict(policy="threshold", threshold=0.5),
    "sync": dict(policy="dspark", scheduler="sync"),
    "async": dict(policy="dspark", scheduler="async"),
    # The async budget by the batch's tokens/s, as the serving engine weighs it (generate()'s
    # static batch weighs by its slowest request: `DecodeConfig.makespan`).
    "async tokens/s": dict(config=ds.DecodeConfig(policy="dspark", scheduler="async", makespan=False)),
}


def timed(target, prompts, sp, repeats=1, **kw):
    """(output, tokens/s): the median of `repeats` warm runs (after a compile + profile run)."""
    ds.generate(target, prompts, sampling=sp, **kw)
    runs = []
    for _ in range(repeats):
        out = ds.generate(target, prompts, sampling=sp, **kw)
        st = out.stats
        runs.append((st["new_tokens"] / (st["prefill_s"] + st["decode_s"] - st["compile_s"]), out))
    runs.sort(key=lambda r: r[0])
    tps, out = runs[len(runs) // 2]
    return out, tps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--drafter", choices=["oracle", "random", "both"], default="both")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per cell (median)")
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m", scan_layers=True)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    gamma = 7
    rand = Drafter.random(ds.DrafterConfig.for_target(target.cfg, block_size=gamma, num_layers=1, markov_rank=64))
    names = [p for p in args.policies.split(",") if p]
    print(f"# Scheduled verification, SmolLM2-135M fp32 greedy (scan over layers) — {hardware()}")
    print(f"# MT-Bench first turns, {args.new_tokens} new tokens per request, γ = {gamma}\n")
    for R in [int(c) for c in args.concurrency.split(",")]:
        prompts = [[{"role": "user", "content": q}] for q in eval_prompts("mt-bench", R)]
        ar, ar_tps = timed(target, prompts, sp, args.repeats)
        rows = [["autoregressive", "-", ar_tps, 1.0, 1.0, "-", "-", "-"]]
        drafters = []
        if args.drafter in ("oracle", "both"):
            lens = [len(encode_prompt(target, p)) for p in prompts]
            drafters.append(("oracle", OracleDrafter.from_lists(ar.token_ids, lens, target.cfg.vocab_size,
                                                                block_size=gamma, length=args.new_tokens)))
        if args.drafter in ("random", "both"):
            drafters.append(("random", rand))
        for dname, drafter in drafters:
            for name in names:
                out, tps = timed(target, prompts, sp, args.repeats, drafter=drafter, **POLICIES[name])
                assert out.token_ids == ar.token_ids, f"{name} with the {dname} drafter changed the output"
                st = out.stats
                mean_ver = sum(st["mean_verified"]) / len(st["mean_verified"])
                rows.append([name, dname, tps, tps / ar_tps, st["tau"], mean_ver, st["bucket_per_step"],
                             st["drafted_steps"]])
        print(f"## concurrency {R}\n")
        print(table(["policy", "drafter", "tokens/s", "× AR", "τ", "verified/req·cycle", "tokens paid/step",
                     "drafted steps"], rows))
        print(flush=True)


if __name__ == "__main__":
    main()
