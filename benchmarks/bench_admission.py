"""What the serving engine's admission costs against the arithmetic it has to do: can mixing
the prefill into the decode steps win back the time it takes?

The serving engine admits a request by prefilling its prompt (`decoding.prefill.prefill_one`:
the prompt's own query rows against its own context, one call per admitted slot) in an engine
step of its own before that step's decode cycles. Stop 47 logged that the first cycle of each
engine step, the one behind an admission, took ~3× the later ones at 8 slots, about half of
the wall time (BENCHMARKS.md, "Stop 47"). Mixing prefill chunks into the decode steps, as
vLLM / SGLang do, saves what the two passes have in common — one read of the weights a step —
but not the prefill's own matmuls. This measures, on SmolLM2 with the serving engine's
weights, side by side and interleaved:

- **admit N**: `prefill_one` for each of N held-out ShareGPT prompts (chat template), as the
  engine admits N requests into an S-slot cache at the 256 window;
- **bare chain over Σ tokens**: the target's dense matmul chain (no attention, no cache;
  `bench_context.bare_loop`) over all N prompts' tokens in one pass — what the prefill
  cannot go below however it is batched or mixed (its LM head runs on every row, so it is
  a little above the floor);
- **bare chain per prompt**: the same chain once per prompt at the query rows its
  `prefill_one` call pays (`prefill_pieces`: 16, 32, 48, 64, 96, 128, … rows), summed — what
  per-prompt calls cannot go below (padding, and one pass over the weights each);
- **one packed pass**: every prompt's tokens in one packed step (`transformer.packed_step`, each
  slot's tokens at its own positions, logits of each slot's last token only) — what an
  admission that prefilled all admitted chunks together would pay (without the drafter's
  context, which this target-only measurement leaves out);
- **decode step**: one one-token decode step of S requests at context 128 in a 256-position
  cache (`bench_context.step_loop`), and the bare chain over S tokens.

    python -m benchmarks.bench_admission [--prompts 8] [--slots 8] [--weight-dtype bfloat16]
        [--weight-terms 1] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import dspark_jax as ds
from benchmarks.bench_context import INNER, bare_loop, step_loop
from benchmarks.common import hardware, interleaved, machine_load, median, spread, table
from dspark_jax.decoding.generate import encode_prompt
from dspark_jax.decoding.prefill import prefill_one, prefill_pieces
from dspark_jax.models.transformer import KVCache, packed_step


def admit_all(target, prompts, slots: int, cache_len: int, max_rows: int):
    """A callable that prefills every prompt into its own slot of one cache, as the engine's
    admission does (the cache donated and threaded from call to call)."""
    state = {"cache": KVCache.zeros(target.cfg, slots, cache_len)}

    def run():
        cache, last = state["cache"], None
        for i, ids in enumerate(prompts):
            last, cache, _ = prefill_one(target.graphdef, target.state, None, None, cache, None, i % slots, ids,
                                         max_rows=max_rows, kv_window=cache_len)
        state["cache"] = cache
        jax.block_until_ready(last)

    return run


def admit_packed(target, prompts, slots: int, cache_len: int):
    """A callable that prefills every prompt in one packed step (slot i ← prompt i)."""
    lens = [len(p) for p in prompts] + [0] * (slots - len(prompts))
    toks = jnp.asarray([t for p in prompts for t in p], jnp.int32)
    starts, counts = jnp.zeros(slots, jnp.int32), jnp.asarray(lens, jnp.int32)
    q_max = max(lens)
    state = {"cache": KVCache.zeros(target.cfg, slots, cache_len)}

    def run():
        logits, _, state["cache"] = packed_step(target.graphdef, target.state, state["cache"], toks, starts, counts,
                                                q_max=q_max, last_only=True)
        jax.block_until_ready(logits)

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-prompt-chars", type=int, default=600, help="as bench_serving")
    ap.add_argument("--prefill-tokens", type=int, default=256, help="the engine's query rows per chunk")
    ap.add_argument("--weight-dtype", default=None)
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= args.slots:
        ap.error(f"--prompts must be 1..--slots ({args.slots}): each prompt takes a slot")
    from serve.bench import heldout_prompts

    print(f"# {hardware()}; {machine_load()} at start", flush=True)
    target = ds.load_target("smollm2-135m", weight_dtype=args.weight_dtype, weight_terms=args.weight_terms)
    prompts = [encode_prompt(target, c) for c in heldout_prompts(args.prompts, args.max_prompt_chars, seed=0)]
    n_tok, S = sum(map(len, prompts)), args.slots
    rows = [r for ids in prompts for r in prefill_pieces(len(ids), args.prefill_tokens)]
    bare_rows = {r: bare_loop(target, r) for r in sorted(set(rows))}
    configs = {
        "admit": admit_all(target, prompts, S, 256, args.prefill_tokens),
        "packed": admit_packed(target, prompts, S, 256),
        "bare_prompts": bare_loop(target, n_tok),
        "bare_each": lambda: [bare_rows[r]() for r in rows],
        "decode": step_loop(target, S, 128, 256, None),
        "bare_slots": bare_loop(target, S),
    }
    times = interleaved(configs, repeats=args.repeats)
    # bench_context's loops run INNER steps a call; admission is one call.
    per = {k: [t / (1 if k in ("admit", "packed") else INNER) for t in v] for k, v in times.items()}
    m = {k: median(v) for k, v in per.items()}
    rows = [
        [f"admit {len(prompts)} prompts (prefill_one each)", n_tok, spread(per["admit"], 1e3),
         f"{1e3 * m['admit'] / n_tok:.2f}"],
        ["one packed pass over all prompts (last rows' logits)", n_tok, spread(per["packed"], 1e3),
         f"{1e3 * m['packed'] / n_tok:.2f}"],
        ["bare chain over the same tokens, one pass", n_tok, spread(per["bare_prompts"], 1e3),
         f"{1e3 * m['bare_prompts'] / n_tok:.2f}"],
        [f"bare chain per prompt at its padded rows ({sum(rows)}), summed", n_tok, spread(per["bare_each"], 1e3),
         f"{1e3 * m['bare_each'] / n_tok:.2f}"],
        [f"one-token decode step, {S} requests", S, spread(per["decode"], 1e3), f"{1e3 * m['decode'] / S:.2f}"],
        [f"bare chain over {S} tokens", S, spread(per["bare_slots"], 1e3), f"{1e3 * m['bare_slots'] / S:.2f}"],
    ]
    print(table(["what", "tokens", "ms (median, min–max)", "ms / token"], rows))
    saved = min(m["decode"], m["bare_slots"])
    print(f"\nadmission / bare chain over its tokens: {m['admit'] / m['bare_prompts']:.2f}×; "
          f"prompt lengths {sorted(map(len, prompts))}")
    print(f"one packed pass / admission: {m['packed'] / m['admit']:.2f}×")
    print(f"per-prompt calls at their padded rows / one pass: {m['bare_each'] / m['bare_prompts']:.2f}×; "
          f"admission / per-prompt bare chains: {m['admit'] / m['bare_each']:.2f}×")
    print(f"mixing the admission into a decode step saves at most ~one weight pass a step "
          f"(≤ {1e3 * saved:.0f} ms) of the {1e3 * m['admit']:.0f} ms it costs; "
          f"the prefill's own matmuls (≥ {1e3 * m['bare_prompts']:.0f} ms) remain")
    print(f"# {machine_load()} at end", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "hardware": hardware(), "prompt_lengths": list(map(len, prompts)),
                       "piece_rows": rows,
                       "dtype": str(jnp.dtype(target.cfg.jnp_dtype)), "seconds": per}, f, indent=1)


if __name__ == "__main__":
    main()
