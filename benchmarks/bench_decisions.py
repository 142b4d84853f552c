"""The async budget's decisions in the serving engine, one per decode cycle, beside what each
cycle cost and delivered.

Builds the engine as `bench_serving` does (`serve.server.make_engine`, greedy, a closed loop
of held-out ShareGPT requests at `--concurrency`) and logs, from inside the decode loop
(`jax.debug.callback`, ordered): at each cycle's budget decision the running slots S, the
expected accepted drafts of each bucket (Σ of the top predicted survivals it holds), each
bucket's Θ = (S + expected) · SPS and the one-token step's S · SPS, and the bucket chosen
(−1: no draft); at the cycle's end its packed tokens, drafted or not, the tokens emitted and
the attention window. A cycle's wall time is taken between two consecutive logs of the same
engine step. The callbacks make each cycle wait for the host, so the throughput printed here
is not the engine's (use `bench_serving` for that); the per-cycle costs carry the same small
overhead on every kind of cycle.

    python -m benchmarks.bench_decisions [--config hybrid] [--concurrency 8] [--requests 24]
        [--max-tokens 64] [--max-len 512] [--log F.jsonl] [--json F]

The patch replaces `decode_loop.async_budget` and `decode_loop.cycle` in this process before
anything compiles; nothing in the package changes.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time

from benchmarks.common import hardware, machine_load, median

LOG: list[dict] = []


def install_probes():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import dspark_jax.decoding.decode_loop as dl
    from dspark_jax.decoding import scheduler as sch

    budget0, cycle0 = dl.async_budget, dl.cycle

    def on_decision(S, theta, skip, u, expected):
        LOG.append({"k": "decide", "t": time.perf_counter(), "S": int(S), "theta": np.asarray(theta).tolist(),
                    "skip": float(skip), "u": int(u), "expected": np.asarray(expected).tolist()})

    def budget(prev_conf_SG, active_S, caps_S, rates_U, buckets, skip_rate=None, critical_S=None, widths=None):
        u = budget0(prev_conf_SG, active_S, caps_S, rates_U, buckets, skip_rate=skip_rate, critical_S=critical_S,
                    widths=widths)
        _, _, _, S, _, expected, _ = sch.expected_accepted(prev_conf_SG, active_S, caps_S, buckets, widths)
        theta = (S + expected) * jnp.asarray(rates_U, jnp.float32)
        skip = S * (skip_rate if skip_rate is not None else 0.0)
        jax.debug.callback(on_decision, S, theta, skip, u, expected, ordered=True)
        return u

    def on_end(S, emitted, drafted, bucket, window=None):
        LOG.append({"k": "end", "t": time.perf_counter(), "S": int(S), "emitted": int(emitted),
                    "drafted": bool(drafted), "bucket": int(bucket), "window": window})

    def cycle(target, drafter, dparams, st, sa, settings, sched):
        new = cycle0(target, drafter, dparams, st, sa, settings, sched)
        jax.debug.callback(functools.partial(on_end, window=settings.kv_window), jnp.sum(~st.done),
                           jnp.sum(new.tau_sum - st.tau_sum), new.drafted_steps - st.drafted_steps,
                           new.bucket_sum - st.bucket_sum, ordered=True)
        return new

    dl.async_budget, dl.cycle = budget, cycle


def summarize(log: list[dict]) -> dict:
    """Per kind of cycle (drafted, bucket, running slots, window): count, median ms, tokens a
    cycle; and per decision that drafted, what the budget expected against what came."""
    groups = collections.defaultdict(list)
    start = None
    decision = None
    drafted = []
    for x in log:
        if x["k"] == "step":
            start = x["t"]
        elif x["k"] == "decide":
            decision = x
        elif x["k"] == "end":
            if start is not None:
                groups[(x["drafted"], x["bucket"], x["S"], x["window"])].append((x["t"] - start, x["emitted"]))
            start = x["t"]
            if decision is not None and decision["u"] >= 0:
                u = decision["u"]
                drafted.append({"S": decision["S"], "bucket_index": u, "expected_accepted": decision["expected"][u],
                                "theta": decision["theta"][u], "one_token_theta": decision["skip"],
                                "accepted": x["emitted"] - x["S"], "bucket": x["bucket"]})
            decision = None
    kinds = [{"drafted": k[0], "bucket": k[1], "running": k[2], "window": k[3], "cycles": len(v),
              "ms": 1e3 * median([a for a, _ in v]), "tokens_per_cycle": sum(b for _, b in v) / len(v)}
             for k, v in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], str(kv[0][3])))]
    return {"kinds": kinds, "drafted_cycles": drafted}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="hybrid", choices=("dspark", "ngram", "hybrid"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--weight-dtype", default="bfloat16")
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=1)
    ap.add_argument("--log", default=None, help="every logged event, as JSON lines")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    install_probes()  # before anything compiles

    import dspark_jax as ds
    from benchmarks.bench_serving import CONFIGS, run_library, server_args
    from serve.bench import heldout_prompts
    from serve.server import build_parser, load_drafter, make_engine, warmup

    print(f"# {hardware()}; {machine_load()} at start", flush=True)
    target = ds.load_target("smollm2-135m", weight_dtype=args.weight_dtype, weight_terms=args.weight_terms)
    sargs = server_args(CONFIGS[args.config], args.concurrency, args.max_tokens, args.max_len, "short",
                        args.weight_dtype, False, args.weight_terms)
    engine = make_engine(build_parser().parse_args(sargs), target, load_drafter(CONFIGS[args.config], target))
    warmup(engine, target)
    prompts = heldout_prompts(args.requests, 600, seed=0)
    step0 = engine.step

    def step():
        LOG.append({"k": "step", "t": time.perf_counter()})
        step0()

    engine.step = step
    run_library(engine, prompts, args.max_tokens, args.concurrency)  # the branches' first runs
    LOG.clear()
    rep = run_library(engine, prompts, args.max_tokens, args.concurrency)
    out = summarize(LOG)
    out.update(config=args.config, concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
               steps=rep["steps"], load_end=machine_load(), hardware=hardware(),
               tables={str(t): tab.to_dict() for t, tab in engine.greedy_sched.tables.items()})
    for k in out["kinds"]:
        print(f"drafted={k['drafted']!s:5} bucket={k['bucket']:3d} running={k['running']} window={k['window']}: "
              f"{k['cycles']:4d} cycles, {k['ms']:.1f} ms, {k['tokens_per_cycle']:.2f} tokens/cycle")
    d = out["drafted_cycles"]
    if d:
        print(f"drafted cycles: {len(d)}; accepted {sum(x['accepted'] for x in d)} against "
              f"{sum(x['expected_accepted'] for x in d):.1f} expected by the budget")
    for t, tab in out["tables"].items():
        print(f"table @ {t}: draft {1e3 * tab['draft_s']:.1f} ms, one-token {1e3 * tab['ar_s']:.1f} ms, verify "
              + ", ".join(f"{b}: {1e3 * v:.1f}" for b, v in zip(tab["buckets"], tab["verify_s"])))
    if args.log:
        with open(args.log, "w") as f:
            for x in LOG:
                f.write(json.dumps(x) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"# {machine_load()} at end")


if __name__ == "__main__":
    main()
