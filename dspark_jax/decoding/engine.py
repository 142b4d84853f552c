"""The on-device decoding loop: prefill, then speculative (or autoregressive) cycles.

Letter legend: S request slots, K verified drafts per cycle (max), N packed tokens
(= S·(K+1)), T cache length, O output buffer, V vocab, F tapped target features.

One cycle (docs/method.md §5, docs/architecture.md): draft → choose ℓ_r ≤ K per slot → pack [anchor, d_1..d_ℓ] of
every slot into one static bucket → one packed target step (logits + features) →
verify → commit (rejected cache positions are overwritten later, never read) → append the
features of anchor + accepted drafts to the drafter's context cache → the last emitted
token is the next anchor. Autoregressive decoding is the same cycle with K = 0 and no
drafter: verification with zero drafts is exactly sampling from the target.

A drafter plugs in through three pure methods (called inside jit; the drafter object is a
static argument, its parameters a traced one):
  init_cache(params, num_slots, length) -> cache pytree
  append(params, cache, target, feats [N, F], slot [N], pos [N], valid [N]) -> cache
  draft(params, cache, target, anchor [S], anchor_pos [S], keys [S], sa)
      -> tokens [S, γ], transformed logits [S, γ, V], confidences [S, γ]
and the attributes `block_size` (γ) and `feature_layers` (target layer ids it reads).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspark_jax.decoding.sampling import SamplingArrays, sample_or_argmax, transform_logits
from dspark_jax.decoding.verification import verify
from dspark_jax.models.transformer import KVCache, packed_layout


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Static shape settings of one compiled decode loop."""

    num_draft: int  # K: drafts verified per request per cycle (0 = autoregressive)


@struct.dataclass
class GenState:
    cache: KVCache
    dcache: Any  # drafter context cache, or None
    seq_len: jax.Array  # [S] tokens committed in the cache; the anchor sits at this position
    anchor: jax.Array  # [S] last emitted token (not yet in the cache)
    out: jax.Array  # [S, O] emitted tokens
    n_out: jax.Array  # [S]
    done: jax.Array  # [S] bool
    max_new: jax.Array  # [S]
    keys: jax.Array  # [S] PRNG keys (one per request; never depends on the batch)
    stop_ids: jax.Array  # [S, M] stop token ids, -1 padded
    cycles: jax.Array  # [S] cycles run
    tau_sum: jax.Array  # [S] Σ (accepted + 1) over cycles
    reached: jax.Array  # [S, K] cycles where draft j was verified with its prefix accepted
    accepted_at: jax.Array  # [S, K] cycles where draft j was accepted


def _fold(keys, data):
    return jax.vmap(jax.random.fold_in)(keys, data)


def _first_stop(tokens_SJ, limit_S, stop_ids_SM):
    """Index of the first stop token within the first `limit` entries of each row (or J)."""
    J = tokens_SJ.shape[1]
    is_stop = jnp.any(tokens_SJ[..., None] == stop_ids_SM[:, None, :], -1)
    is_stop &= jnp.arange(J)[None] < limit_S[:, None]
    return jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), J), jnp.any(is_stop, 1)


def _chunk_take(remaining_S, budget: int):
    """Slot-major split of a token budget: each slot takes what it still needs, in slot order."""
    before = jnp.cumsum(remaining_S) - remaining_S
    return jnp.clip(budget - before, 0, remaining_S)


