"""The scheduler's step-rate table against the decode loop's own steps.

The async scheduler verifies drafts when (S + expected accepted) × rate(bucket) beats
S × the rate of a step without drafts, reading both rates from a profiled table
(`ds.profile_step_rates`). Its choices are only as good as those prices. This benchmark
forces each choice in turn — the one-token step and every verification bucket — by handing
`generate()` a table under which it is the only choice (the outputs do not change: a schedule
decides only how many drafts are verified), and sets the loop's measured time per step
beside the profiled table's price for it. `generate()` with the hybrid drafter, held-out
ShareGPT prompts, greedy; one warm run per choice, then `--rounds` rounds in rotated order.

    python -m benchmarks.bench_step_table [--slots 8] [--weight-terms 1] [--rounds 3] [--prompt-tokens 192]
        [--no-buckets]
"""

from __future__ import annotations

import argparse
import json

import dspark_jax as ds
from benchmarks.bench_concurrency import heldout_sharegpt
from benchmarks.common import machine_load, median, spread

BIG = 1e6


def forcing_table(table: ds.StepRates, choice: int) -> ds.StepRates:
    """A table under which the async budget always picks bucket `choice` (−1: never draft)."""
    verify = tuple(1.0 / BIG if u == choice else BIG for u in range(len(table.buckets)))
    return ds.StepRates(table.slots, table.buckets, 0.0, verify, 1.0 / BIG if choice < 0 else float("inf"),
                        widths=table.widths)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=192,
                    help="longest prompt (held-out ShareGPT prompts up to this many tokens)")
    ap.add_argument("--min-prompt-tokens", type=int, default=0,
                    help="shortest prompt; --min-prompt-tokens 240 --prompt-tokens 400 runs the loop at the "
                         "512-token attention window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafter", default="smollm2-135m-dspark+ngram")
    ap.add_argument("--no-buckets", action="store_true",
                    help="time only the one-token step, the async loop and autoregressive decoding (what a "
                         "step that drafts nothing costs against autoregressive's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m", weight_dtype="bfloat16", weight_terms=args.weight_terms)
    drafter = ds.load_drafter(args.drafter, target)
    prompts = heldout_sharegpt(target, args.slots, args.prompt_tokens, args.min_prompt_tokens)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    base = dict(drafter=drafter, policy="dspark", scheduler="async")
    print(f"# {args.slots} slots, {args.weight_terms} term(s), {args.drafter}; {machine_load()}", flush=True)

    # The profiled table (measured on first use, then cached on disk) at the loop's window.
    ref = ds.generate(target, prompts, sampling=sp, **base)
    windows = ref.stats["buckets"]["attention_windows"]
    tables = ref.stats.get("window_step_rates") or {ref.stats["buckets"]["cache_len"]: ref.stats["step_rates"]}
    if len(set(windows)) != 1:
        print(f"# note: the loop crossed windows {windows}; prices are those of the first")
    table = ds.StepRates.from_dict(tables[windows[0]])
    print(f"# window {windows[0]}: draft {table.draft_s * 1e3:.1f} ms, one-token step {table.ar_s * 1e3:.1f} ms, "
          "verify " + ", ".join(f"{b}: {v * 1e3:.1f}" for b, v in zip(table.buckets, table.verify_s)) + " ms",
          flush=True)

    choices = {"one-token step": -1,
               **({} if args.no_buckets else {f"bucket {b}": u for u, b in enumerate(table.buckets)})}
    # Every slot is busy, so bucket S (the anchors) holds no draft: the loop then runs its
    # one-token branch after drafting, and that is what the table must price it as.
    price = {name: (table.ar_s if u < 0 else
                    table.draft_s + (table.ar_s if table.buckets[u] <= args.slots else table.verify_s[u]))
             for name, u in choices.items()}
    cfgs = {name: dict(base, step_rates=forcing_table(table, u)) for name, u in choices.items()}
    cfgs["async (profiled table)"] = base
    cfgs["autoregressive"] = {}
    for kw in cfgs.values():
        ds.generate(target, prompts, sampling=sp, **kw)
    names, ms, tps = list(cfgs), {n: [] for n in cfgs}, {n: [] for n in cfgs}
    info = {}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = ds.generate(target, prompts, sampling=sp, **cfgs[name])
            assert out.token_ids == ref.token_ids, f"{name} changed the output"
            st = out.stats
            steps = st.get("steps", max(max(st["cycles"]), 1))
            ms[name].append(st["decode_s"] / steps * 1e3)
            tps[name].append((st["new_tokens"] - len(out.token_ids)) / st["decode_s"])
            info[name] = {"steps": steps, "tau": st.get("tau"), "drafted_steps": st.get("drafted_steps"),
                          "bucket_per_step": st.get("bucket_per_step")}
    print("\n| choice | profiled ms/step | measured ms/step | measured ÷ profiled | steps | decode tok/s |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for name in names:
        p = price.get(name)
        m = median(ms[name])
        ratio = f"{m / (p * 1e3):.2f}" if p else "-"
        head = f"| {name} | {p * 1e3:.1f} |" if p else f"| {name} | - |"
        print(head, f"{spread(ms[name], fmt='{:.1f}')} | {ratio} | {info[name]['steps']} | "
              f"{spread(tps[name], fmt='{:.1f}')} |")
        rows[name] = {"profiled_ms": None if p is None else p * 1e3, "measured_ms": ms[name],
                      "decode_tps": tps[name], **info[name]}
    print(f"# {machine_load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "window": windows[0], "table": table.to_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
