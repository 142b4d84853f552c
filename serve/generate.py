"""Command-line generation: `python -m serve.generate Write a Python function that reverses a list`.

Runs the embedded SmolLM2-135M-Instruct (or --model PATH) with the prompt as a chat message,
prints the completion and the measured tokens/s. The words of the command line form ONE
prompt (quoting is optional); several prompts come from --prompts-file. With --drafter DIR
it decodes speculatively (lossless: the output is distributed exactly as without it).

Sampling defaults are the library's (`ds.SamplingParams`): temperature 1.0, i.e. the model's
own distribution, as in HF `generate(do_sample=True)`, vLLM and the OpenAI API, with a fresh
seed per run; pass --temperature 0 for greedy (deterministic) output or --seed N to replay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import dspark_jax as ds

# Compiled programs are cached on disk, so only the first run of a given shape pays for XLA.
CACHE_DIR = os.environ.get("DSPARK_XLA_CACHE", os.path.expanduser("~/.cache/dspark_jax/xla"))
_SP = ds.SamplingParams()


def read_prompts_file(path: str) -> list:
    """One prompt per non-empty line; a `.jsonl` file holds one JSON value per line: a string,
    a list of chat messages, or an object with "prompt" (a string) or "turns" (its first is used)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no prompts file at {path!r}")
    with open(path, encoding="utf-8") as f:
        lines = [(i, line.rstrip("\n")) for i, line in enumerate(f, 1) if line.strip()]
    if not path.endswith(".jsonl"):
        return [line for _, line in lines]
    prompts = []
    for i, line in lines:
        try:
            v = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i} is not valid JSON ({e}); a .jsonl prompts file holds one JSON value "
                             "per line") from e
        if isinstance(v, dict) and isinstance(v.get("prompt"), str):
            v = v["prompt"]
        elif isinstance(v, dict) and isinstance(v.get("turns"), list) and v["turns"]:
            v = v["turns"][0]
        if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(m, dict) for m in v))):
            raise ValueError(f"{path}:{i}: expected a string, a list of chat messages, or an object with "
                             f"'prompt' or 'turns'; got {line[:80]!r}")
        prompts.append(v)
    if not prompts:
        raise ValueError(f"{path!r} holds no prompts")
    return prompts


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's paragraphs; appends "(default: ...)" where the help text has none."""

    def _get_help_string(self, action):
        unset = action.default is None or action.default is False or action.default == []
        if unset or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.generate", description=__doc__.split("\n\n", 1)[1],
        formatter_class=_HelpFormatter,
    )
    ap.add_argument("prompt", nargs="*", default=[],
                    help="the prompt; all words are joined into one prompt (a user chat message unless --raw)")
    ap.add_argument("--prompts-file", metavar="FILE", default=None,
                    help="several prompts: one per line, or a .jsonl file with one JSON string, chat or "
                         "{'prompt': ...} / {'turns': [...]} object per line (instead of the positional prompt; "
                         "default: none)")
    ap.add_argument("--model", default="smollm2-135m", help="embedded model name, HF model directory or .gguf file")
    ap.add_argument("--drafter", metavar="DIR", default="auto",
                    help="drafter directory (our export or a DeepSpec checkpoint), a shipped drafter's name, "
                         "'ngram' (prompt lookup, no training) or NAME+ngram (lookup where the context repeats, "
                         "the drafter elsewhere); "
                         "default 'auto': the drafter shipped for --model if there is one "
                         "(smollm2-135m-dspark for the default model), else autoregressive")
    ap.add_argument("--no-drafter", action="store_true",
                    help="plain autoregressive decoding (default: off)")
    ap.add_argument("--policy", choices=("dspark", "fixed", "threshold"), default="dspark",
                    help="verification policy with a drafter: the confidence scheduler (async: verifies what "
                         "its calibrated confidences say pays, and stops drafting when nothing does), a fixed "
                         "length, or a static confidence threshold")
    ap.add_argument("--num-draft", type=int, default=None,
                    help="drafts verified per cycle with --policy fixed, 1..γ (default: the drafter's block size γ)")
    ap.add_argument("--no-compare", action="store_true",
                    help="with a drafter, skip the autoregressive rerun that measures the speedup (default: off)")
    ap.add_argument("--runs", type=int, default=2,
                    help="with the comparison, decode (and rerun autoregressively) this many times and report the "
                         "last: a program's first execution after compiling pays one-time costs (allocation, the "
                         "CPU matmul kernels' own JIT) that a server never sees again (default: 2)")
    ap.add_argument("--raw", action="store_true",
                    help="use the prompt text as is, without the chat template (default: off)")
    ap.add_argument("--max-new-tokens", type=int, default=_SP.max_new_tokens, help="tokens to generate at most")
    ap.add_argument("--temperature", type=float, default=_SP.temperature,
                    help="sampling temperature; 0 = greedy (deterministic), 1 = the model's distribution")
    ap.add_argument("--top-k", type=int, default=_SP.top_k, help="keep the k most likely tokens (0 = off)")
    ap.add_argument("--top-p", type=float, default=_SP.top_p, help="nucleus sampling mass (1 = off)")
    ap.add_argument("--min-p", type=float, default=_SP.min_p,
                    help="drop tokens below min_p × the top token's probability (0 = off)")
    ap.add_argument("--seed", type=int, default=None,
                    help="any integer, for reproducible sampling; default: a fresh seed per prompt (printed)")
    ap.add_argument("--stop", action="append", default=[],
                    help="stop string (repeatable); output ends just before it (default: none)")
    ap.add_argument("--dtype", default=None, help="float32 (default; right on CPU) or bfloat16 (TPU/GPU)")
    ap.add_argument("--weight-dtype", default=None,
                    help="bfloat16: matmul weights stored in bf16 under float32 arithmetic (half their memory; on CPUs "
                         "with AMX / AVX512-BF16 a step of many tokens costs about what one does)")
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=3,
                    help="with --weight-dtype bfloat16: bf16 terms per float32 activation, 3 (the float32 products) or "
                         "1 (rounded to bf16: a third of the matmul rows; decode steps run batch-invariant, so greedy "
                         "speculative output stays identical)")
    ap.add_argument("--scan-layers", action="store_true",
                    help="lax.scan over layers: faster compile, slower decoding on CPU (default: off, unrolled)")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help=f"do not cache compiled programs on disk (default: cache in $DSPARK_XLA_CACHE or {CACHE_DIR})")
    return ap


