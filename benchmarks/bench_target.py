"""Target model benchmark on SmolLM2-135M (fp32):

1. batch-1 greedy decode speed, our jitted JAX loop vs HF transformers `generate` (same GGUF,
   same prompt, same number of new tokens, both warmed up, calls alternating; needs the
   `parity` extra, or --skip-hf);
2. the packed-step cost curve: ms per packed target step for N = 1..32 tokens at 1 and 8
   requests (each request with 512 tokens already in its cache) — the cost table the
   verification scheduler builds on. All (requests, tokens) configurations run round-robin,
   `--repeats` rounds, so a change in machine load hits them all alike.

Every table gives the median and the min–max range, and the machine's load average before
and after (a load above the core count means the numbers are slower and noisier).

    python -m benchmarks.bench_target [--new-tokens 64] [--repeats 5] [--skip-hf] [--skip-decode]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax as ds
from benchmarks.common import hardware, interleaved, machine_load, median, spread, table
from dspark_jax.io.loading import embedded_path
from dspark_jax.models.transformer import KVCache, packed_step

PROMPT = [{"role": "user", "content": "Write a Python function that reverses a list, and explain it."}]


def ours_decode(target, n_new: int):
    """A closure that runs one warm batch-1 greedy generation; returns (s per token, token ids)."""
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)
    ds.generate(target, [PROMPT], sampling=sp)  # compile

    def run():
        out = ds.generate(target, [PROMPT], sampling=sp)
        return out.stats["decode_s"] / max(out.stats["cycles"][0], 1), out.token_ids[0]

    return run


def hf_decode(target, n_new: int):
    """The same with HF transformers `generate` on the same GGUF (prefill timed separately and removed)."""
    import torch
    import transformers

    path = embedded_path("smollm2-135m")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ids = target.tokenizer.encode(target.tokenizer.apply_chat_template(PROMPT))
    x = torch.tensor([ids])
    kw = dict(do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new)
    with torch.no_grad():
        model.generate(x, **kw)  # warm-up

    def run():
        with torch.no_grad():
            t = time.perf_counter()
            model(x)
            t_prefill = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(x, **kw)
            return (time.perf_counter() - t - t_prefill) / (n_new - 1), out[0, len(ids):].tolist()

    return run


def decode_comparison(runs: dict, repeats: int):
    """Interleaved: one call of each implementation per round, the order alternating."""
    per_tok = {n: [] for n in runs}
    ids = {}
    names = list(runs)
    for r in range(repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            t, ids[n] = runs[n]()
            per_tok[n].append(t)
    return per_tok, ids


def _step_fn(target, state, toks, starts, counts, q):
    def step():
        lg, _, state["cache"] = packed_step(target.graphdef, target.state, state["cache"], toks, starts, counts,
                                            q_max=q)
        jax.block_until_ready(lg)

    return step


def packed_curve(target, sizes=(1, 2, 4, 8, 16, 32), requests=(1, 8), ctx=512, cache_len=1024, repeats=7):
    """ms per packed step for every (requests, tokens), all configurations interleaved."""
    configs = {}
    for R in requests:
        state = {"cache": KVCache.zeros(target.cfg, R, cache_len)}  # shared: each step donates and replaces it
        starts = jnp.full(R, ctx, jnp.int32)
        for N in sizes:
            active = min(R, N)
            per = N // active
            counts = np.zeros(R, np.int32)
            counts[:active] = per
            counts[0] += N - per * active

            configs[(R, N)] = _step_fn(target, state, jnp.ones(N, jnp.int32), starts, jnp.asarray(counts),
                                       int(counts.max()))
    times = interleaved(configs, repeats=repeats)
    rows = []
    for R, N in configs:
        base = median(times[(R, sizes[0])])
        rows.append([R, N, spread(times[(R, N)], 1e3), f"{median(times[(R, N)]) / base:.2f}"])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds per configuration")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-decode", action="store_true", help="only the packed-step curve")
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m")
    print(f"# SmolLM2-135M-Instruct fp32 — {hardware()}")
    print(f"# before: {machine_load()}\n")
    if not args.skip_decode:
        runs = {"dspark_jax (jit, on-device loop)": ours_decode(target, args.new_tokens)}
        if not args.skip_hf:
            runs["HF transformers generate (torch)"] = hf_decode(target, args.new_tokens)
        per_tok, ids = decode_comparison(runs, args.repeats)
        if len(ids) == 2:
            a, b = ids.values()
            print(f"greedy outputs identical over {args.new_tokens} tokens: {a == b}")
        print(f"## Batch-1 greedy decode ({args.repeats} interleaved rounds; median (min–max))\n")
        rows = [[n, spread(t, 1e3), f"{1.0 / median(t):.2f}"] for n, t in per_tok.items()]
        print(table(["implementation", "ms / token", "tokens / s (median)"], rows))
    print(f"\n## Packed target step (context 512 per request, cache 1024; {args.repeats} interleaved rounds)\n")
    rows = packed_curve(target, repeats=args.repeats)
    print(table(["requests", "packed tokens", "ms / step, median (min–max)", "× one-token step (medians)"], rows))
    print(f"\n# after: {machine_load()}")


if __name__ == "__main__":
    main()