@functools.partial(
    jax.jit, static_argnames=("tgraph", "drafter", "q_max", "chunk"), donate_argnames=("st",)
)
def prefill(tgraph, tstate, drafter, dparams, st: GenState, tokens_N, lens_S, sa: SamplingArrays, *, q_max,
            chunk=None):
    """Runs the prompts (slot-major in `tokens_N`) and samples each request's first token.

    The prompts go through the packed step `chunk` tokens at a time (a `lax.while_loop`, so
    one compiled program serves any prompt length in the bucket): each step's attention
    scores are [S, H, min(q_max, chunk), T] instead of [S, H, prompt, T], which keeps memory
    bounded for long prompts. Each chunk continues every unfinished slot where the previous
    one stopped (starts > 0), slot-major, so a chunk may hold the end of one prompt and the
    start of the next. `chunk=None`: the whole packed buffer in one step.
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
                                      feature_layers=feature_layers)
        if drafter is not None:
            dcache = drafter.append(dparams, dcache, target, feats, lay.slot_N, lay.pos_N, lay.valid_N)
        finished = (take_S > 0) & (done_S + take_S == lens_S)
        last_SV = jnp.where(finished[:, None], logits, last_SV)
        return done_S + take_S, cache, dcache, last_SV

    init = (jnp.zeros((S,), jnp.int32), st.cache, st.dcache, jnp.zeros((S, V), jnp.float32))
    _, cache, dcache, logits = jax.lax.while_loop(lambda c: jnp.any(c[0] < lens_S), body, init)
    zeros = jnp.zeros((S,), jnp.int32)
    first = sample_or_argmax(_fold(st.keys, zeros), logits, transform_logits(logits, sa), sa.greedy)
    is_stop = jnp.any(first[:, None] == st.stop_ids, -1)
    live = ~st.done
    # Strongly typed int32: a weak-typed n_out would make the decode loop's first call and
    # its later chunks (stop strings) two different programs, i.e. a second compile.
    n_out = jnp.where(live & ~is_stop, 1, 0).astype(jnp.int32)
    return st.replace(
        cache=cache,
        dcache=dcache,
        seq_len=lens_S,
        anchor=first,
        out=st.out.at[:, 0].set(jnp.where(live, first, -1)),
        n_out=n_out,
        done=st.done | is_stop | (n_out >= st.max_new),
    )


def _cycle(target, drafter, dparams, st: GenState, sa: SamplingArrays, settings: LoopSettings):
    S = st.seq_len.shape[0]
    K = settings.num_draft
    rows = jnp.arange(S)
    active = ~st.done
    kc = _fold(st.keys, st.seq_len)  # seq_len is unique per cycle of a request
    kd = _fold(kc, jnp.ones_like(st.seq_len))
    kv = _fold(kc, jnp.full_like(st.seq_len, 2))
    if K > 0:
        d_tok, d_logits, _ = drafter.draft(dparams, st.dcache, target, st.anchor, st.seq_len, kd, sa)
        d_tok, d_logits = d_tok[:, :K], d_logits[:, :K]
    else:
        d_tok = jnp.zeros((S, 0), jnp.int32)
        d_logits = jnp.zeros((S, 0, target.cfg.vocab_size), jnp.float32)
    remaining = st.max_new - st.n_out
    nv = jnp.where(active, jnp.clip(jnp.minimum(K, remaining - 1), 0, K), 0)
    counts = jnp.where(active, 1 + nv, 0)
    N = S * (K + 1)
    lay = packed_layout(st.seq_len, counts, N, K + 1)
    grid_tok = jnp.concatenate([st.anchor[:, None], d_tok], 1)  # [S, K+1]
    tokens_N = grid_tok[lay.slot_N, jnp.clip(lay.j_N, 0, K)]
    feature_layers = drafter.feature_layers if drafter is not None else ()
    logits_N, feats, cache = target(st.cache, tokens_N, st.seq_len, counts, q_max=K + 1,
                                    feature_layers=feature_layers)
    # Back to the [S, K+1] grid (empty cells read a clamped row; they are never used).
    tgt_logits = logits_N[jnp.minimum(lay.grid_idx_SQ, N - 1)]
    accepted, emitted = verify(kv, d_tok, d_logits, tgt_logits, nv, sa)
    accepted = jnp.where(active, accepted, 0)
    dcache = st.dcache
    if drafter is not None:
        keep = lay.valid_N & (lay.j_N <= accepted[lay.slot_N])
        dcache = drafter.append(dparams, dcache, target, feats, lay.slot_N, lay.pos_N, keep)
    n_emit = accepted + 1
    stop_at, hit = _first_stop(emitted, n_emit, st.stop_ids)
    n_emit = jnp.minimum(jnp.where(hit, stop_at, n_emit), remaining)
    n_emit = jnp.where(active, n_emit, 0)
    # Entries past n_out are scratch: a finished row may scribble there, nobody reads them.
    # (The buffer holds max_new + K + 1, so the slice never gets clamped onto real tokens.)
    out = jax.vmap(lambda o, e, i: jax.lax.dynamic_update_slice(o, e, (i,)))(st.out, emitted, st.n_out)
    n_out = st.n_out + n_emit
    j = jnp.arange(K)[None]
    act = active[:, None]
    return st.replace(
        cache=cache,
        dcache=dcache,
        seq_len=st.seq_len + jnp.where(active, accepted + 1, 0),
        anchor=jnp.where(active, emitted[rows, accepted], st.anchor),
        out=out,
        n_out=n_out,
        done=st.done | (active & (hit | (n_out >= st.max_new))),
        cycles=st.cycles + active,
        tau_sum=st.tau_sum + jnp.where(active, accepted + 1, 0),
        reached=st.reached + (act & (j < nv[:, None]) & (j <= accepted[:, None])),
        accepted_at=st.accepted_at + (act & (j < accepted[:, None])),
    )


@functools.partial(
    jax.jit, static_argnames=("tgraph", "drafter", "settings"), donate_argnames=("st",)
)
def decode_loop(tgraph, tstate, drafter, dparams, st: GenState, sa: SamplingArrays, max_cycles,
                *, settings: LoopSettings):
    """Runs cycles on device until every request is done or `max_cycles` cycles have run."""
    target = nnx.merge(tgraph, tstate)

    def cond(c):
        i, s = c
        return (i < max_cycles) & ~jnp.all(s.done)

    def body(c):
        i, s = c
        return i + 1, _cycle(target, drafter, dparams, s, sa, settings)

    _, st = jax.lax.while_loop(cond, body, (jnp.int32(0), st))
    return st
