"""The sequential stage of the DSpark drafter (docs/method.md §2.2–2.3).

Shape letters (docs/architecture.md, "Shape letters"): S rows (requests, or batch × anchors in training), G
block positions (γ), V vocab, P proposal vocab V′, W top-k candidates, D model width, R Markov
rank.

- `SequentialHead`: the transition bias B_k(x0, x<k) added to the parallel logits U_k.
  markov: B = W1[x_{k−1}] W2;  gated: B = (σ(W_g [h_k; W1[x]]) ⊙ W1[x]) W2;
  rnn: z = [s; W1[x]; h_k] → (g, c, o), s' = g⊙s + (1−g)⊙tanh(c), B = tanh(o) W2;
  none: B = 0 (the plain parallel DFlash drafter).
- `ConfidenceHead`: c_k = σ(wᵀ [h_k; W1[x_{k−1}]] + b), STS-calibrated at inference.
- `sample_block`: left-to-right sampling as a `lax.scan` over the γ positions (or an
  unrolled Python loop, for checking the scan); `teacher_forced`: the training path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.layers import Linear, param
from dspark_jax.sampling_transform import SamplingArrays, sample_or_argmax, transform_logits


class SequentialHead(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs):
        self.kind = cfg.head_type
        self.rank = r = cfg.rank
        dt, D, V = cfg.dtype, cfg.hidden_size, cfg.vocab_size
        # W1 covers every token (the previous token can be any target token); W2 only the
        # tokens the drafter proposes (V′ with a draft vocabulary).
        self.w1 = param(rngs, (V, r), ("vocab", "rank"), dt) if r else None
        self.w2 = param(rngs, (r, cfg.proposal_vocab_size), ("rank", "vocab"), dt) if r else None
        self.gate_proj = Linear(D + r, r, ("embed", "rank"), rngs=rngs, dtype=dt, bias=True) \
            if self.kind == "gated" else None
        self.joint_proj = Linear(2 * r + D, 3 * r, ("embed", "rank"), rngs=rngs, dtype=dt, bias=True) \
            if self.kind == "rnn" else None

    def prev_embedding(self, prev):
        """W1[x_{k−1}] [..., R] (an empty [..., 0] without a head)."""
        if self.w1 is None:
            return jnp.zeros(prev.shape + (0,), jnp.float32)
        return self.w1[...][prev]

    def init_state(self, batch_shape):
        return jnp.zeros(tuple(batch_shape) + ((self.rank,) if self.kind == "rnn" else (0,)), jnp.float32)

    def latent(self, state, prev, h):
        """(state, x_{k−1} [...], h_k [..., D]) → (state', latent [..., R], W1[x_{k−1}]); the bias is latent·W2."""
        emb = self.prev_embedding(prev)
        if self.kind in ("none", "markov"):
            return state, emb, emb
        if self.kind == "gated":
            return state, jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h, emb], -1))) * emb, emb
        z = jnp.concatenate([state.astype(h.dtype), emb, h], -1)  # rnn
        g, c, o = jnp.split(self.joint_proj(z), 3, axis=-1)
        g = jax.nn.sigmoid(g.astype(jnp.float32))
        state = g * state + (1.0 - g) * jnp.tanh(c.astype(jnp.float32))
        return state, jnp.tanh(o), emb

    def step(self, state, prev, h):
        """(state, x_{k−1} [...], h_k [..., D]) → (state', bias [..., V′] fp32, W1[x_{k−1}])."""
        state, lat, emb = self.latent(state, prev, h)
        if self.kind == "none":
            return state, jnp.zeros((), jnp.float32), emb  # broadcasts onto U
        bias = jnp.einsum("...r,rv->...v", lat, self.w2[...], preferred_element_type=jnp.float32)
        return state, bias, emb

    @property
    def stateful(self) -> bool:
        return self.kind == "rnn"


class ConfidenceHead(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs):
        din = cfg.hidden_size + (cfg.rank if cfg.uses_markov_in_confidence else 0)
        self.use_markov = cfg.uses_markov_in_confidence
        self.proj = Linear(din, 1, ("embed", None), rngs=rngs, dtype=cfg.dtype, bias=True)

    def logit(self, h, emb):
        x = jnp.concatenate([h, emb.astype(h.dtype)], -1) if self.use_markov else h
        return self.proj(x)[..., 0].astype(jnp.float32)


def sts_confidence(conf_logit, sts_temperatures):
    """c'_k = σ(logit(c_k) / T_k); `conf_logit` [..., G]."""
    if not sts_temperatures:
        return jax.nn.sigmoid(conf_logit)
    return jax.nn.sigmoid(conf_logit / jnp.asarray(sts_temperatures, jnp.float32))


