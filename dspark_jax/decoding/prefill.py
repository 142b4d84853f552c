"""Prefill: prompts into the KV cache, and each request's first token.

- `prefill_one` (what `generate()` uses): one request at a time into its own cache row, in
  chunks — its query rows against its own context, so a batch costs the sum over its
  prompts; `start_decoding` then samples every request's first token.
- `prefill`: all slots' packed prompts in one program (a [slots, chunk] query grid per
  chunk; kept for comparison, `generate(batched_prefill=True)`) and for calibration.
- `admit`: the serving engine's admission — after `prefill_one` filled a chunk of prompt
  for some slots (the others keep their state), the slots whose prompt completes start
  decoding.

Shape letters (docs/architecture.md, "Shape letters"): as in `decode_loop.py`; N admission tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.decode_loop import GenState, append_context, fold_keys, prior_confidence
from dspark_jax.decoding.sampling import SamplingArrays, sample_or_argmax, transform_logits
from dspark_jax.models.transformer import KVCache, packed_layout


def _chunk_take(remaining_S, budget: int):
    """Slot-major split of a token budget: each slot takes what it still needs, in slot order."""
    before = jnp.cumsum(remaining_S) - remaining_S
    return jnp.clip(budget - before, 0, remaining_S)


@functools.partial(
    jax.jit, static_argnames=("tgraph", "drafter", "q_max", "chunk", "kv_window"), donate_argnames=("st",)
)
def prefill(tgraph, tstate, drafter, dparams, st: GenState, tokens_N, lens_S, sa: SamplingArrays, *, q_max,
            chunk=None, kv_window=None):
    """Runs the prompts (slot-major in `tokens_N`) and samples each request's first token.

    The prompts go through the packed step `chunk` tokens at a time (a `lax.while_loop`, so
    one compiled program serves any prompt length in the bucket): each step's attention
    scores are [S, H, min(q_max, chunk), T] instead of [S, H, prompt, T], which keeps memory
    bounded for long prompts. Each chunk continues every unfinished slot where the previous
    one stopped (starts > 0), slot-major, so a chunk may hold the end of one prompt and the
    start of the next. `chunk=None`: the whole packed buffer in one step. `kv_window`
    (≥ the longest prompt): attention reads only that many cache positions.
    """
    target = nnx.merge(tgraph, tstate)
    S = lens_S.shape[0]
    V = target.cfg.vocab_size
    feature_layers = drafter.feature_layers if drafter is not None else ()
    chunk = tokens_N.shape[0] if chunk is None else chunk
    offs_S = jnp.cumsum(lens_S) - lens_S  # where each prompt starts in tokens_N
    qc = min(q_max, chunk)

    def body(c):
        done_S, cache, dcache, last_SV = c
        take_S = _chunk_take(lens_S - done_S, chunk)
        lay = packed_layout(done_S, take_S, chunk, qc)
        src = jnp.clip(offs_S[lay.slot_N] + lay.pos_N, 0, tokens_N.shape[0] - 1)
        toks = jnp.where(lay.valid_N, tokens_N[src], 0)
        idx = jnp.maximum(jnp.cumsum(take_S) - 1, 0)  # each slot's last token in this chunk
        logits, feats, cache = target(cache, toks, done_S, take_S, q_max=qc, logits_idx=idx,
                                      feature_layers=feature_layers, kv_window=kv_window)
        if drafter is not None:
            dcache = append_context(drafter, dparams, dcache, target, feats, lay.slot_N, lay.pos_N, lay.valid_N,
                                    toks)
        finished = (take_S > 0) & (done_S + take_S == lens_S)
        last_SV = jnp.where(finished[:, None], logits, last_SV)
        return done_S + take_S, cache, dcache, last_SV

    init = (jnp.zeros((S,), jnp.int32), st.cache, st.dcache, jnp.zeros((S, V), jnp.float32))
    _, cache, dcache, logits = jax.lax.while_loop(lambda c: jnp.any(c[0] < lens_S), body, init)
    return first_tokens(st.replace(cache=cache, dcache=dcache), logits, lens_S, sa)


def first_tokens(st: GenState, logits_SV, lens_S, sa: SamplingArrays) -> GenState:
    """After a prefill: each request samples its first token from its last prompt logits."""
    zeros = jnp.zeros_like(lens_S)
    first = sample_or_argmax(fold_keys(st.keys, zeros), logits_SV, transform_logits(logits_SV, sa), sa.greedy)
    is_stop = jnp.any(first[:, None] == st.stop_ids, -1)
    live = ~st.done
    # Strongly typed int32: a weak-typed n_out would make the decode loop's first call and
    # its later chunks (stop strings) two different programs, i.e. a second compile.
    n_out = jnp.where(live & ~is_stop, 1, 0).astype(jnp.int32)
    return st.replace(
        seq_len=lens_S,
        anchor=first,
        out=st.out.at[:, 0].set(jnp.where(live, first, -1)),
        n_out=n_out,
        done=st.done | is_stop | (n_out >= st.max_new),
    )


start_decoding = jax.jit(first_tokens, donate_argnames=("st",))


def next_pow2(n: int, minimum: int = 1) -> int:
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def prefill_rows(n: int, max_rows: int) -> int:
    """Query rows of a prefill piece of n prompt tokens: the smallest of 16, 32, 48, 64, 96,
    128, 192, … (powers of two and 1.5× powers of two) that holds n, at most `max_rows`. A
    piece's cost is ~57 rows' worth of weight traffic plus its rows (SmolLM2 on 2 CPU cores,
    float32: 81 ms at 16 rows, 332 ms at 256), so on typical prompts powers of two alone cost
    ~28% more than exact rows would, the 1.5× steps ~13%, for twice the programs."""
    p = next_pow2(n, 16)
    return min(p * 3 // 4 if p >= 64 and n <= p * 3 // 4 else p, max_rows)


def prefill_pieces(n: int, max_rows: int) -> list[int]:
    """Query rows of the prefill pieces covering n prompt tokens: full pieces of `max_rows`,
    then the rest in its own `prefill_rows` (never a whole padded chunk for a short tail)."""
    full, rest = divmod(int(n), max_rows)
    return [max_rows] * full + ([prefill_rows(rest, max_rows)] if rest else [])


def prefill_one(tgraph, tstate, drafter, dparams, cache: KVCache, dcache, slot: int, tokens, start: int = 0, *,
                max_rows: int, kv_window=None):
    """Prefills one request's prompt tokens `tokens` (host ints, all real) into cache row `slot`
    at positions `start`.. (0 for a whole prompt; the serving engine admits long prompts in
    pieces) and returns (the last token's logits [V], cache, dcache).

    Its cost is the request's own: pieces of at most `max_rows` query rows against the window
    (`prefill_pieces`: full pieces, then the rest in the smallest of the 1.5×-spaced row
    buckets that holds it), never the other slots' (a batched prefill pays S × chunk query
    rows per chunk, which grows with S² over a batch). The slot's row is cut out to the window
    `kv_window` (every position the prompt reaches lies below it; None: the whole cache),
    filled piece by piece, and pasted back (the caches are donated); the drafter's context is
    appended for this slot only. The model's program depends on the window and the piece's
    rows only, not on the cache's length, which the decode loops change as contexts grow
    (`KVCache.resized`)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if tokens.size == 0:
        raise ValueError("prefill_one needs at least one prompt token")
    w = cache.length if kv_window is None else min(int(kv_window), cache.length)
    slot = jnp.int32(slot)
    row = _cut_row(cache, slot, w=w)
    done = 0
    for rows in prefill_pieces(tokens.size, max_rows):
        take = min(rows, tokens.size - done)
        buf = np.zeros(rows, np.int32)
        buf[:take] = tokens[done: done + take]
        last, row, dcache = _prefill_row(tgraph, tstate, drafter, dparams, row, dcache, slot,
                                         jnp.asarray(buf), jnp.int32(take), jnp.int32(start + done))
        done += take
    return last, _paste_row(cache, row, slot), dcache


