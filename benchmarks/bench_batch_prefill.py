"""Prefill of R prompts together: per-request prefill (the default) against the batched
program, side by side, with decode tokens/s apart from prefill.

For each R, the same R GSM8K prompts (chat template; prompts 200.. of
benchmarks/data/gsm8k.jsonl) are generated greedily with `--new-tokens` new tokens, once per
mode to compile, then `--repeats` rounds interleaved (the mode order alternates). Reported:
median (min–max) of `stats["prefill_s"]`, prefill of R together ÷ R × prefill of one, and
decode tokens/s (new tokens ÷ `decode_s`). Outputs of the two modes are checked identical.

    python -m benchmarks.bench_batch_prefill [--requests 1,4,16,64] [--repeats 3] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json

import dspark_jax as ds
from benchmarks.common import eval_prompts, hardware, machine_load, median, spread, table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None, help="write the raw timings here")
    ap.add_argument("--batched-up-to", type=int, default=1 << 30,
                    help="run the batched program only up to this many requests (it grows with R²)")
    args = ap.parse_args(argv)
    target = ds.load_target("smollm2-135m")
    rs = [int(x) for x in args.requests.split(",")]
    prompts = [[{"role": "user", "content": p}] for p in eval_prompts("gsm8k", 200 + max(rs))[200:]]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    print(f"# {hardware()}; {machine_load()} at start")
    rows, raw, one = [], {}, {}
    for R in rs:
        ps = prompts[:R]
        modes = {"per-request": False, "batched": True} if R <= args.batched_up_to else {"per-request": False}
        outs = {m: ds.generate(target, ps, sampling=sp, batched_prefill=b) for m, b in modes.items()}  # compile
        assert len({str(o.token_ids) for o in outs.values()}) == 1  # the modes agree
        pre = {m: [] for m in modes}
        dec = {m: [] for m in modes}
        for r in range(args.repeats):
            for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                st = ds.generate(target, ps, sampling=sp, batched_prefill=modes[m]).stats
                pre[m].append(st["prefill_s"])
                dec[m].append(R * args.new_tokens / st["decode_s"])
        raw[R] = {"prefill_s": pre, "decode_tok_s": dec}
        if R == 1:
            one = {m: median(v) for m, v in pre.items()}
        for m in modes:
            ratio = median(pre[m]) / (R * one[m]) if one else float("nan")
            rows.append([R, m, spread(pre[m]), f"{ratio:.2f}", spread(dec[m], fmt="{:.1f}")])
        print(table(["requests", "prefill", "prefill s, median (min–max)", "÷ R × one prompt",
                     "decode tok/s"], rows[-len(modes):]), flush=True)
    print(f"\n## Prefill of R prompts together ({args.repeats} interleaved rounds, {args.new_tokens} new tokens)\n")
    print(table(["requests", "prefill", "prefill s, median (min–max)", "÷ R × one prompt", "decode tok/s"], rows))
    print(f"\n{machine_load()} at end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
