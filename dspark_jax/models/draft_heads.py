"""The sequential stage of the DSpark drafter (DESIGN.md §2.2-2.4).

Letter legend: S rows (requests, or batch × anchors in training), G block positions (γ),
V vocab, D model width, R Markov rank.

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

from dspark_jax.decoding.sampling import SamplingArrays, sample_or_argmax, transform_logits
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.layers import Linear, param


class SequentialHead(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs):
        self.kind = cfg.head_type
        self.rank = r = cfg.rank
        dt, D, V = cfg.dtype, cfg.hidden_size, cfg.vocab_size
        self.w1 = param(rngs, (V, r), ("vocab", "rank"), dt) if r else None
        self.w2 = param(rngs, (r, V), ("rank", "vocab"), dt) if r else None
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

    def step(self, state, prev, h):
        """(state, x_{k−1} [...], h_k [..., D]) → (state', bias [..., V] fp32, W1[x_{k−1}])."""
        emb = self.prev_embedding(prev)
        if self.kind == "none":
            return state, jnp.zeros((), jnp.float32), emb  # broadcasts onto U
        if self.kind == "markov":
            latent = emb
        elif self.kind == "gated":
            latent = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h, emb], -1))) * emb
        else:  # rnn
            z = jnp.concatenate([state.astype(h.dtype), emb, h], -1)
            g, c, o = jnp.split(self.joint_proj(z), 3, axis=-1)
            g = jax.nn.sigmoid(g.astype(jnp.float32))
            state = g * state + (1.0 - g) * jnp.tanh(c.astype(jnp.float32))
            latent = jnp.tanh(o)
        bias = jnp.einsum("...r,rv->...v", latent, self.w2[...], preferred_element_type=jnp.float32)
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
                 sa: SamplingArrays, *, use_scan: bool = True):
    """Samples x_1..x_γ left to right from p_k = transform(U_k + B_k(x0, x<k)).

    Returns (tokens [S, G], transformed logits [S, G, V] that each token was drawn from,
    raw confidence logits [S, G] — zeros without a confidence head). Position k uses the
    key fold_in(keys_S, k), so scan and loop draw identical tokens.
    """
    S, G, _ = U_SGV.shape

    def step(carry, xs):
        prev, state = carry
        U_k, h_k, k = xs
        state, bias, emb = head.step(state, prev, h_k)
        logits = U_k.astype(jnp.float32) + bias
        t = transform_logits(logits, sa)
        tok = sample_or_argmax(jax.vmap(jax.random.fold_in, (0, None))(keys_S, k), logits, t, sa.greedy)
        c = conf.logit(h_k, emb) if conf is not None else jnp.zeros((S,), jnp.float32)
        return (tok, state), (tok, t, c)

    carry = (anchor_S.astype(jnp.int32), head.init_state((S,)))
    xs = (jnp.swapaxes(U_SGV, 0, 1), jnp.swapaxes(h_SGD, 0, 1), jnp.arange(G))
    if use_scan:
        _, (toks, ts, cs) = jax.lax.scan(step, carry, xs)
    else:
        outs = []
        for k in range(G):
            carry, o = step(carry, jax.tree.map(lambda a, k=k: a[k], xs))
            outs.append(o)
        toks, ts, cs = (jnp.stack(z) for z in zip(*outs))
    return jnp.swapaxes(toks, 0, 1), jnp.swapaxes(ts, 0, 1), jnp.swapaxes(cs, 0, 1)


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
