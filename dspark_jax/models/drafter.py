"""The DSpark drafter: a parallel DFlash backbone on target features + the sequential heads.

Shape letters (docs/architecture.md, "Shape letters"): B batch rows (requests), T context positions, A anchors
per row, G block size (γ), Q block queries (A·G in training, G at inference), X keys (context
T + block queries), N packed tokens, L draft layers, D width, F tapped features (n·D), K KV
heads, E head dim, V vocab.

Backbone (docs/method.md §2.1): H_ctx = RMSNorm(W_fc [H(l1); …; H(ln)]) once; in every draft
layer the block's queries attend to [k_proj(H_ctx); k_proj(H_block)] (same projections and
k_norm for both; context features skip the layer norm, o_proj and MLP), bidirectionally
inside the block and to context positions before the anchor. The block input is
[x0, MASK × (γ−1)] at real positions p..p+γ−1 and all γ outputs predict (position k
predicts the token k+1 steps after the anchor). The token embedding and LM head are the
target's and are passed in, never stored here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models.draft_heads import ConfidenceHead, SequentialHead, teacher_forced
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.layers import MLP, Attention, Linear, RMSNorm, attend, param, rope_inv_freq


class DraftVocab(nnx.Variable):
    """Target token ids of the draft vocabulary [V′]: saved with the drafter, never trained."""


class TargetCopy(nnx.Variable):
    """A runtime copy of target weights (its LM head restricted to the draft vocabulary,
    [D, V′]): filled from the target at load (`Drafter.bind`), never saved, never trained."""


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs):
        lc = cfg.layer_config()
        dt = lc.jnp_dtype
        self.input_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps, dt, "embed")
        self.self_attn = Attention(lc, rngs=rngs, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps, dt, "embed")
        self.mlp = MLP(lc, rngs=rngs)

    def __call__(self, x_BQD, pos_BQ, ctx_k_BTKE, ctx_v_BTKE, mask_BQX, inv_freq):
        h = self.input_layernorm(x_BQD)
        q = self.self_attn.project_q(h, pos_BQ, inv_freq)
        k, v = self.self_attn.project_kv(h, pos_BQ, inv_freq)
        keys = jnp.concatenate([ctx_k_BTKE, k.astype(ctx_k_BTKE.dtype)], 1)
        vals = jnp.concatenate([ctx_v_BTKE, v.astype(ctx_v_BTKE.dtype)], 1)
        x_BQD = x_BQD + self.self_attn.project_out(attend(q, keys, vals, mask_BQX))
        return x_BQD + self.mlp(self.post_attention_layernorm(x_BQD))


class DSparkDrafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt, D = cfg.dtype, cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * D, D, ("features", "embed"), rngs=rngs, dtype=dt)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, dt, "embed")
        self.layers = nnx.List([DraftLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dt, "embed")
        self.mask_embedding = param(rngs, (D,), ("embed",), dt)
        self.head = SequentialHead(cfg, rngs=rngs)
        self.confidence = ConfidenceHead(cfg, rngs=rngs) if cfg.confidence_head else None
        if cfg.draft_vocab_size:
            self.draft_ids = DraftVocab(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32), axes=("draft_vocab",))
            self.draft_lm_head = TargetCopy(jnp.zeros((D, cfg.draft_vocab_size), dt), axes=("embed", "vocab"))

    @property
    def proposal_ids(self):
        """[V′] target ids the drafter proposes, or None for the full vocabulary."""
        return self.draft_ids[...] if self.cfg.draft_vocab_size else None

    def proposal_head(self, lm_head_DV):
        """The LM head over the proposal vocabulary: [D, V′]. `lm_head_DV` is the target's
        full head (used as is without a draft vocabulary, gathered in training)."""
        ids = self.proposal_ids
        return lm_head_DV if ids is None else jnp.take(lm_head_DV, ids, axis=1)

    def inv_freq(self):
        return rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, dict(self.cfg.rope_scaling or ()))

    def context_kv(self, feats_F, pos):
        """Projected context K/V of every draft layer: lists of [..., K, E]."""
        h = self.hidden_norm(self.fc(feats_F.astype(self.fc.kernel.dtype)))
        inv = self.inv_freq()
        kv = [layer.self_attn.project_kv(h, pos, inv) for layer in self.layers]
        return [k for k, _ in kv], [v for _, v in kv]

    def block_inputs(self, anchor_rows):
        """[x0, MASK × (γ−1)] from the anchors' embeddings [..., D] → [..., G, D]."""
        G = self.cfg.block_size
        x0 = anchor_rows[..., None, :]
        mask = jnp.broadcast_to(self.mask_embedding[...], anchor_rows.shape[:-1] + (G - 1, x0.shape[-1]))
        return jnp.concatenate([x0, mask.astype(x0.dtype)], -2)

    def backbone(self, x_BQD, pos_BQ, ctx_k, ctx_v, mask_BQX):
        """Draft layers + final norm → h [B, Q, D]; mask covers [context T; block Q] keys."""
        inv = self.inv_freq()
        for layer, k, v in zip(self.layers, ctx_k, ctx_v):
            x_BQD = layer(x_BQD, pos_BQ, k, v, mask_BQX, inv)
        return self.norm(x_BQD)