@functools.partial(jax.jit, static_argnames=("w",))
def _cut_row(cache: KVCache, slot, *, w: int) -> KVCache:
    return cache.slot_row(slot).window(w)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _paste_row(cache: KVCache, row: KVCache, slot) -> KVCache:
    return cache.with_slot_row(row, slot)


@functools.partial(jax.jit, static_argnames=("tgraph", "drafter"), donate_argnames=("row", "dcache"))
def _prefill_row(tgraph, tstate, drafter, dparams, row: KVCache, dcache, slot, tokens_P, take, start):
    """One piece of `prefill_one` on the slot's row (a one-slot cache): the first `take` of
    `tokens_P` at positions `start`.., all P rows in one pass."""
    target = nnx.merge(tgraph, tstate)
    feature_layers = drafter.feature_layers if drafter is not None else ()
    P = tokens_P.shape[0]
    lay = packed_layout(start[None], take[None], P, P)
    logits, feats, row = target(row, tokens_P, start[None], take[None], q_max=P,
                                logits_idx=jnp.maximum(take - 1, 0)[None], feature_layers=feature_layers)
    if drafter is not None:
        dcache = append_context(drafter, dparams, dcache, target, feats, jnp.full_like(lay.slot_N, slot),
                                lay.pos_N, lay.valid_N, tokens_P)
    return logits[0], row, dcache


