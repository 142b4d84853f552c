"""Prefill throughput and peak memory on SmolLM2-135M (fp32) for long prompts.

Each prompt length runs in its own child process, so the peak resident memory reported
(`resource.getrusage(...).ru_maxrss`: model load, buffers and XLA's workspace) belongs to
that length alone. In the child: one warm-up call (compiles the bucket), then `--repeats`
timed calls; prefill tokens/s = prompt tokens / the `prefill_s` of a warm call. With
`--repeats 0` only the first call runs and its compile time is subtracted (an estimate, for
lengths too slow to repeat on a small machine).

    python -m benchmarks.bench_prefill [--lengths 512 2048 8184] [--repeats 3] [--chunk 512]

8184 + 8 new tokens fills SmolLM2's whole 8192-token context.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from benchmarks.common import hardware, machine_load, median, spread, table


def child(length: int, repeats: int, chunk: int) -> dict:
    import numpy as np

    import dspark_jax as ds

    target = ds.load_target("smollm2-135m")
    rng = np.random.default_rng(length)
    prompt = rng.integers(3, target.cfg.vocab_size, length).tolist()  # content does not change the cost
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    warm = ds.generate(target, [prompt], sampling=sp, prefill_chunk=chunk)
    secs = [ds.generate(target, [prompt], sampling=sp, prefill_chunk=chunk).stats["prefill_s"]
            for _ in range(repeats)]
    return {"length": length, "prefill_s": secs, "first_call_s": warm.stats["prefill_s"],
            "compile_s": warm.stats["compile_s"],
            "cache_len": warm.stats["buckets"]["cache_len"],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8184])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per packed step)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.repeats, args.chunk)))
        return
    print(f"# Prefill, SmolLM2-135M fp32, batch 1, chunk {args.chunk} — {hardware()}")
    print(f"# before: {machine_load()}\n")
    rows = []
    for n in args.lengths:
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_prefill", "--child", str(n),
                              "--repeats", str(args.repeats), "--chunk", str(args.chunk)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if r["prefill_s"]:
            tps = spread([n / s for s in r["prefill_s"]], fmt="{:.0f}")
            secs = f"{median(r['prefill_s']):.2f}"
        else:  # --repeats 0: only the first call, less all compile time of the call (an estimate)
            est = r["first_call_s"] - r.get("compile_s", 0.0)
            tps, secs = f"≈{n / est:.0f} (1 run)", f"≈{est:.1f}"
        rows.append([n, r["cache_len"], tps, secs, f"{r['first_call_s']:.1f}", f"{r['peak_rss_gb']:.2f}"])
        print(rows[-1], flush=True)
    print(f"\n# after: {machine_load()}; {args.repeats} warm calls per length\n")
    print(table(["prompt tokens", "cache length", "prefill tokens/s, median (min–max)", "prefill s",
                 "first call s (with compile)", "peak RSS GB"], rows))


if __name__ == "__main__":
    main()
