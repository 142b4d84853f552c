"""Trained drafters on the evaluation prompts: τ per dataset and the speedup over
autoregressive decoding, measured side by side in one run.

    python -m benchmarks.bench_trained [--drafter smollm2-135m-dspark] [--baseline DIR] [--ngram]
        [--prompts 20] [--speed-prompts 5] [--max-new-tokens 128] [--policy dspark]

τ (accepted tokens per cycle, bonus included) comes from all `--prompts` prompts of each
dataset decoded as one batch, at temperature 0 and 1, for the DSpark drafter and (with
`--baseline`) a DFlash drafter trained on the same data and steps. The wall-clock speedup is
measured at batch 1 on the first `--speed-prompts` prompts of each dataset: each prompt is
decoded autoregressively and speculatively, interleaved, and the table reports the median
per-prompt speedup with its min–max. Greedy speculative output is checked token-identical
to autoregressive output. Prints markdown tables (paste into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import dspark_jax as ds
from benchmarks.common import eval_prompts, hardware, machine_load, median, spread, table

DATASETS = ("gsm8k", "humaneval", "mt-bench")


def _chat(p):
    return [{"role": "user", "content": p}]


def tau_table(target, drafters: dict, n_prompts: int, max_new: int, temps=(0.0, 1.0), batch: int = 10,
              datasets=DATASETS) -> str:
    rows = []
    for name in datasets:
        # XLA:CPU keeps every compiled program mapped; a long run of many shapes would reach
        # the kernel's map limit (vm.max_map_count) and fail to compile: start each set afresh.
        jax.clear_caches()
        prompts = [_chat(p) for p in eval_prompts(name, n_prompts)]
        for temp in temps:
            row = [name, temp]
            for d in drafters.values():
                sp = ds.SamplingParams(temperature=temp, max_new_tokens=max_new, seed=0)
                # τ over all prompts = Σ tokens per cycle / Σ cycles, over batches of `batch`.
                emitted = cycles = 0
                for i in range(0, len(prompts), batch):
                    out = ds.generate(target, prompts[i: i + batch], drafter=d, sampling=sp, policy="fixed")
                    n = sum(out.stats["cycles"])
                    emitted, cycles = emitted + out.stats["tau"] * n, cycles + n
                row.append(emitted / max(cycles, 1))
            rows.append(row)
    hdr = ["dataset", "temperature"] + [f"τ {k}" for k in drafters]
    names = list(drafters)
    if "DFlash" in drafters:  # every DSpark column against the DFlash baseline
        j = 2 + names.index("DFlash")
        for i, k in enumerate(names):
            if k != "DFlash":
                hdr.append(f"{k} / DFlash")
                rows = [r + [r[2 + i] / r[j]] for r in rows]
    return table(hdr, rows)


def speed_table(target, drafters: dict, n_prompts: int, max_new: int, temps=(0.0, 1.0), policy="dspark",
                datasets=DATASETS) -> str:
    """Batch-1 wall-clock speedup of each drafter over autoregressive decoding: per prompt,
    AR and every drafter run interleaved (the order rotates), compile excluded."""
    rows = []
    kinds = ["ar", *drafters]
    for name in datasets:
        prompts = [_chat(p) for p in eval_prompts(name, n_prompts)]
        for temp in temps:
            jax.clear_caches()  # as in tau_table: bounded compiled-program mappings
            sp = ds.SamplingParams(temperature=temp, max_new_tokens=max_new, seed=0)

            def run(kind, p, sp=sp):
                # A prompt of another length bucket or attention window compiles a new program:
                # such a run is repeated warm, so no timing includes a compile.
                d = drafters.get(kind)
                for _ in range(3):
                    t0 = time.perf_counter()
                    out = ds.generate(target, [p], drafter=d, sampling=sp, policy=policy if d is not None else None)
                    dt = time.perf_counter() - t0
                    if out.stats["compiles"] == 0:
                        break
                return out, dt

            for kind in kinds:  # compile every program outside the timings
                run(kind, prompts[0])
            tps = {k: [] for k in kinds}
            taus = {k: [] for k in drafters}
            same = {k: True for k in drafters}
            for i, p in enumerate(prompts):
                order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]
                runs = {k: run(k, p) for k in order}
                for k, (out, dt) in runs.items():
                    # Per-token time: sampled runs may differ in length (and stop at EOS).
                    tps[k].append(out.stats["new_tokens"] / dt)
                    if k != "ar":
                        taus[k].append(out.stats["tau"])
                        same[k] &= temp != 0.0 or out.token_ids == runs["ar"][0].token_ids
            for k in drafters:
                sps = [a / b for a, b in zip(tps[k], tps["ar"])]
                rows.append([name, temp, k, f"{median(tps['ar']):.1f}", f"{median(tps[k]):.1f}",
                             spread(sps, fmt="{:.2f}×"), f"{np.mean(taus[k]):.2f}",
                             ("yes" if same[k] else "NO") if temp == 0.0 else "n/a"])
    return table(["dataset", "temperature", "drafter", "AR tok/s", "spec tok/s", "speedup median (min–max)", "τ",
                  "greedy identical"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default="smollm2-135m-dspark")
    ap.add_argument("--baseline", default=None, help="a DFlash drafter (head none) trained on the same data")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--speed-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-tau", action="store_true")
    ap.add_argument("--batch", type=int, default=10, help="prompts decoded together in the τ table")
    ap.add_argument("--topk-variant", type=int, default=0,
                    help="also the DSpark drafter with this top-k sequential bias (τ column)")
    ap.add_argument("--scan-layers", action="store_true", help="target layers under lax.scan (faster compile)")
    ap.add_argument("--weight-dtype", default=None,
                    help="bfloat16: the target's weights in bf16 under float32 arithmetic (load_target)")
    ap.add_argument("--weight-terms", type=int, default=3, help="with --weight-dtype bfloat16: 3 or 1 (load_target)")
    ap.add_argument("--ngram", action="store_true", help="also prompt lookup (ds.NgramDrafter), τ and speed")
    ap.add_argument("--hybrid", action="store_true", help="also the hybrid (lookup on long matches, DSpark elsewhere)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                    help="another drafter for the τ table (repeatable), e.g. previous=runs/old_drafter")
    ap.add_argument("--policy", default="dspark", help="verification policy of the speed table (dspark | fixed)")
    ap.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated sets of the τ table")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated temperatures of the τ table")
    ap.add_argument("--speed-datasets", default=",".join(DATASETS), help="comma-separated sets of the speed table")
    ap.add_argument("--speed-temperatures", default="0,1", help="comma-separated temperatures of the speed table")
    args = ap.parse_args(argv)
    # Every prompt set is read before any model is loaded: a misspelt name fails at once, not
    # after the earlier sets' minutes of decoding.
    for name in {*args.datasets.split(","), *args.speed_datasets.split(",")}:
        try:
            eval_prompts(name, 1)
        except FileNotFoundError as e:
            ap.error(str(e))
    target = ds.load_target(args.target, scan_layers=args.scan_layers, weight_dtype=args.weight_dtype,
                            weight_terms=args.weight_terms)
    drafters = {"DSpark": ds.load_drafter(args.drafter, target)}
    if args.topk_variant:
        d = drafters["DSpark"]
        drafters[f"DSpark top-k {args.topk_variant}"] = ds.Drafter(
            d.cfg.replace(draft_topk=args.topk_variant), d.graphdef, d.state)
    if args.baseline:
        drafters["DFlash"] = ds.load_drafter(args.baseline, target)
    for item in args.extra:
        name, path = item.split("=", 1)
        drafters[name] = ds.load_drafter(path, target)
    if args.ngram:
        drafters["prompt lookup"] = ds.NgramDrafter(block_size=drafters["DSpark"].block_size)
    if args.hybrid:
        drafters["hybrid"] = ds.HybridDrafter(drafters["DSpark"])
    print(f"# {hardware()}; {machine_load()} at start")
    if not args.skip_tau:
        print(f"\n## τ ({args.prompts} prompts per dataset, {args.max_new_tokens} new tokens, γ = "
              f"{drafters['DSpark'].block_size}, batches of {args.batch})\n")
        print(tau_table(target, drafters, args.prompts, args.max_new_tokens, batch=args.batch,
                        datasets=args.datasets.split(","),
                        temps=tuple(float(t) for t in args.temperatures.split(","))), flush=True)
    if not args.skip_speed:
        print(f"\n## Speedup at batch 1 ({args.speed_prompts} prompts per dataset, interleaved, "
              f"policy {args.policy})\n")
        speed = {k: v for k, v in drafters.items() if k in ("DSpark", "prompt lookup", "hybrid")}
        print(speed_table(target, speed, args.speed_prompts, args.max_new_tokens, policy=args.policy,
                          datasets=args.speed_datasets.split(","),
                          temps=tuple(float(t) for t in args.speed_temperatures.split(","))))
    print(f"\n{machine_load()} at end")


if __name__ == "__main__":
    main()
