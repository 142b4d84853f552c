"""One jitted drafter train step: frozen target → teacher-forced drafter → loss → AdamW.

Shape letters (docs/architecture.md): B sequences, T positions, A anchors, G block size γ, D width, F tapped
features (n·D), V vocab, P proposal vocab V′.

The target is frozen and runs inside the step ("online"): one forward gives the features
of every position and the last hidden state; the target's distributions are computed only
at the positions the blocks predict (the paper's memory trick). With a feature cache
("offline", DeepSpec's mode) the step takes those two arrays instead and skips the target
forward. Only the drafter's `nnx.Param`s train; its draft-vocabulary ids and the target's
embedding and LM head are used, never copied into the optimiser.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from dspark_jax.models.drafter import DSparkDrafter, forward_train
from dspark_jax.models.transformer import KVCache
from dspark_jax.training.losses import LossConfig, dspark_loss

DEFAULT_LOSS = LossConfig()  # DeepSpec's DSpark mix


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 6e-4
    warmup_fraction: float = 0.04
    total_steps: int = 1000
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    b2: float = 0.95

    def optimizer(self) -> optax.GradientTransformation:
        warm = max(1, int(self.warmup_fraction * self.total_steps))
        sched = optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, warm, max(self.total_steps, warm + 1),
                                                   end_value=0.0)
        return optax.chain(optax.clip_by_global_norm(self.clip_norm),
                           optax.adamw(sched, b2=self.b2, weight_decay=self.weight_decay))


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # the drafter's nnx.Param state
    opt_state: Any


def split_drafter(drafter: DSparkDrafter):
    """(graphdef, trainable params, frozen rest: draft-vocabulary ids, runtime copies)."""
    return nnx.split(drafter, nnx.Param, ...)


def init_state(params, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def init_sharded(build, tx: optax.GradientTransformation, mesh=None, rules=None):
    """(drafter graphdef, TrainState, frozen rest) with every array created straight into its
    sharding: `eval_shape` → shardings from the logical axes → jitted init; no full copy
    of the model ever sits on one device. `build()` returns a fresh DSparkDrafter."""
    from dspark_jax.sharding import TRAINING_RULES, state_shardings

    dgraph, aparams, arest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)

    def make():
        return nnx.split(build(), nnx.Param, ...)[1:]

    shardings = None
    if mesh is not None:
        rules = TRAINING_RULES if rules is None else rules
        shardings = (state_shardings(aparams, mesh, rules), state_shardings(arest, mesh, rules))
    params, rest = jax.jit(make, out_shardings=shardings)()
    # AdamW's moments are zeros_like(params): XLA gives them the parameters' shardings.
    return dgraph, jax.jit(functools.partial(init_state, tx=tx))(params), rest


def target_outputs(tgraph, tstate, tokens_BT, feature_layers: tuple[int, ...]):
    """Frozen target forward → (features [B, T, F], last hidden state before the final norm [B, T, D])."""
    target = nnx.merge(tgraph, tstate)
    B, T = tokens_BT.shape
    L = target.cfg.num_layers
    layers = tuple(feature_layers) + (L - 1,)
    cache = KVCache.zeros(target.cfg, B, T)
    _, feats, _ = target(cache, tokens_BT.reshape(-1), jnp.zeros(B, jnp.int32), jnp.full(B, T, jnp.int32),
                         q_max=T, logits_idx=jnp.zeros(1, jnp.int32), feature_layers=layers)
    feats = feats.reshape(B, T, -1)
    D = target.cfg.hidden_size
    return jax.lax.stop_gradient(feats[..., :-D]), jax.lax.stop_gradient(feats[..., -D:])


def _loss(params, dgraph, rest, tgraph, tstate, batch, feats_BTF, last_BTD, loss: LossConfig):
    target = nnx.merge(tgraph, tstate)
    drafter = nnx.merge(dgraph, params, rest)
    tokens, anchors, bmask = batch["tokens"], batch["anchors"], batch["block_mask"]
    B, T = tokens.shape
    G = drafter.cfg.block_size
    V = drafter.cfg.vocab_size
    lm = target.lm_head_matrix()
    # Block position k (0-based) predicts the token at anchor + k + 1, which the target
    # scores from its hidden state at anchor + k.
    pos = jnp.clip(anchors[..., None] + jnp.arange(G), 0, T - 1)  # [B, A, G]
    h = jnp.take_along_axis(last_BTD, pos.reshape(B, -1)[..., None], 1)  # [B, AG, D]
    ids = drafter.proposal_ids
    if loss.target_over_proposal and ids is not None:
        return _loss_over_proposal(drafter, target, lm, feats_BTF, tokens, anchors, bmask, h, pos, loss)
    tl = target.unembed(h.astype(last_BTD.dtype))  # [B, AG, V] fp32
    logp_t = jax.nn.log_softmax(tl, -1).reshape(pos.shape + (V,))
    if loss.labels == "target":
        # What greedy verification accepts: the target's argmax; the head sees those tokens too.
        labels = jnp.argmax(logp_t, -1).astype(jnp.int32)
        anchor_tok = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, T - 1), 1)
        prev = jnp.concatenate([anchor_tok[..., None], labels[..., :-1]], -1)
    else:
        labels = jnp.take_along_axis(tokens, jnp.clip(pos + 1, 0, T - 1).reshape(B, -1), 1).reshape(pos.shape)
        prev = None
    logits, conf = forward_train(drafter, target.embed_tokens[...], lm, feats_BTF, tokens, anchors, prev_BAG=prev)
    if ids is None:
        logp_t_p, in_mass = logp_t, jnp.ones(pos.shape, jnp.float32)
        lab_p, lab_in = labels, jnp.ones(pos.shape, jnp.float32)
    else:
        logp_t_p = jnp.take(logp_t, ids, axis=-1)
        in_mass = jnp.sum(jnp.exp(logp_t_p), -1)
        where = jnp.full((V,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
        lab_p = where[labels]
        lab_in = (lab_p >= 0).astype(jnp.float32)
        lab_p = jnp.maximum(lab_p, 0)
    logp_t_p = jax.lax.stop_gradient(logp_t_p)
    return dspark_loss(logits, conf, logp_t_p, jax.lax.stop_gradient(in_mass), lab_p, lab_in, bmask,
                       decay=loss.decay, alpha=loss.alpha)


def _loss_over_proposal(drafter, target, lm, feats_BTF, tokens, anchors, bmask, h, pos, loss: LossConfig):
    """`LossConfig.target_over_proposal`: the target's distribution over the draft vocabulary
    only (renormalised); labels from the data, or its argmax over V′."""
    B, T = tokens.shape
    ids = drafter.proposal_ids
    hn = target.norm(h.astype(jnp.float32))
    tl = jnp.einsum("...d,dv->...v", hn, jnp.take(lm, ids, axis=1), preferred_element_type=jnp.float32)
    logp_t_p = jax.lax.stop_gradient(jax.nn.log_softmax(tl, -1).reshape(pos.shape + (ids.shape[0],)))
    if loss.labels == "target":
        lab_p = jnp.argmax(logp_t_p, -1).astype(jnp.int32)
        lab_in = jnp.ones(pos.shape, jnp.float32)
        anchor_tok = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, T - 1), 1)
        prev = jnp.concatenate([anchor_tok[..., None], ids[lab_p][..., :-1]], -1)
    else:
        labels = jnp.take_along_axis(tokens, jnp.clip(pos + 1, 0, T - 1).reshape(B, -1), 1).reshape(pos.shape)
        V = drafter.cfg.vocab_size
        where = jnp.full((V,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
        lab_p = where[labels]
        lab_in = (lab_p >= 0).astype(jnp.float32)
        lab_p = jnp.maximum(lab_p, 0)
        prev = None
    logits, conf = forward_train(drafter, target.embed_tokens[...], lm, feats_BTF, tokens, anchors, prev_BAG=prev)
    return dspark_loss(logits, conf, logp_t_p, jnp.ones(pos.shape, jnp.float32), lab_p, lab_in, bmask,
                       decay=loss.decay, alpha=loss.alpha)


def _update(st: TrainState, tx, dgraph, rest, tgraph, tstate, batch, feats, last, loss_cfg):
    grad_fn = jax.value_and_grad(_loss, has_aux=True)
    (loss, metrics), grads = grad_fn(st.params, dgraph, rest, tgraph, tstate, batch, feats, last, loss_cfg)
    updates, opt_state = tx.update(grads, st.opt_state, st.params)
    params = optax.apply_updates(st.params, updates)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
    return TrainState(st.step + 1, params, opt_state), metrics


@functools.partial(jax.jit, static_argnames=("tx", "dgraph", "tgraph", "feature_layers", "loss"),
                   donate_argnames=("st",))
def train_step_online(st: TrainState, rest, tstate, batch, *, tx, dgraph, tgraph, feature_layers,
                      loss: LossConfig = DEFAULT_LOSS):
    """Target forward inside the step. Donates the train state it replaces."""
    feats, last = target_outputs(tgraph, tstate, batch["tokens"], feature_layers)
    return _update(st, tx, dgraph, rest, tgraph, tstate, batch, feats, last, loss)


@functools.partial(jax.jit, static_argnames=("tx", "dgraph", "tgraph", "loss"), donate_argnames=("st",))
def train_step_cached(st: TrainState, rest, tstate, batch, feats, last, *, tx, dgraph, tgraph,
                      loss: LossConfig = DEFAULT_LOSS):
    """Features and last hidden state from the feature cache (no target forward)."""
    return _update(st, tx, dgraph, rest, tgraph, tstate, batch, feats.astype(jnp.float32),
                   last.astype(jnp.float32), loss)


@functools.partial(jax.jit, static_argnames=("dgraph", "tgraph", "feature_layers", "loss"))
def eval_step(params, rest, tstate, batch, *, dgraph, tgraph, feature_layers, loss: LossConfig = DEFAULT_LOSS):
    feats, last = target_outputs(tgraph, tstate, batch["tokens"], feature_layers)
    return _loss(params, dgraph, rest, tgraph, tstate, batch, feats, last, loss)[1]


@functools.partial(jax.jit, static_argnames=("tgraph", "feature_layers"))
def compute_target_outputs(tgraph, tstate, tokens_BT, *, feature_layers):
    """The feature cache's fill: (features, last hidden state), both bf16 (half the bytes)."""
    f, last = target_outputs(tgraph, tstate, tokens_BT, feature_layers)
    return f.astype(jnp.bfloat16), last.astype(jnp.bfloat16)