def _prompts(ap: argparse.ArgumentParser, args) -> list:
    if args.prompts_file and args.prompt:
        ap.error("give the prompt either as words or with --prompts-file, not both")
    if args.prompts_file:
        prompts = read_prompts_file(args.prompts_file)
    elif args.prompt:
        prompts = [" ".join(args.prompt)]
    else:
        ap.error("no prompt: pass the prompt as words, or --prompts-file FILE")
    if args.raw:
        return prompts
    return [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.no_drafter:
        if args.drafter != "auto":
            ap.error("--no-drafter and --drafter contradict each other")
        args.drafter = None
    elif args.drafter == "auto":
        from dspark_jax.io.drafter_io import SHIPPED_DRAFTERS, shipped_drafter_path

        names = [n for n, t in SHIPPED_DRAFTERS.items() if t == args.model and os.path.isdir(shipped_drafter_path(n))]
        args.drafter = names[0] if names else None
    if args.num_draft is not None and not args.drafter:
        ap.error("--num-draft needs a drafter (without one decoding is autoregressive)")
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    try:
        prompts = _prompts(ap, args)
        sampling = ds.SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            max_new_tokens=args.max_new_tokens, seed=args.seed, stop=tuple(args.stop),
        )
        if args.drafter and args.drafter != "ngram":
            # Cheap checks first: a bad path should not wait for the target to load.
            from dspark_jax.io.drafter_io import inspect_drafter

            inspect_drafter(args.drafter.removesuffix("+ngram"))
        if not args.no_compile_cache:
            import jax

            jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        t0 = time.perf_counter()
        target = ds.load_target(args.model, dtype=args.dtype, scan_layers=args.scan_layers,
                                weight_dtype=args.weight_dtype, weight_terms=args.weight_terms)
        drafter = ds.load_drafter(args.drafter, target) if args.drafter else None
        t_load = time.perf_counter() - t0
        policy = args.policy if drafter is not None else None
        compare = drafter is not None and not args.no_compare
        compile_s = 0.0
        for _ in range(args.runs if compare else 1):
            out = ds.generate(target, prompts, drafter=drafter, sampling=sampling, num_draft=args.num_draft,
                              policy=policy)
            compile_s += out.stats["compile_s"]
        ar = None
        if compare:
            # The same prompts without the drafter, same seeds: the measured speedup.
            replay = [ds.SamplingParams(**{**sampling.__dict__, "seed": sd}) for sd in out.stats["seeds"]]
            for _ in range(args.runs):
                ar = ds.generate(target, prompts, sampling=replay)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, text in enumerate(out.texts):
        if len(out.texts) > 1:
            print(f"--- [{i}]")
        print(text)
    s = out.stats
    seeds = "" if sampling.greedy else f"; seed {', '.join(map(str, s['seeds']))}"
    print(
        f"\n[{target.name}] {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s "
        f"(excluding {compile_s:.1f} s of one-time compilation; load {t_load:.1f} s; "
        + (f"run {args.runs} of {args.runs}; " if compare and args.runs > 1 else "")
        + f"policy {s['policy']}"
        + (f", τ {s['tau']:.2f}" if "tau" in s else "")
        + seeds
        + ")",
        file=sys.stderr,
    )
    if ar is not None:
        a = ar.stats
        same = " (identical output)" if sampling.greedy and ar.token_ids == out.token_ids else ""
        print(f"[{target.name}] autoregressive: {a['new_tokens']} tokens, {a['tokens_per_s']:.1f} tokens/s → "
              f"speedup {s['tokens_per_s'] / max(a['tokens_per_s'], 1e-9):.2f}×{same}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
