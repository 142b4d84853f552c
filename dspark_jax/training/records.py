"""On-disk training sequences: ArrayRecord shards that grain reads.

One record is one sequence: int32 token ids followed by int32 loss-mask flags (1 on the
target's response tokens, the only supervised ones), concatenated, so a record decodes
without any schema. Shards are written to a temporary name and renamed, so a killed
writer never leaves a half shard that a reader (or a resumed writer) would trust.
"""

from __future__ import annotations

import glob
import os

import numpy as np


def encode(tokens, mask) -> bytes:
    t = np.asarray(tokens, np.int32)
    m = np.asarray(mask, np.int32)
    if t.shape != m.shape or t.ndim != 1:
        raise ValueError(f"tokens and mask must be 1-D of equal length, got {t.shape} and {m.shape}")
    return np.concatenate([t, m]).tobytes()


def decode(record: bytes) -> tuple[np.ndarray, np.ndarray]:
    a = np.frombuffer(record, np.int32)
    n = a.size // 2
    return a[:n], a[n:]


def write_shard(path: str, records: list[bytes]) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    tmp = path + ".tmp"
    w = ArrayRecordWriter(tmp, "group_size:1")
    for r in records:
        w.write(r)
    w.close()
    os.replace(tmp, path)


def shard_paths(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.array_record")))


def data_source(directory: str):
    """A grain `ArrayRecordDataSource` over every shard in `directory` (raises if none)."""
    import grain

    paths = shard_paths(directory)
    if not paths:
        raise FileNotFoundError(f"no training data (*.array_record shards) in {directory!r}; run the data stage first")
    return grain.sources.ArrayRecordDataSource(paths)


def read_all(directory: str) -> list[tuple[np.ndarray, np.ndarray]]:
    src = data_source(directory)
    return [decode(src[i]) for i in range(len(src))]


def token_counts(directory: str, vocab_size: int) -> np.ndarray:
    """Counts of every token id over the supervised (response) tokens: the draft vocabulary's source."""
    counts = np.zeros(vocab_size, np.int64)
    for t, m in read_all(directory):
        counts += np.bincount(t[m > 0], minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids (ties by id), sorted by id: the draft vocabulary."""
    if not 0 < size <= counts.size:
        raise ValueError(f"draft vocabulary size must be in [1, {counts.size}], got {size}")
    order = np.lexsort((np.arange(counts.size), -counts))
    return np.sort(order[:size]).astype(np.int32)
