"""Gates that keep the drafter-training pipeline honest, measured offline (teacher-forced).

For sequences of (tokens, loss mask), every supervised position is an anchor; the block
drafted from it is compared with the target's greedy choice at each of its γ positions:

- `teacher_consistency`: how often the label token (the data's next token) equals the
  target's argmax — ≈ 1 on greedy-regenerated data; a misaligned label or target shows here.
- `greedy_acceptance`: per-position P(draft argmax = target argmax | prefix accepted) and
  the expected greedy accepted length τ = 1 + Σ_k Π_{i≤k} match_i, the offline twin of the
  τ that `generate()` measures at T = 0 on the same text. `features="zero"` / `"shuffle"`
  replaces the tapped target features (context ablation): if the drafter uses its context,
  acceptance must drop.
- `bigram_accuracy`: a count-based baseline (the most frequent next token after each anchor
  token, counted on training data) on the same positions.

Shape letters (docs/architecture.md): B sequences, T positions, A anchors, G block size γ, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models.drafter import forward_train
from dspark_jax.training.train_step import target_outputs


def _pad(seqs, width):
    tok = np.zeros((len(seqs), width), np.int32)
    msk = np.zeros((len(seqs), width), np.int32)
    for i, (t, m) in enumerate(seqs):
        n = min(len(t), width)
        tok[i, :n], msk[i, :n] = np.asarray(t)[:n], np.asarray(m)[:n]
    return tok, msk


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "feature_layers", "features"))
def _block_matches(tgraph, tstate, dgraph, dstate, tokens_BT, anchors_BA, *, feature_layers, features):
    """→ (draft argmax == target argmax [B, A, G], target argmax [B, A, G])."""
    target = nnx.merge(tgraph, tstate)
    drafter = nnx.merge(dgraph, dstate)
    B, T = tokens_BT.shape
    G = drafter.cfg.block_size
    feats, last = target_outputs(tgraph, tstate, tokens_BT, feature_layers)
    if features == "zero":
        feats = jnp.zeros_like(feats)
    elif features == "shuffle":  # another sequence's features at the same positions
        feats = jnp.roll(feats, 1, axis=0)
    pos = jnp.clip(anchors_BA[..., None] + jnp.arange(G), 0, T - 1)
    h = jnp.take_along_axis(last, pos.reshape(B, -1)[..., None], 1)
    tgt = jnp.argmax(target.unembed(h), -1).reshape(pos.shape)
    anchor_tok = jnp.take_along_axis(tokens_BT, jnp.clip(anchors_BA, 0, T - 1), 1)
    # Teacher-forced on the target's own greedy tokens: what the drafter sees when every
    # earlier draft of the block was accepted.
    prev = jnp.concatenate([anchor_tok[..., None], tgt[..., :-1]], -1)
    logits, _ = forward_train(drafter, target.embed_tokens[...], target.lm_head_matrix(), feats, tokens_BT,
                              anchors_BA, prev_BAG=prev)
    ids = drafter.proposal_ids
    d = jnp.argmax(logits, -1)
    d = d if ids is None else ids[d]
    return d == tgt, tgt


def block_greedy_stats(target, drafter, seqs, *, features: str = "real", batch: int = 4, width: int = 512,
                       max_anchors: int = 256) -> dict:
    """Teacher-forced greedy statistics of `drafter` on `seqs` [(tokens, mask)], every
    supervised position an anchor (up to `max_anchors` per sequence) whose whole block is
    supervised. Returns per-position acceptance, τ, position-1 accuracy and the teacher
    consistency of the labels."""
    if features not in ("real", "zero", "shuffle"):
        raise ValueError(f"features must be 'real', 'zero' or 'shuffle', got {features!r}")
    G = drafter.cfg.block_size
    tok, msk = _pad(seqs, width)
    match_all, label_ok, n_lab = [], 0, 0
    for i in range(0, len(seqs), batch):
        t, m = tok[i:i + batch], msk[i:i + batch]
        if t.shape[0] < batch:  # one static shape
            t = np.concatenate([t, np.zeros((batch - t.shape[0], width), np.int32)])
            m = np.concatenate([m, np.zeros((batch - m.shape[0], width), np.int32)])
        anchors = np.zeros((batch, max_anchors), np.int32)
        valid = np.zeros((batch, max_anchors), bool)
        for b in range(batch):
            full = [a for a in range(width - G) if m[b, a + 1:a + 1 + G].all()]
            full = full[:max_anchors]
            anchors[b, :len(full)] = full
            valid[b, :len(full)] = True
        match, tgt = _block_matches(target.graphdef, target.state, drafter.graphdef, drafter.state,
                                    jnp.asarray(t), jnp.asarray(anchors), feature_layers=drafter.feature_layers,
                                    features=features)
        match, tgt = np.asarray(match), np.asarray(tgt)
        match_all.append(match[valid])
        # Label consistency: the data's next token at anchor + 1 vs the target's argmax there.
        lab = np.take_along_axis(t, np.clip(anchors + 1, 0, width - 1), 1)
        label_ok += int((lab == tgt[..., 0])[valid].sum())
        n_lab += int(valid.sum())
    mt = np.concatenate(match_all) if match_all else np.zeros((0, G), bool)
    surv = np.cumprod(mt, 1)
    reached = np.concatenate([np.ones((mt.shape[0], 1)), surv[:, :-1]], 1)
    return {
        "blocks": int(mt.shape[0]),
        "tau": float(1.0 + surv.sum(1).mean()) if mt.size else float("nan"),
        "acceptance": (surv.sum(0) / np.maximum(reached.sum(0), 1)).tolist(),
        "first_accuracy": float(mt[:, 0].mean()) if mt.size else float("nan"),
        "teacher_consistency": label_ok / max(n_lab, 1),
    }


def bigram_table(seqs, vocab_size: int) -> np.ndarray:
    """[V] the most frequent supervised next token after each token (−1: never seen)."""
    counts: dict[int, dict[int, int]] = {}
    for t, m in seqs:
        t, m = np.asarray(t), np.asarray(m)
        for i in range(len(t) - 1):
            if m[i + 1]:
                row = counts.setdefault(int(t[i]), {})
                row[int(t[i + 1])] = row.get(int(t[i + 1]), 0) + 1
    best = np.full(vocab_size, -1, np.int64)
    for a, row in counts.items():
        best[a] = max(row.items(), key=lambda kv: (kv[1], -kv[0]))[0]
    return best


def bigram_accuracy(table: np.ndarray, seqs) -> float:
    """Position-1 accuracy of the bigram baseline on the supervised positions of `seqs`."""
    hit = n = 0
    for t, m in seqs:
        t, m = np.asarray(t), np.asarray(m)
        sup = np.nonzero(m[1:] > 0)[0]
        hit += int((table[t[sup]] == t[sup + 1]).sum())
        n += sup.size
    return hit / max(n, 1)
