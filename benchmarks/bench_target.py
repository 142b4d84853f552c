"""Target model benchmark on SmolLM2-135M (fp32):

1. batch-1 greedy decode speed, our jitted JAX loop vs HF transformers `generate` (same GGUF,
   same prompt, same number of new tokens, both warmed up);
2. the packed-step cost curve: ms per packed target step for N = 1..32 tokens at 1 and 8
   requests (each request with 512 tokens already in its cache) — the cost table the
   verification scheduler builds on.

    python -m benchmarks.bench_target [--new-tokens 64] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax as ds
from benchmarks.common import hardware, table, time_call
from dspark_jax.io.loading import embedded_path
from dspark_jax.models.transformer import KVCache, packed_step

PROMPT = [{"role": "user", "content": "Write a Python function that reverses a list, and explain it."}]


def ours_decode(target, n_new: int) -> tuple[float, list[int]]:
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)
    ds.generate(target, [PROMPT], sampling=sp)  # compile
    best = None
    for _ in range(3):
        out = ds.generate(target, [PROMPT], sampling=sp)
        per_tok = out.stats["decode_s"] / max(out.stats["cycles"][0], 1)
        best = per_tok if best is None else min(best, per_tok)
    return best, out.token_ids[0]


def hf_decode(target, n_new: int) -> tuple[float, list[int]]:
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
        best, out = None, None
        for _ in range(3):
            # Time prefill separately so we compare decode steps only.
            t = time.perf_counter()
            model(x)
            t_prefill = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(x, **kw)
            per_tok = (time.perf_counter() - t - t_prefill) / (n_new - 1)
            best = per_tok if best is None else min(best, per_tok)
    return best, out[0, len(ids):].tolist()


def packed_curve(target, sizes=(1, 2, 4, 8, 16, 32), requests=(1, 8), ctx=512, cache_len=1024):
    rows = []
    for R in requests:
        base = None
        for N in sizes:
            active = min(R, N)
            per = N // active
            counts = np.zeros(R, np.int32)
            counts[:active] = per
            counts[0] += N - per * active
            cache = KVCache.zeros(target.cfg, R, cache_len)
            starts = jnp.full(R, ctx, jnp.int32)
            toks = jnp.ones(N, jnp.int32)
            q = int(counts.max())
            state = {"cache": cache}
            counts_j = jnp.asarray(counts)

            def step(state=state, toks=toks, starts=starts, counts=counts_j, q=q):
                lg, _, state["cache"] = packed_step(target.graphdef, target.state, state["cache"], toks, starts,
                                                    counts, q_max=q)
                jax.block_until_ready(lg)

            ms = time_call(step, reps=7) * 1e3
            base = base or ms
            rows.append([R, N, ms, ms / base])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    target = ds.load_target("smollm2-135m")
    print(f"# SmolLM2-135M-Instruct fp32 — {hardware()}\n")
    ours, ours_ids = ours_decode(target, args.new_tokens)
    rows = [["dspark_jax (jit, on-device loop)", ours * 1e3, 1.0 / ours]]
    if not args.skip_hf:
        hf, hf_ids = hf_decode(target, args.new_tokens)
        rows.append(["HF transformers generate (torch)", hf * 1e3, 1.0 / hf])
        same = ours_ids == hf_ids
        print(f"greedy outputs identical over {args.new_tokens} tokens: {same}")
    print("## Batch-1 greedy decode\n")
    print(table(["implementation", "ms / token", "tokens / s"], rows))
    print("\n## Packed target step (context 512 per request, cache 1024)\n")
    print(table(["requests", "packed tokens", "ms / step", "× one-token step"], packed_curve(target)))


if __name__ == "__main__":
    main()
