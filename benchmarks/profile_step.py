"""Where a decode step's time goes: XLA:CPU's per-op trace of the decode loop, by kind of op.

Runs greedy `generate()` of held-out ShareGPT prompts (one warm run first) under
`jax.profiler.trace`, then reads the trace's per-op events (each an XLA fusion or thunk on one
of the runtime's threads) that fall inside the decode loop's execution, and sums them per kind
of op — a fusion's name without its number: `ynn_fusion` (YNNPACK: the matmuls and the
attention's multiply-reduces), `transpose_copy_fusion`, `wrapped_scatter`, … — as wall time (the
union of its events' intervals: time at least one of them ran) and thread time (their sum;
above wall where ops ran side by side on the cores). A kind whose events run one at a time
on one thread costs its thread time in wall time. `--mode`:

- `ar`: autoregressive decoding;
- `hybrid-skip`: the hybrid drafter under a table that never drafts (the async policy's
  skipped step: what it pays beside an autoregressive step).

    python -m benchmarks.profile_step [--mode ar] [--slots 8] [--new-tokens 48] [--weight-terms 1]
        [--weight-dtype bfloat16|float32]
        [--top 15] [--trace-dir /tmp/dspark_trace]

The per-op events are XLA:CPU's own (`ThunkExecutor`); other backends name their ops otherwise.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil

import jax

import dspark_jax as ds
from benchmarks.bench_concurrency import heldout_sharegpt
from benchmarks.bench_step_table import forcing_table
from benchmarks.common import machine_load, table
from dspark_jax.decoding.profiling import default_buckets, narrow_widths


def _union(intervals) -> float:
    total, cur = 0.0, None
    for s, e in sorted(intervals):
        if cur is None or s > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (0.0 if cur is None else cur[1] - cur[0])


def op_events(trace_dir: str) -> tuple[list[dict], float]:
    """(the per-op events of the longest execution in the trace — the decode loop —, its µs)."""
    path = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    if not path:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir!r}")
    with gzip.open(path[0]) as f:
        data = json.load(f)
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    runs = [e for e in events if e["name"] == "ThunkExecutor::Execute (wait for completion)"]
    if not runs:
        raise ValueError("the trace has no XLA:CPU executions (ThunkExecutor events): is this a CPU run?")
    loop = max(runs, key=lambda e: e["dur"])
    t0, t1 = loop["ts"], loop["ts"] + loop["dur"]
    skip = ("$", "ThunkExecutor", "SlinkyThreadPool", "end: ")
    return [e for e in events if t0 <= e["ts"] <= t1 and not e["name"].startswith(skip)], loop["dur"]


def by_kind(events, steps: int):
    """[(kind, wall ms a step, thread ms a step, events a step)], dearest first."""
    kinds = collections.defaultdict(list)
    for e in events:
        kinds[re.sub(r"[.\d]+$", "", e["name"])].append((e["ts"], e["ts"] + e["dur"]))
    rows = [(k, _union(iv) / 1e3 / steps, sum(b - a for a, b in iv) / 1e3 / steps, len(iv) / steps)
            for k, iv in kinds.items()]
    return sorted(rows, key=lambda r: -r[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("ar", "hybrid-skip"), default="ar")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=1)
    ap.add_argument("--weight-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--drafter", default="smollm2-135m-dspark+ngram")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--trace-dir", default="/tmp/dspark_trace")
    a = ap.parse_args()
    target = (ds.load_target("smollm2-135m") if a.weight_dtype == "float32" else
              ds.load_target("smollm2-135m", weight_dtype="bfloat16", weight_terms=a.weight_terms))
    prompts = heldout_sharegpt(target, a.slots, a.prompt_tokens, 0)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=a.new_tokens, ignore_eos=True)
    kw = {}
    if a.mode == "hybrid-skip":
        drafter = ds.load_drafter(a.drafter, target)
        buckets = default_buckets(a.slots, 7)
        shape = ds.StepRates(a.slots, buckets, 0.0, (1.0,) * len(buckets), widths=narrow_widths(a.slots, 7, buckets))
        never = forcing_table(shape, -1)
        kw = dict(drafter=drafter, policy="dspark", scheduler="async", step_rates=never)
    ds.generate(target, prompts, sampling=sp, **kw)  # compiles
    terms = "float32" if a.weight_dtype == "float32" else f"bf16, {a.weight_terms} term(s)"
    print(f"# {a.mode}, {a.slots} slots, {terms}; {machine_load()}", flush=True)
    shutil.rmtree(a.trace_dir, ignore_errors=True)
    with jax.profiler.trace(a.trace_dir, create_perfetto_trace=True):
        res = ds.generate(target, prompts, sampling=sp, **kw)
    steps = res.stats.get("steps") or a.new_tokens - 1
    events, loop_us = op_events(a.trace_dir)
    rows = by_kind(events, steps)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in events]) / 1e3 / steps
    print(f"traced: decode {res.stats['decode_s'] * 1e3 / steps:.1f} ms a step ({steps} steps), the loop's "
          f"execution {loop_us / 1e3 / steps:.1f}, some op running {busy:.1f} (tracing adds ~5%)")
    print(table(["op kind", "wall ms/step", "thread ms/step", "events/step"],
                [[k, f"{w:.2f}", f"{t:.2f}", f"{n:.1f}"] for k, w, t, n in rows[:a.top]]))


if __name__ == "__main__":
    main()
