"""The autoregressive loop against the async scheduler's one-token step, interleaved.

At loads where async drafts nothing its steps are one-token steps, so the two should decode
at the same rate; a gap is engine cost, not speculation (BENCHMARKS.md, stop 45). `generate()`
with the hybrid drafter, held-out ShareGPT prompts, 32 greedy tokens; two warm runs per
configuration, then 4 rounds in rotated order; outputs asserted identical.

    python -m benchmarks.bench_ar_vs_skip [--slots 8] [--weight-terms 1]
"""

from __future__ import annotations

import argparse

import dspark_jax as ds
from benchmarks.bench_concurrency import decode_tps, heldout_sharegpt
from benchmarks.bench_scheduler import POLICIES
from benchmarks.common import machine_load, spread


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=1)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m", weight_dtype="bfloat16", weight_terms=args.weight_terms)
    drafter = ds.load_drafter("smollm2-135m-dspark+ngram", target)
    prompts = heldout_sharegpt(target, args.slots, 192)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    cfgs = {"autoregressive": {}, 'policy="ar" with the drafter': dict(drafter=drafter, policy="ar"),
            "async": dict(drafter=drafter, **POLICIES["async"])}
    print(f"# {args.slots} slots, {args.weight_terms} term(s); {machine_load()}", flush=True)
    for kw in cfgs.values():
        for _ in range(2):
            ds.generate(target, prompts, sampling=sp, **kw)
    names, res, ref = list(cfgs), {n: [] for n in cfgs}, None
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = ds.generate(target, prompts, sampling=sp, **cfgs[name])
            ref = ref or out.token_ids
            assert out.token_ids == ref, f"{name} changed the output"
            res[name].append(decode_tps(out))
            print(f"{name}: {res[name][-1]:.1f} decode tok/s, drafted steps {out.stats.get('drafted_steps')}",
                  flush=True)
    for name, v in res.items():
        print(f"{name}: {spread(v, fmt='{:.1f}')} decode tok/s (median (min–max))")
    print(f"# {machine_load()}")


if __name__ == "__main__":
    main()
