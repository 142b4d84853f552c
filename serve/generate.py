"""Command-line generation: `python -m serve.generate "Write a Python function that reverses a list"`.

Runs the embedded SmolLM2-135M-Instruct (or --model PATH) with the prompt as a chat
message, prints the completion and the measured tokens/s. With --drafter PATH it decodes
speculatively (lossless: greedy output is identical to plain decoding).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

import dspark_jax as ds

# Compiled programs are cached on disk, so only the first run of a given shape pays for XLA.
CACHE_DIR = os.environ.get("DSPARK_XLA_CACHE", os.path.expanduser("~/.cache/dspark_jax/xla"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.generate", description=__doc__.splitlines()[0])
    ap.add_argument("prompt", nargs="+", help="one or more prompts (each becomes a user chat message)")
    ap.add_argument("--model", default="smollm2-135m", help="embedded name, HF directory or .gguf path")
    ap.add_argument("--drafter", default=None, help="drafter directory (our export or a DeepSpec checkpoint)")
    ap.add_argument("--num-draft", type=int, default=None, help="drafts verified per cycle (default: γ)")
    ap.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    ap.add_argument("--scan-layers", action="store_true", help="lax.scan over layers (faster compile)")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not cache compiled programs on disk")
    args = ap.parse_args(argv)
    if not args.no_compile_cache:
        jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    try:
        sampling = ds.SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            max_new_tokens=args.max_new_tokens, seed=args.seed, stop=tuple(args.stop),
        )
        t0 = time.perf_counter()
        target = ds.load_target(args.model, dtype=args.dtype, scan_layers=args.scan_layers)
        drafter = ds.load_drafter(args.drafter, target) if args.drafter else None
        t_load = time.perf_counter() - t0
        prompts = args.prompt if args.raw else [[{"role": "user", "content": p}] for p in args.prompt]
        out = ds.generate(target, prompts, drafter=drafter, sampling=sampling, num_draft=args.num_draft)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, text in enumerate(out.texts):
        if len(out.texts) > 1:
            print(f"--- [{i}]")
        print(text)
    s = out.stats
    print(
        f"\n[{target.name}] {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s "
        f"(excluding {s['compile_s']:.1f} s of one-time compilation; load {t_load:.1f} s; "
        f"policy {s['policy']}"
        + (f", τ {s['tau']:.2f}" if "tau" in s else "")
        + ")",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