def sample_block(head: SequentialHead, conf: ConfidenceHead | None, U_SGV, h_SGD, anchor_S, keys_S,
                 sa: SamplingArrays, *, draft_ids=None, vocab_size: int | None = None, topk: int = 0,
                 use_scan: bool = True, with_logits: bool = True):
    """Samples x_1..x_γ left to right from p_k = transform(U_k + B_k(x0, x<k)).

    U_SGV holds the parallel logits over the proposal vocabulary V′: all V tokens, or the
    draft vocabulary `draft_ids` [V′] (target ids). With `topk` (static, 0 < topk < V′) the
    bias is added to the `topk` best entries of U_k only (gathering those W2 columns) and the
    rest are -inf. Returns (tokens [S, G] target ids, transformed logits [S, G, V] that each
    token was drawn from — -inf outside what could be proposed —, raw confidence logits
    [S, G], zeros without a confidence head). Position k uses the key fold_in(keys_S, k), so
    scan and loop draw identical tokens.

    Cost: the parallel logits do not depend on the drafted tokens, so their top-k and the
    W2 columns it selects are taken once for the whole block before the scan; the scan's
    step then works on [S, k] (or [S, V′]) only, and the scatter into the full vocabulary
    happens once after it. `with_logits=False` returns None for the logits and skips that
    scatter (greedy verification never reads them).
    """
    S, G, Vp = U_SGV.shape
    V = vocab_size or Vp
    truncate = 0 < topk < Vp
    biased = head.kind != "none"
    U_SGV = U_SGV.astype(jnp.float32)

    def to_vocab(idx):  # proposal index → target token id
        return idx if draft_ids is None else draft_ids[idx]

    if truncate:
        base_SGW, cand_SGW = jax.lax.top_k(U_SGV, topk)  # W = k candidates per position
        # Their W2 columns, gathered once: [G, S, R, k] (nothing when there is no bias).
        w2_xs = jnp.moveaxis(jnp.take(head.w2[...], cand_SGW, axis=1), (2, 1), (0, 1)) if biased \
            else jnp.zeros((G,), jnp.float32)
    else:
        base_SGW, cand_SGW = U_SGV, None
        w2_xs = jnp.zeros((G,), jnp.float32)

    def step(carry, xs):
        prev, state = carry
        b_k, h_k, w2_k, cand_k, k = xs
        state, lat, emb = head.latent(state, prev, h_k)
        logits = b_k
        if biased and truncate:
            logits = logits + jnp.einsum("sr,srk->sk", lat, w2_k, preferred_element_type=jnp.float32)
        elif biased:
            logits = logits + jnp.einsum("sr,rv->sv", lat, head.w2[...], preferred_element_type=jnp.float32)
        t = transform_logits(logits, sa)
        j = sample_or_argmax(jax.vmap(jax.random.fold_in, (0, None))(keys_S, k), logits, t, sa.greedy,
                             sa.all_greedy)
        if truncate:
            j = jnp.take_along_axis(cand_k, j[:, None], 1)[:, 0]
        tok = to_vocab(j).astype(jnp.int32)
        c = conf.logit(h_k, emb) if conf is not None else jnp.zeros((S,), jnp.float32)
        return (tok, state), (tok, t, c)

    carry = (anchor_S.astype(jnp.int32), head.init_state((S,)))
    cand_xs = jnp.swapaxes(cand_SGW, 0, 1) if truncate else jnp.zeros((G,), jnp.int32)
    xs = (jnp.swapaxes(base_SGW, 0, 1), jnp.swapaxes(h_SGD, 0, 1), w2_xs, cand_xs, jnp.arange(G))
    if use_scan:
        _, (toks, ts, cs) = jax.lax.scan(step, carry, xs)
    else:
        outs = []
        for k in range(G):
            carry, o = step(carry, jax.tree.map(lambda a, k=k: a[k], xs))
            outs.append(o)
        toks, ts, cs = (jnp.stack(z) for z in zip(*outs))
    toks, ts, cs = jnp.swapaxes(toks, 0, 1), jnp.swapaxes(ts, 0, 1), jnp.swapaxes(cs, 0, 1)
    if not with_logits:
        return toks, None, cs
    # Scatter into the full vocabulary: q = 0 (-inf) wherever the drafter cannot propose.
    if truncate:
        cols = to_vocab(cand_SGW)
    else:
        cols = None if draft_ids is None else jnp.broadcast_to(draft_ids, (S, G, Vp))
    if cols is not None:
        ts = jnp.full((S, G, V), -jnp.inf, jnp.float32).at[
            jnp.arange(S)[:, None, None], jnp.arange(G)[None, :, None], cols].set(ts)
    return toks, ts, cs


def teacher_forced(head: SequentialHead, conf: ConfidenceHead | None, U_SGV, h_SGD, prev_SG):
    """Training path: previous tokens are the ground truth. Returns (logits [S, G, V] fp32,
    raw confidence logits [S, G]). Markov/gated heads are one batched gather + matmul; the
    RNN is a scan over G."""
    if head.stateful:
        def step(state, xs):
            prev, h = xs
            state, bias, emb = head.step(state, prev, h)
            return state, (bias, emb)

        _, (bias, emb) = jax.lax.scan(step, head.init_state(prev_SG.shape[:1]),
                                      (jnp.swapaxes(prev_SG, 0, 1), jnp.swapaxes(h_SGD, 0, 1)))
        bias, emb = jnp.swapaxes(bias, 0, 1), jnp.swapaxes(emb, 0, 1)
    else:
        _, bias, emb = head.step(None, prev_SG, h_SGD)
    logits = U_SGV.astype(jnp.float32) + bias
    c = conf.logit(h_SGD, emb) if conf is not None else jnp.zeros(prev_SG.shape, jnp.float32)
    return logits, c