@functools.partial(jax.jit, donate_argnames=("st",))
def admit(st: GenState, logits_SV, seq_len_S, chunk_S, final_S, max_new_S, keys_S, stop_ids_SM,
          sa: SamplingArrays, prior_2K=None):
    """The serving engine's admission, after `prefill_one` filled each admitted slot's chunk
    of prompt into `st`'s caches: slots in `chunk_S` now hold `seq_len_S` tokens; those in
    `final_S` (their prompt is complete) sample their first token from `logits_SV` and start
    decoding with fresh per-slot state (the scheduler's confidences at the drafter's acceptance
    prior `prior_2K`, `decode_loop.acceptance_prior`; None: 1). Every other slot is untouched. Touches no cache: the
    engine passes `st` without them (cache and dcache None), so the program does not depend
    on the cache's length."""
    S = seq_len_S.shape[0]
    zeros = jnp.zeros((S,), jnp.int32)
    logits = logits_SV
    st = st.replace(seq_len=jnp.where(chunk_S, seq_len_S, st.seq_len))
    new_S = final_S & chunk_S
    keys = jnp.where(new_S, keys_S, st.keys)
    first = sample_or_argmax(fold_keys(keys, zeros), logits, transform_logits(logits, sa), sa.greedy)
    is_stop = jnp.any(first[:, None] == stop_ids_SM, -1)
    n_first = jnp.where(is_stop, 0, 1).astype(jnp.int32)
    new2 = new_S[:, None]

    def pick(fresh, old):
        return jnp.where(new_S.reshape((S,) + (1,) * (old.ndim - 1)), fresh, old)

    return st.replace(
        anchor=pick(first, st.anchor),
        out=jnp.where(new2, jnp.full_like(st.out, -1).at[:, 0].set(first), st.out),
        n_out=pick(n_first, st.n_out),
        done=pick(is_stop | (n_first >= max_new_S), st.done),
        max_new=pick(max_new_S, st.max_new),
        keys=keys,
        stop_ids=pick(stop_ids_SM, st.stop_ids),
        cycles=pick(zeros, st.cycles),
        tau_sum=pick(zeros, st.tau_sum),
        reached=pick(jnp.zeros_like(st.reached), st.reached),
        accepted_at=pick(jnp.zeros_like(st.accepted_at), st.accepted_at),
        verified=pick(zeros, st.verified),
        prev_conf=pick(jnp.ones_like(st.prev_conf) if prior_2K is None else prior_confidence(prior_2K, sa),
                       st.prev_conf),
        acc_w=pick(jnp.zeros_like(st.acc_w), st.acc_w),
        reach_w=pick(jnp.zeros_like(st.reach_w), st.reach_w),
        f_acc_w=pick(jnp.zeros_like(st.f_acc_w), st.f_acc_w),
        f_exp_w=pick(jnp.zeros_like(st.f_exp_w), st.f_exp_w),
    )
