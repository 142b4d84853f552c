"""Batch-1 speculative decoding vs autoregressive on SmolLM2-135M (fp32, greedy), one run.

Two drafters bracket what a trained drafter will do: an *oracle* that proposes the target's
own greedy continuation (acceptance ≈ 100%) and a *random* untrained DSpark drafter
(1 layer, γ = 7, Markov r = 64; acceptance ≈ 0). For k = 1..7 verified drafts per cycle we
report τ (emitted tokens per cycle), tokens/s and the speedup over plain decoding; every
speculative output is checked token-identical to the autoregressive one.

    python -m benchmarks.bench_speculative [--prompts 3] [--new-tokens 96]
"""

from __future__ import annotations

import argparse

import dspark_jax as ds
from benchmarks.common import eval_prompts, hardware, table
from dspark_jax.decoding.drafting import Drafter, OracleDrafter
from dspark_jax.decoding.generate import encode_prompt


def run(target, prompts, sp, **kw):
    """Per-prompt batch-1 runs (after a compile warm-up); returns (total tokens/s, mean τ, outputs)."""
    ds.generate(target, [prompts[0]], sampling=sp, **_kw_for(kw, 0))  # compile
    toks, secs, taus, outs = 0, 0.0, [], []
    for i, p in enumerate(prompts):
        out = ds.generate(target, [p], sampling=sp, **_kw_for(kw, i))
        toks += out.stats["new_tokens"]
        secs += out.stats["prefill_s"] + out.stats["decode_s"] - out.stats["compile_s"]
        taus.append(out.stats.get("tau", 1.0))
        outs.append(out.token_ids[0])
    return toks / secs, sum(taus) / len(taus), outs


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
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m")
    prompts = [[{"role": "user", "content": q}] for q in eval_prompts("gsm8k", args.prompts)]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    print(f"# Batch-1 speculative vs autoregressive, SmolLM2-135M fp32 greedy — {hardware()}")
    print(f"# {args.prompts} GSM8K prompts, {args.new_tokens} new tokens max\n")
    ar_tps, _, ar_out = run(target, prompts, sp)
    rows = [["autoregressive", "-", 1.0, ar_tps, 1.0, "-"]]
    oracles = [
        OracleDrafter.from_lists([o], [len(encode_prompt(target, p))], target.cfg.vocab_size, block_size=7,
                                     length=args.new_tokens)
        for p, o in zip(prompts, ar_out)
    ]
    rand = Drafter.random(ds.DrafterConfig.for_target(target.cfg, block_size=7, num_layers=1, markov_rank=64))
    for name, drafter in (("oracle", oracles), ("random DSpark", rand)):
        for k in range(1, args.max_k + 1):
            tps, tau, outs = run(target, prompts, sp, drafter=drafter, num_draft=k, policy="fixed")
            rows.append([name, k, tau, tps, tps / ar_tps, outs == ar_out])
            print(rows[-1], flush=True)
    print()
    print(table(["drafter", "k", "τ", "tokens/s", "speedup vs AR", "identical to AR"], rows))


if __name__ == "__main__":
    main()
