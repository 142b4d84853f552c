"""Serving throughput and latency: the continuous-batching engine in this process and the
same engine behind `python -m serve.server`, at fixed concurrencies, per drafter.

For each concurrency C (default 1, 8, 32) and each configuration (default: autoregressive,
the shipped DSpark drafter, prompt lookup, the hybrid — each with the server's default
policy: the DSpark scheduler with a drafter), an engine with C slots serves
`--prompts-per-slot`·C held-out ShareGPT prompts (the same prompts everywhere, chat
template, greedy, exactly `--max-tokens` new tokens each) with C requests kept in flight:

- **library**: `serve.engine.Engine` driven by a closed-loop client in this process (each
  request's tokens arrive through its `on_token` callback);
- **HTTP**: a `python -m serve.server` subprocess with the same settings, driven by
  `serve.bench` (streaming chat completions over loopback).

Both warm up the same way (the server's `warmup`) before timing. Reported per cell: output
throughput (tokens/s over the wall time of the whole run), TTFT, TPOT and ITL (mean / p50 /
p99), τ (tokens per target step), the scheduler's choices (library: the share of target steps
that drafted, packed tokens paid for and tokens emitted per target step), HTTP ÷ library
throughput (the HTTP overhead), and the
XLA compiles that happened while timing (0 when the warm-up covered everything; the server's
default warm-up compiles the first attention window only, so keep prompts + new tokens under
256 tokens — `--max-prompt-chars 600` — or expect compile stalls in the first run).
All configurations of a concurrency are built and warmed up first (their engines and servers
held at once); then `--repeats` rounds run them interleaved, each round starting one
configuration further along and alternating the order of library and HTTP, so the
configurations share any drift in the machine's speed. The machine's load is recorded
before and after. JSON (`--json`) and a PNG of throughput against concurrency (`--png`).

    python -m benchmarks.bench_serving [--concurrency 1,8,32] [--configs ar,dspark,ngram,hybrid]
        [--max-tokens 64] [--prompts-per-slot 2] [--repeats 1] [--no-http] [--json F] [--png F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from benchmarks.common import hardware, machine_load, median, table

CONFIGS = {  # name → serve.server --drafter
    "ar": "none",
    "dspark": "smollm2-135m-dspark",
    "ngram": "ngram",
    "hybrid": "smollm2-135m-dspark+ngram",
    # The hybrid whose async budget also calibrates on every request served
    # (`serve.engine.PooledCalibration`), not only on each request's own evidence.
    "hybrid-pooled": "smollm2-135m-dspark+ngram",
    # The hybrid with every verification bucket's query grid K + 1 wide (before stop 51).
    "hybrid-full": "smollm2-135m-dspark+ngram",
}
SERVER_FLAGS = {"hybrid-pooled": ["--pooled-calibration"],  # name → extra serve.server flags
                "hybrid-full": ["--bucket-widths", "full"]}


HEADERS = ["C", "config", "mode", "output tok/s", "HTTP ÷ lib", "TTFT ms mean/p50/p99", "TPOT ms mean/p50/p99",
           "ITL ms mean/p50/p99", "τ", "drafted steps", "paid / step", "tokens / step", "failed", "compiles"]


def server_args(drafter: str, slots: int, max_tokens: int, max_len: int, warmup: str = "short",
                weight_dtype: str | None = None, fine_windows: bool = False, weight_terms: int = 3,
                min_slots: int = 1) -> list[str]:
    return ["--drafter", drafter, "--slots", str(slots), "--min-slots", str(min(min_slots, slots)),
            "--max-len", str(max_len),
            "--max-tokens-limit", str(max_tokens), "--max-queue", str(4 * slots + 64), "--warmup", warmup,
            *(["--weight-dtype", weight_dtype, "--weight-terms", str(weight_terms)] if weight_dtype else []),
            *(["--fine-windows"] if fine_windows else [])]


def run_library(engine, prompts, max_tokens: int, concurrency: int) -> dict:
    """Closed loop: `concurrency` requests in flight; the same numbers serve.bench reports."""
    import dspark_jax as ds
    from dspark_jax.decoding import compile_stats
    from serve.bench import Result, report

    compile_stats.ensure_registered()
    c0, _ = compile_stats.snapshot()
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True)
    first, last, itl = {}, {}, {}

    def on_token(req, toks):
        now = time.perf_counter()
        if req.id not in first:
            first[req.id] = now
            itl[req.id] = []
        else:
            itl[req.id].append(now - last[req.id])
        last[req.id] = now

    engine.finished.clear()
    k0 = engine.counters()
    pending = list(prompts)
    t0 = time.perf_counter()
    while pending or not engine.idle:
        while pending and len(engine.running) + len(engine.queue) < concurrency:
            engine.submit(pending.pop(0), sp, on_token)
        engine.step()
    duration = time.perf_counter() - t0
    results, taus = [], []
    for r in engine.finished:
        res = Result(ok=r.status == "finished", prompt_tokens=len(r.prompt_ids), output_tokens=len(r.tokens),
                     ttft=first[r.id] - r.submitted_at if r.id in first else None,
                     latency=r.finished_at - r.submitted_at, itl=itl.get(r.id, []), finish_reason=r.finish_reason)
        results.append(res)
        if "tau" in r.stats:
            taus.append(r.stats["tau"])
    ns = argparse.Namespace(url="library", request_rate=float("inf"), concurrency=concurrency, endpoint="engine",
                            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, dataset="sharegpt", seed=0,
                            save_requests=False)
    rep = report(ns, "library", results, duration, {}, {})
    rep["tau"] = float(sum(taus) / len(taus)) if taus and engine.drafter is not None else None
    rep["server_compiles"] = compile_stats.snapshot()[0] - c0  # compiles while timing (0 when warm)
    k1 = engine.counters()
    steps = max(k1.get("steps", 0) - k0.get("steps", 0), 1)
    rep["steps"] = steps
    # Tokens the decode loop emitted per target step (each request's first token comes from its
    # prefill): what a step yields across the slots, the number a step's cost must be weighed by.
    rep["tokens_per_step"] = (rep["total_output_tokens"] - rep["completed"]) / steps
    if engine.drafter is not None and "drafted_steps" in k1:
        # What the scheduler chose while timing: the share of steps that drafted, and packed
        # tokens paid for per step (C = no drafts verified; C·(γ+1) = every draft).
        rep["drafted_steps"] = (k1["drafted_steps"] - k0["drafted_steps"]) / steps
        rep["bucket_per_step"] = (k1["bucket_tokens"] - k0["bucket_tokens"]) / steps
    if "accepted" in k1:
        # Drafts accepted on the steps that verified any, against the survival the scheduler
        # expected of them, per kind of row (the trained drafter's, prompt lookup's).
        for i, kind in enumerate(("drafter", "lookup")):
            rep[f"calibration_{kind}"] = {k: k1[k][i] - k0[k][i] for k in ("accepted", "budget_exp", "conf_exp")}
            if engine.budget_trust is not None:
                rep[f"calibration_{kind}"]["trust_at_end"] = engine.budget_trust[i]
    engine.finished.clear()
    return rep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args_list: list[str], port: int, log_path: str, timeout: float = 900.0):
    cmd = [sys.executable, "-m", "serve.server", "--port", str(port), "--no-access-log", "--log-level", "warning",
           *args_list]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s; see {log_path}")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_http(port: int, prompts, max_tokens: int, concurrency: int) -> dict:
    from serve.bench import build_parser, run

    bargs = build_parser().parse_args(["--url", f"http://127.0.0.1:{port}", "--concurrency", str(concurrency),
                                       "--num-prompts", str(len(prompts)), "--max-tokens", str(max_tokens),
                                       "--ignore-eos"])
    return asyncio.run(run(bargs, prompts))


def rounds(reps: list[dict], key: str, fmt: str = ".2f") -> str:
    """One value per round ("a / b"), or "–" where the cell's last round has none."""
    return "–" if reps[-1].get(key) is None else " / ".join(f"{x[key]:{fmt}}" for x in reps)


