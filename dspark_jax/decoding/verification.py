"""Lossless verification of draft blocks (docs/method.md §5).

`verify(keys, draft_tokens, draft_logits, target_logits, num_verify, sa)`:

- draft_tokens  [R, K] int32: the drafts; row r's first `num_verify[r]` are checked.
- draft_logits  [R, K, V]: the *transformed* logits each draft was sampled from (after the
  Markov/RNN correction and the request's sampling transform), i.e. p_d = softmax(·).
- target_logits [R, K+1, V]: raw target logits; position k scores the token after the
  anchor + k drafts, so position K gives the bonus.
- num_verify    [R] int32 in [0, K].
- sa            SamplingArrays (per-request temperature, top-k, top-p, min-p).

Returns `(accepted [R], emitted [R, K+1])`: the first `accepted[r]` entries of row r are
the accepted drafts, entry `accepted[r]` is the correction (after a rejection) or the bonus
token, and the rest are -1. Greedy rows (temperature 0) accept a draft iff it equals the
target argmax; sampled rows use the standard rule: accept x_k with probability
min(1, p_t(x_k) / p_d(x_k)); on the first rejection draw from norm(max(0, p_t − p_d));
after ℓ acceptances draw the bonus from p_t. The output is distributed exactly as the
transformed target. A draft distribution that is not a valid distribution (NaN/inf
logits) is never accepted, and its residual is p_t itself, so decoding stays exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import SamplingArrays, transform_logits


def _probs(logits):
    p = jax.nn.softmax(logits, axis=-1)
    ok = jnp.all(jnp.isfinite(p), axis=-1, keepdims=True) & (jnp.sum(p, -1, keepdims=True) > 0.5)
    return jnp.where(ok, p, 0.0), ok[..., 0]


def _verify_greedy(draft_tokens, target_logits, num_verify):
    """All rows greedy: argmax comparisons only (no softmax, no draws over V)."""
    R, K = draft_tokens.shape
    top = jnp.argmax(target_logits, -1).astype(jnp.int32)  # [R, K+1]
    acc = (draft_tokens == top[:, :K]) & (jnp.arange(K)[None] < num_verify[:, None])
    accepted = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)
    j = jnp.arange(K + 1)[None]
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((R, 1), jnp.int32)], 1)
    last = top[jnp.arange(R), accepted]
    emitted = jnp.where(j < accepted[:, None], drafts, jnp.where(j == accepted[:, None], last[:, None], -1))
    return accepted, emitted.astype(jnp.int32)


def verify(keys, draft_tokens, draft_logits, target_logits, num_verify, sa: SamplingArrays):
    R, K = draft_tokens.shape
    if sa.all_greedy:
        return _verify_greedy(draft_tokens, target_logits, num_verify)
    greedy = sa.greedy  # [R]
    tgt_t = transform_logits(target_logits, sa)  # [R, K+1, V]
    p_t, _ = _probs(tgt_t)
    k_pos = jnp.arange(K)
    if K > 0:
        p_d, d_ok = _probs(draft_logits.astype(jnp.float32))  # [R, K, V], [R, K]
        pt_x = jnp.take_along_axis(p_t[:, :K], draft_tokens[..., None], -1)[..., 0]
        pd_x = jnp.take_along_axis(p_d, draft_tokens[..., None], -1)[..., 0]
        ku, _ = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
        u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(ku)
        # u < p_t/p_d  ⇔  u·p_d < p_t (no division; p_d(x) > 0 for a token drawn from p_d).
        acc_sampled = d_ok & (u * pd_x < pt_x)
        acc_greedy = draft_tokens == jnp.argmax(target_logits[:, :K], -1)
        acc = jnp.where(greedy[:, None], acc_greedy, acc_sampled) & (k_pos[None] < num_verify[:, None])
        accepted = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)
    else:
        accepted = jnp.zeros((R,), jnp.int32)
    # Correction/bonus distribution at position `accepted`.
    rows = jnp.arange(R)
    pt_a = p_t[rows, accepted]  # [R, V]
    if K > 0:
        rejected = accepted < num_verify
        pd_a = p_d[rows, jnp.minimum(accepted, K - 1)]
        resid = jnp.maximum(pt_a - pd_a, 0.0)
        # No residual mass means p_d == p_t there (a rejection then has probability 0; this
        # guards against rounding): fall back to p_t.
        resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, pt_a)
        dist = jnp.where(rejected[:, None], resid, pt_a)
    else:
        dist = pt_a
    kr = jax.vmap(lambda k: jax.random.split(k)[1])(keys)
    drawn = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(kr, dist)
    greedy_tok = jnp.argmax(target_logits[rows, accepted], -1)
    last = jnp.where(greedy, greedy_tok, drawn).astype(jnp.int32)
    j = jnp.arange(K + 1)[None]
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((R, 1), jnp.int32)], 1)
    emitted = jnp.where(j < accepted[:, None], drafts, jnp.where(j == accepted[:, None], last[:, None], -1))
    return accepted, emitted.astype(jnp.int32)
