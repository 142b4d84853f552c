"""On-policy training data: the target answers the training prompts itself.

DFlash and DSpark train on the target's own answers (regenerated with the recipe's sampling:
T 0.7, top-p 0.8, top-k 20), which beats training on the datasets' original answers. The
prompts go through `ds.generate` in batches; each batch becomes one ArrayRecord shard of
(prompt + response) token ids with the loss mask on the response (and the stop token that
ended it). Shards are numbered by batch and written atomically, so a killed run resumes by
skipping the shards that exist.
"""

from __future__ import annotations

import os
import sys
import time

from dspark_jax.decoding.decode_config import DecodeConfig
from dspark_jax.decoding.generate import encode_prompt, generate
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.training import records


def regenerate(target, prompts: list[list[dict]], out_dir: str, *, batch_size: int = 32,
               max_prompt_tokens: int = 256, max_new_tokens: int = 256, temperature: float = 0.7,
               top_p: float = 0.8, top_k: int = 20, seed: int = 0, max_batches: int = 0, max_seconds: float = 0.0,
               log=sys.stderr) -> dict:
    """Answers `prompts` with `target`, writing shards into `out_dir` (the first `max_batches`
    batches only, when > 0; no batch is started after `max_seconds` of this call, when > 0: a
    time-boxed run, e.g. on a borrowed accelerator, keeps every shard it finished). Returns counts."""
    os.makedirs(out_dir, exist_ok=True)
    encoded = []
    for p in prompts:
        ids = encode_prompt(target, p)
        if len(ids) <= max_prompt_tokens:
            encoded.append((p, ids))
    eos = target.eos_token_ids
    n_batches = (len(encoded) + batch_size - 1) // batch_size
    if max_batches > 0:
        n_batches = min(n_batches, max_batches)
    t0 = time.perf_counter()
    done_tokens = 0
    written = 0
    for b in range(n_batches):
        path = os.path.join(out_dir, f"shard-{b:05d}.array_record")
        if os.path.exists(path):
            continue
        if max_seconds > 0 and time.perf_counter() - t0 > max_seconds:
            print(f"[data] time budget of {max_seconds:.0f} s spent: stopping after {written} new batches "
                  f"({b} of {n_batches} done)", file=log, flush=True)
            break
        batch = encoded[b * batch_size:(b + 1) * batch_size]
        sampling = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                   max_new_tokens=max_new_tokens, seed=seed * 1_000_003 + b * batch_size + i)
                    for i in range(len(batch))]
        # fine windows: the batch's contexts grow past 256 positions together; a 384 window
        # reads a quarter less than 512 (the same tokens; BENCHMARKS.md "Stop 34")
        out = generate(target, [ids for _, ids in batch], sampling=sampling, config=DecodeConfig(fine_windows=True))
        recs = []
        for (_, ids), resp in zip(batch, out.token_ids):
            if len(resp) < max_new_tokens and eos:
                resp = list(resp) + [eos[0]]  # the drafter should learn where answers end
            recs.append(records.encode(ids + list(resp), [0] * len(ids) + [1] * len(resp)))
            done_tokens += len(resp)
        records.write_shard(path, recs)
        written += 1
        el = time.perf_counter() - t0
        eta = el / written * (n_batches - b - 1)
        # Where a batch's time goes (prefill, decode, compiles): what to look at first when
        # regeneration runs slower than the target's matmuls should allow.
        s = out.stats
        print(f"[data] batch {b + 1}/{n_batches}: {done_tokens} response tokens, "
              f"{done_tokens / el:.0f} tok/s, ETA {eta / 60:.1f} min (this batch: prefill {s['prefill_s']:.1f} s, "
              f"decode {s['decode_s']:.1f} s, {s['compiles']} compiles in {s['compile_s']:.1f} s)",
              file=log, flush=True)
    return {"prompts": len(encoded), "batches": n_batches, "new_tokens": done_tokens}


def write_original_answers(target, pairs: list[tuple[list[dict], str]], out_dir: str, *, max_prompt_tokens: int = 256,
                           max_answer_tokens: int = 256, shard_size: int = 64) -> dict:
    """Off-policy data: the datasets' own answers (what DFlash first trained on), tokenised
    after the chat template's generation prompt, loss on the answer. Far cheaper than
    regeneration; the TV term still teaches the target's distribution on this text."""
    os.makedirs(out_dir, exist_ok=True)
    tok = target.tokenizer
    if tok is None:
        raise ValueError("original answers need a target with a tokenizer")
    eos = target.eos_token_ids
    recs, n_tok = [], 0
    for messages, answer in pairs:
        if not answer.strip():
            continue
        ids = encode_prompt(target, messages)
        if len(ids) > max_prompt_tokens:
            continue
        ans = tok.encode(answer)
        ans = ans[:max_answer_tokens] if len(ans) > max_answer_tokens else ans + list(eos[:1])
        recs.append(records.encode(ids + ans, [0] * len(ids) + [1] * len(ans)))
        n_tok += len(ans)
    for i in range(0, len(recs), shard_size):
        records.write_shard(os.path.join(out_dir, f"orig-{i // shard_size:05d}.array_record"), recs[i:i + shard_size])
    return {"sequences": len(recs), "answer_tokens": n_tok}