def fmt_lat(s: dict) -> str:
    return f"{s['mean']:.0f} / {s['p50']:.0f} / {s['p99']:.0f}"


def plot_throughput(results: dict, names, concs, path: str, weights: str = "fp32") -> None:
    """Output tokens/s against concurrency, one line per configuration and mode that ran
    (`results` as in the JSON: "name@C" → {"library": [...], "http": [...]})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        for mode, ls in (("library", "-"), ("http", "--")):
            runs = [results.get(f"{name}@{C}", {}).get(mode) for C in concs]
            if not any(runs):
                continue
            ys = [median([x["output_throughput"] for x in r]) if r else float("nan") for r in runs]
            ax.plot(concs, ys, ls, marker="o", label=f"{name} ({mode})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (= slots)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"SmolLM2-135M, {weights} weights, 2-core CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--configs", default="ar,dspark,ngram,hybrid")
    ap.add_argument("--slots", type=int, default=0,
                    help="the engine's slots (default 0: as many as the concurrency); more slots than requests in "
                         "flight is a server under partial load")
    ap.add_argument("--min-slots", default="1",
                    help="the server's --min-slots (comma-separated: each value is a configuration of its own, "
                         "named CONFIG/minN, e.g. 1,8 compares shrinking to the requests in flight against all slots)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-prompt-chars", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--warmup", choices=("short", "full", "pass"), default="short",
                    help="the server's warm-up before timing; 'full' also compiles (and profiles the step-rate "
                         "table at) every attention window, as `serve.server --warmup full` does; 'pass' (library "
                         "only) runs the timed workload once untimed instead (faster to start; the compiles column "
                         "says whether the rounds still compiled)")
    ap.add_argument("--weight-dtype", default=None,
                    help="bfloat16: the server's --weight-dtype (bf16 weights under float32 arithmetic; on CPUs with "
                         "AMX / AVX512-BF16 a step of many tokens costs about what one does)")
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=3, help="the server's --weight-terms")
    ap.add_argument("--fine-windows", action="store_true", help="the server's --fine-windows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--logdir", default="/tmp/bench_serving")
    args = ap.parse_args(argv)
    if args.warmup == "pass" and not args.no_http:
        ap.error("--warmup pass runs in the library only: add --no-http")
    import jax

    import dspark_jax as ds
    from serve.bench import heldout_prompts
    from serve.server import build_parser as server_parser
    from serve.server import load_drafter, make_engine, warmup

    os.makedirs(args.logdir, exist_ok=True)
    concs = [int(c) for c in args.concurrency.split(",")]
    mins = [int(m) for m in args.min_slots.split(",")]
    # Cells: each configuration at each --min-slots value ("ar/min8"; the plain name when one).
    names = [c if len(mins) == 1 else f"{c}/min{m}" for c in args.configs.split(",") for m in mins]
    print(f"# {hardware()}; {machine_load()} at start", flush=True)
    target = ds.load_target("smollm2-135m", weight_dtype=args.weight_dtype, weight_terms=args.weight_terms)
    results = {}
    rows = []
    for C in concs:
        prompts = heldout_prompts(args.prompts_per_slot * C, args.max_prompt_chars, seed=0)
        engines, procs, ports = {}, {}, {}
        cells = {name: {"library": [], "http": []} for name in names}
        try:
            slots = args.slots or C
            for name in names:
                config, _, m = name.partition("/min")
                sargs = server_args(CONFIGS[config], slots, args.max_tokens, args.max_len,
                                    "none" if args.warmup == "pass" else args.warmup,
                                    args.weight_dtype, args.fine_windows, args.weight_terms,
                                    min_slots=int(m) if m else mins[0]) + SERVER_FLAGS.get(config, [])
                engines[name] = make_engine(server_parser().parse_args(sargs), target,
                                            load_drafter(CONFIGS[config], target))
                if args.warmup == "pass":
                    run_library(engines[name], prompts, args.max_tokens, C)
                else:
                    warmup(engines[name], target, full=args.warmup == "full")
                if not args.no_http:
                    ports[name] = free_port()
                    procs[name] = start_server(sargs, ports[name], os.path.join(args.logdir, f"server_{name}_{C}.log"))
            # Rounds interleave the configurations, each round starting one further along, so a
            # drift in the machine's speed lands on all of them rather than on whichever ran last.
            for r in range(args.repeats):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    for mode in (["library", "http"] if r % 2 == 0 else ["http", "library"]):
                        if mode == "library":
                            cells[name]["library"].append(run_library(engines[name], prompts, args.max_tokens, C))
                        elif name in procs:
                            cells[name]["http"].append(run_http(ports[name], prompts, args.max_tokens, C))
        finally:
            for proc in procs.values():
                stop_server(proc)
        engines.clear()
        # Each concurrency compiles its own engines' programs; dropping them keeps the process's
        # memory maps bounded (XLA:CPU maps ~130-280 code/data pages per program, and a run of
        # many cells crossed Linux's default 65,530 maps: "LLVM compilation error: Cannot
        # allocate memory", then a segfault).
        jax.clear_caches()
        for name in names:
            cell = results[f"{name}@{C}"] = cells[name]
            first = len(rows)
            for mode in ("library", "http"):
                reps = cell[mode]
                if not reps:
                    continue
                tput = [x["output_throughput"] for x in reps]
                ratio = ""
                if mode == "http" and cell["library"]:
                    ratio = f"{median(tput) / median([x['output_throughput'] for x in cell['library']]):.2f}"
                last = reps[-1]
                fails = sum(x["failed"] for x in reps)
                tau, drafted = rounds(reps, "tau"), rounds(reps, "drafted_steps")
                paid, yielded = rounds(reps, "bucket_per_step", ".1f"), rounds(reps, "tokens_per_step")
                rows.append([C, name, mode, f"{median(tput):.1f}" + (f" ({min(tput):.1f}–{max(tput):.1f})"
                                                                     if len(tput) > 1 else ""),
                             ratio, fmt_lat(last["ttft_ms"]), fmt_lat(last["tpot_ms"]), fmt_lat(last["itl_ms"]),
                             tau, drafted, paid, yielded, fails,
                             " / ".join(f"{x['server_compiles']:.0f}" for x in reps)])
            print(table(HEADERS, rows[first:]), flush=True)
            for kind in ("drafter", "lookup"):
                cal = [x[f"calibration_{kind}"] for x in cell["library"] if f"calibration_{kind}" in x]
                if cal and sum(c["budget_exp"] for c in cal) > 0:
                    print(f"# {name}@{C} {kind} rows: drafts accepted / expected by the budget / by the step's "
                          "confidences: " + ", ".join(f"{c['accepted']:.0f} / {c['budget_exp']:.1f} / "
                                                       f"{c['conf_exp']:.1f}" for c in cal)
                          + ("" if "trust_at_end" not in cal[-1] else
                             "; pooled trust after each round: " + ", ".join(f"{c['trust_at_end']:.2f}" for c in cal)),
                          flush=True)
    print(f"\n## Serving: {args.max_tokens} new tokens per request, greedy, {args.prompts_per_slot}·C held-out "
          f"ShareGPT prompts, {args.slots or 'C'} slots, C in flight\n")
    print(table(HEADERS, rows))
    print(f"\n# {machine_load()} at end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1, default=float)
    if args.png:
        plot_throughput(results, names, concs, args.png, args.weight_dtype or "float32")


if __name__ == "__main__":
    main()
