"""Batch-1 speculative decoding vs autoregressive on SmolLM2-135M (fp32, greedy).

Two drafters bracket what a trained drafter will do: an *oracle* that proposes the target's
own greedy continuation (acceptance ≈ 100%) and a *random* untrained DSpark drafter
(1 layer, γ = 7, Markov r = 64; acceptance ≈ 0). For k = 1..7 verified drafts per cycle we
report τ (emitted tokens per cycle), tokens/s and the speedup over plain decoding; every
speculative output is checked token-identical to the autoregressive one. All
configurations run round-robin for `--repeats` rounds (median and min–max reported, with the
machine's load average). Prompts: benchmarks/data/gsm8k.jsonl (shipped with the repository).

    python -m benchmarks.bench_speculative [--prompts 3] [--new-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse

import dspark_jax as ds
from benchmarks.common import eval_prompts, hardware, machine_load, median, spread, table
from dspark_jax.decoding.generate import encode_prompt
from dspark_jax.models.drafters import Drafter, OracleDrafter


def config_fn(target, prompts, sp, **kw):
    """A closure running every prompt alone (batch 1), compiled on creation.
    Returns (tokens/s excluding compile time, mean τ, outputs)."""
    ds.generate(target, [prompts[0]], sampling=sp, **_kw_for(kw, 0))  # compile

    def run():
        toks, secs, taus, outs = 0, 0.0, [], []
        for i, p in enumerate(prompts):
            out = ds.generate(target, [p], sampling=sp, **_kw_for(kw, i))
            toks += out.stats["new_tokens"]
            secs += out.stats["prefill_s"] + out.stats["decode_s"] - out.stats["compile_s"]
            taus.append(out.stats.get("tau", 1.0))
            outs.append(out.token_ids[0])
        return toks / secs, sum(taus) / len(taus), outs

    return run


def _kw_for(kw, i):
    kw = dict(kw)
    if isinstance(kw.get("drafter"), list):
        kw["drafter"] = kw["drafter"][i]
    return kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--max-k", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per configuration")
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m")
    prompts = [[{"role": "user", "content": q}] for q in eval_prompts("gsm8k", args.prompts)]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    print(f"# Batch-1 speculative vs autoregressive, SmolLM2-135M fp32 greedy — {hardware()}")
    print(f"# {args.prompts} GSM8K prompts (benchmarks/data/gsm8k.jsonl), {args.new_tokens} new tokens max")
    print(f"# before: {machine_load()}\n")
    ar_out = config_fn(target, prompts, sp)()[2]
    oracles = [
        OracleDrafter.from_lists([o], [len(encode_prompt(target, p))], target.cfg.vocab_size, block_size=7,
                                     length=args.new_tokens)
        for p, o in zip(prompts, ar_out)
    ]
    rand = Drafter.random(ds.DrafterConfig.for_target(target.cfg, block_size=7, num_layers=1, markov_rank=64))
    configs = {("autoregressive", "-"): config_fn(target, prompts, sp)}
    for name, drafter in (("oracle", oracles), ("random DSpark", rand)):
        for k in range(1, args.max_k + 1):
            configs[(name, k)] = config_fn(target, prompts, sp, drafter=drafter, num_draft=k, policy="fixed")
    # Round-robin over every configuration, order rotating each round (benchmarks.common.interleaved).
    results = {c: [] for c in configs}
    names = list(configs)
    for r in range(args.repeats):
        for c in names[r % len(names):] + names[: r % len(names)]:
            results[c].append(configs[c]())
    ar_tps = median([x[0] for x in results[("autoregressive", "-")]])
    rows = []
    for (name, k), res in results.items():
        tps = [x[0] for x in res]
        same = "-" if k == "-" else all(x[2] == ar_out for x in res)
        rows.append([name, k, res[0][1], spread(tps), f"{median(tps) / ar_tps:.2f}", same])
    print(f"# after: {machine_load()}; {args.repeats} interleaved rounds\n")
    print(table(["drafter", "k", "τ", "tokens/s, median (min–max)", "speedup vs AR (medians)",
                 "identical to AR"], rows))


if __name__ == "__main__":
    main()