def training_attention_mask(anchors_BA, num_ctx: int, block_size: int):
    """[B, A·G, T + A·G]: block a sees context positions < anchor_a and its own block only."""
    B, A = anchors_BA.shape
    q_anchor = jnp.repeat(anchors_BA, block_size, axis=1)  # [B, AG]
    ctx = jnp.arange(num_ctx)[None, None, :] < q_anchor[..., None]
    blk = jnp.repeat(jnp.arange(A), block_size)
    own = jnp.broadcast_to(blk[:, None] == blk[None, :], (B, A * block_size, A * block_size))
    return jnp.concatenate([ctx, own], -1)


def forward_train(drafter: DSparkDrafter, embed_VD, lm_head_DV, feats_BTF, tokens_BT, anchors_BA, prev_BAG=None):
    """Teacher-forced drafter forward for training.

    feats_BTF: target features of every position; tokens_BT: the sequence; anchors_BA:
    anchor positions (block a predicts tokens anchor+1 .. anchor+γ); prev_BAG: the tokens the
    sequential head is teacher-forced on (position k's previous token; default: the sequence's
    own, the anchor at k = 0). Returns (logits
    [B, A, G, V] fp32 — parallel logits plus the head's bias for ground-truth previous
    tokens —, raw confidence logits [B, A, G]).
    """
    cfg = drafter.cfg
    G = cfg.block_size
    B, T = tokens_BT.shape
    A = anchors_BA.shape[1]
    ctx_k, ctx_v = drafter.context_kv(feats_BTF, jnp.broadcast_to(jnp.arange(T), (B, T)))
    anchor_tok = jnp.take_along_axis(tokens_BT, jnp.clip(anchors_BA, 0, T - 1), 1)
    x = drafter.block_inputs(embed_VD[anchor_tok]).reshape(B, A * G, -1)
    pos = (anchors_BA[..., None] + jnp.arange(G)).reshape(B, A * G)
    mask = training_attention_mask(anchors_BA, T, G)
    h = drafter.backbone(x, pos, ctx_k, ctx_v, mask).reshape(B, A, G, -1)
    U = jnp.einsum("bagd,dv->bagv", h, drafter.proposal_head(lm_head_DV), preferred_element_type=jnp.float32)
    # Position k's previous token is the ground truth at anchor + k (k = 0: the anchor).
    if prev_BAG is None:
        prev = jnp.take_along_axis(tokens_BT, jnp.clip(pos, 0, T - 1), 1).reshape(B * A, G)
    else:
        prev = prev_BAG.reshape(B * A, G)
    logits, conf = teacher_forced(drafter.head, drafter.confidence, U.reshape(B * A, G, -1),
                                  h.reshape(B * A, G, -1), prev)
    return logits.reshape(B, A, G, -1), conf.reshape(B, A, G)


def count_trainable(cfg: DrafterConfig) -> int:
    """Analytic trainable-parameter count (embedding and LM head excluded: they are the target's)."""
    D, F, H, K, E, r = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, \
        cfg.head_dim, cfg.rank
    n = len(cfg.target_layer_ids)
    layer = D * H * E + 2 * D * K * E + H * E * D + 2 * E + 3 * D * F + 2 * D
    total = n * D * D + D + cfg.num_layers * layer + D + D
    if r:
        total += (cfg.vocab_size + cfg.proposal_vocab_size) * r
        if cfg.head_type == "gated":
            total += (D + r) * r + r
        if cfg.head_type == "rnn":
            total += (2 * r + D) * 3 * r + 3 * r
    if cfg.confidence_head:
        total += D + (r if cfg.uses_markov_in_confidence else 0) + 1
    return total


def abstract_drafter(cfg: DrafterConfig):
    """(graphdef, abstract state) of a drafter, allocating nothing (jax.eval_shape)."""
    return nnx.split(nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0))))


def num_params(state) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(state))
