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


# Compact token archives: a workdir's regenerated data is small (2 bytes a token for vocabularies
# up to 65,536), so it can be committed or copied between machines and unpacked into the same
# shards, byte for byte, instead of regenerated.

def pack(directories: dict[str, str], path: str, vocab_size: int = 0) -> dict:
    """Writes the shards of each `{split: directory}` into one compressed `.npz` at `path`:
    per sequence its tokens and the number of leading unsupervised (prompt) tokens — the loss
    mask of every regenerated or original-answer record is prompt zeros then response ones.
    `vocab_size` (the target's, 0 = unknown) is stored for `unpack` to report."""
    from array_record.python.array_record_module import ArrayRecordReader

    toks, plen, lens, shard_names, shard_sizes, splits = [], [], [], [], [], []
    for split, directory in directories.items():
        for sp in shard_paths(directory):
            r = ArrayRecordReader(sp)
            recs = r.read_all()
            r.close()
            for rec in recs:
                t, m = decode(rec)
                n0 = int((m == 0).sum())
                if not (np.all(m[:n0] == 0) and np.all(m[n0:] == 1)):
                    raise ValueError(f"{sp}: a record's loss mask is not prompt zeros then response ones; "
                                     "it cannot be packed")
                toks.append(t)
                plen.append(n0)
                lens.append(t.size)
            shard_names.append(os.path.basename(sp))
            shard_sizes.append(len(recs))
            splits.append(split)
    if not toks:
        raise FileNotFoundError(f"no shards to pack in {list(directories.values())}")
    flat = np.concatenate(toks)
    dtype = np.uint16 if flat.max() < 2**16 and flat.min() >= 0 else np.int32
    np.savez_compressed(path, tokens=flat.astype(dtype), lengths=np.asarray(lens, np.int32),
                        prompt_lengths=np.asarray(plen, np.int32), shard_names=np.asarray(shard_names),
                        shard_sizes=np.asarray(shard_sizes, np.int32), splits=np.asarray(splits),
                        vocab_size=np.int64(vocab_size))
    return {"sequences": len(lens), "tokens": int(flat.size), "shards": len(shard_names)}


def _load_archive(path: str):
    """(archive, tokens, sequence starts [n + 1], prompt lengths [n]) of a `pack` archive."""
    z = np.load(path)
    tokens, lens, plen = z["tokens"].astype(np.int32), z["lengths"], z["prompt_lengths"]
    if int(lens.sum()) != tokens.size or int(z["shard_sizes"].sum()) != lens.size:
        raise ValueError(f"{path} is inconsistent: its lengths do not add up to its tokens and shards")
    return z, tokens, np.concatenate([[0], np.cumsum(lens)]), plen


def read_archive(path: str):
    """(split, prompt tokens, response tokens) of every sequence a `pack` archive holds, in order."""
    z, tokens, starts, plen = _load_archive(path)
    splits = np.repeat(z["splits"], z["shard_sizes"])
    for i in range(plen.size):
        t = tokens[starts[i]:starts[i + 1]]
        yield str(splits[i]), t[: plen[i]], t[plen[i]:]


def archive_token_counts(path: str, vocab_size: int = 0, split: str = "train") -> np.ndarray:
    """Counts of every token id over the response tokens of an archive's `split` sequences
    (the held-out ones are left out: they measure the drafter and must not shape it)."""
    z, tokens, starts, plen = _load_archive(path)
    stored = int(z["vocab_size"]) if "vocab_size" in z else 0
    size = vocab_size or stored or int(tokens.max()) + 1
    splits = np.repeat(z["splits"], z["shard_sizes"])
    counts = np.zeros(size, np.int64)
    for i in np.flatnonzero(splits == split):
        counts += np.bincount(tokens[starts[i] + plen[i]:starts[i + 1]], minlength=size)[:size]
    return counts


def unpack(path: str, directories: dict[str, str], prefix: str = "", sample: int = 0,
           shard_size: int = 64) -> dict:
    """Recreates the shards `pack` stored, into `{split: directory}`; existing shards are kept
    (so unpacking into a workdir that holds some of them resumes). `prefix` is put before
    every shard name: archives packed from different workdirs share names
    (`shard-00000.array_record`), and a second one unpacked without it would be skipped.

    `sample` > 0 keeps only that many of the archive's train sequences, evenly spaced over its
    stored order (sequence ⌊i·n/sample⌋ for i < sample: deterministic, and spread over every
    source a regeneration run answered in turn) — a replay slice of older data to mix into a
    new phase; they are written as `{prefix}sample{N}-shard-…` shards of `shard_size`, and the
    held-out sequences are kept whole."""
    if sample < 0:
        raise ValueError(f"sample must be >= 0, got {sample}")
    z, tokens, starts, plen = _load_archive(path)
    lens = np.diff(starts)

    def record(i):
        return encode(tokens[starts[i]:starts[i + 1]],
                      np.r_[np.zeros(plen[i], np.int32), np.ones(lens[i] - plen[i], np.int32)])

    groups, seq = [], 0  # (split, shard name, sequence indices)
    for name, size, split in zip(z["shard_names"], z["shard_sizes"], z["splits"]):
        groups.append((str(split), str(name), list(range(seq, seq + int(size)))))
        seq += int(size)
    if sample:
        train = [i for split, _, rows in groups if split == "train" for i in rows]
        if sample > len(train):
            raise ValueError(f"{path} holds {len(train)} train sequences; cannot sample {sample}")
        picked = [train[(i * len(train)) // sample] for i in range(sample)]
        groups = [g for g in groups if g[0] != "train"] + [
            ("train", f"sample{sample}-shard-{k // shard_size:05d}.array_record", picked[k:k + shard_size])
            for k in range(0, sample, shard_size)]
    written, kept = 0, 0
    for split, name, rows in groups:
        if split not in directories:
            raise ValueError(f"{path} holds split {split!r}; give a directory for it (have {sorted(directories)})")
        kept += len(rows)
        out = os.path.join(directories[split], prefix + name)
        if os.path.exists(out):
            continue
        os.makedirs(directories[split], exist_ok=True)
        write_shard(out, [record(i) for i in rows])
        written += 1
    return {"sequences": kept, "shards_written": written,
            "vocab_size": int(z["vocab_size"]) if "vocab_size" in z else 0}
