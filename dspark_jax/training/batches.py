"""Training examples: fixed-length sequences with random anchors, through a grain pipeline.

Shape letters (docs/architecture.md): T sequence length (static), A anchors per sequence, G block size γ.

An anchor at position i starts a block that predicts tokens i+1 .. i+γ. Anchors are drawn
at random (random anchors beat fixed blocks: DFlash's ablation) among the positions whose
first predicted token is supervised, afresh every epoch (the draw is seeded by (seed, epoch,
record index), so a resumed run sees the same anchors). A block's supervision stops at the
sequence end or at the first unsupervised token: `block_mask[a, k]` is the cumulative
product of the loss mask over i+1 .. i+k+1.
"""

from __future__ import annotations

import numpy as np

from dspark_jax.training import records


def make_example(tokens, mask, *, seq_len: int, num_anchors: int, block_size: int, rng: np.random.Generator):
    """One sequence → dict of fixed-shape arrays (tokens [T], anchors [A], block_mask [A, G])."""
    t = np.asarray(tokens, np.int32)[:seq_len]
    m = np.asarray(mask, np.int32)[:seq_len]
    n = t.size
    tok = np.zeros(seq_len, np.int32)
    tok[:n] = t
    sup = np.zeros(seq_len + block_size + 1, np.int32)
    sup[:n] = m
    # Candidate anchors: position i with token i+1 supervised.
    cand = np.nonzero(sup[1:seq_len] > 0)[0]
    A, G = num_anchors, block_size
    anchors = np.zeros(A, np.int32)
    block_mask = np.zeros((A, G), np.float32)
    if cand.size:
        pick = rng.choice(cand, size=min(A, cand.size), replace=False)
        pick.sort()
        anchors[: pick.size] = pick
        idx = pick[:, None] + 1 + np.arange(G)[None]  # predicted positions
        block_mask[: pick.size] = np.cumprod(sup[idx], axis=1)
    return {"tokens": tok, "anchors": anchors, "block_mask": block_mask}


class _ToExample:
    """grain map: (record index, record bytes) → example; anchors seeded by (seed, epoch, index)."""

    def __init__(self, seq_len, num_anchors, block_size, seed, epoch):
        self.kw = dict(seq_len=seq_len, num_anchors=num_anchors, block_size=block_size)
        self.seed, self.epoch = seed, epoch

    def __call__(self, item):
        i, rec = item
        tokens, mask = records.decode(rec)
        rng = np.random.default_rng([self.seed, self.epoch, int(i)])
        ex = make_example(tokens, mask, rng=rng, **self.kw)
        ex["index"] = np.int32(i)
        return ex


def dataset(directory: str, *, batch_size: int, seq_len: int, num_anchors: int, block_size: int,
            seed: int = 0, num_epochs: int = 1):
    """A grain IterDataset of batches over `num_epochs` epochs, each reshuffled and with new
    anchors; its iterator is checkpointable (`get_state` / `set_state`). The last partial
    batch of each epoch is dropped so every batch has one static shape."""
    import grain

    src = records.data_source(directory)
    if len(src) < batch_size:
        raise ValueError(f"{directory!r} holds {len(src)} sequences, fewer than one batch of {batch_size}")
    epochs = []
    for e in range(num_epochs):
        ds = grain.MapDataset.range(len(src)).shuffle(seed=seed + e)
        ds = ds.map(lambda i: (i, src[int(i)]))
        ds = ds.map(_ToExample(seq_len, num_anchors, block_size, seed, e))
        epochs.append(ds.batch(batch_size, drop_remainder=True))
    return grain.MapDataset.concatenate(epochs).to_iter_dataset()
