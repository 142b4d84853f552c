"""A workdir's training data as one compact, committable file, and back.

    python -m train.tokens pack WORKDIR FILE.npz     # data/train + data/heldout → FILE.npz
    python -m train.tokens unpack FILE.npz [MORE.npz ...] WORKDIR
                                                     # → WORKDIR/data/{train,heldout} + token counts
    python -m train.tokens unpack NEW.npz OLD.npz@800 WORKDIR
                                                     # OLD's train sequences: 800, evenly spaced
    python -m train.tokens vocab FILE.npz [MORE.npz ...] WORKDIR/draft_ids.npy [--size 8192]
                                                     # a draft vocabulary over archives' answers

Regeneration is the slow part of the data stage (the target answers every prompt); what it
produces is ~2 bytes a token. Packing lets a run on another machine, or a later session,
start at the train stage with exactly the same shards, instead of regenerating them.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from dspark_jax.training import records

SPLITS = ("train", "heldout")


def _dirs(workdir: str) -> dict[str, str]:
    return {s: os.path.join(workdir, "data", s) for s in SPLITS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.tokens", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="WORKDIR's data shards → one .npz")
    p.add_argument("workdir")
    p.add_argument("file")
    u = sub.add_parser("unpack", help="packed .npz files → WORKDIR's data shards and token counts")
    u.add_argument("paths", nargs="+", metavar="FILE.npz ... WORKDIR",
                   help="one or more archives, then the workdir; the shards of the second and later "
                        "archives are named after the archive (ARCHIVE-shard-…); ARCHIVE.npz@N keeps N of "
                        "its train sequences, evenly spaced (a replay sample of older data)")
    u.add_argument("--vocab-size", type=int, default=0,
                   help="the target's vocabulary size for data/token_counts.npy (default: the one stored by pack)")
    v = sub.add_parser("vocab", help="the most frequent answer tokens of archives → a draft_ids.npy")
    v.add_argument("paths", nargs="+", metavar="FILE.npz ... OUT.npy",
                   help="one or more archives (their train sequences' answers are counted), then the output; "
                        "put it in a workdir as draft_ids.npy before its train stage to use it")
    v.add_argument("--size", type=int, default=8192, help="draft vocabulary size (the config's draft_vocab_size)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "vocab":
            if len(a.paths) < 2 or not a.paths[-1].endswith(".npy"):
                ap.error("vocab needs at least one archive and then the output .npy path")
            for f in a.paths[:-1]:
                if not os.path.isfile(f):
                    raise FileNotFoundError(f"no packed data at {f!r}")
            counts = [records.archive_token_counts(f) for f in a.paths[:-1]]
            size = max(c.size for c in counts)
            total = sum(np.pad(c, (0, size - c.size)) for c in counts)
            ids = records.draft_vocabulary(total, a.size)
            np.save(a.paths[-1], ids)
            cover = total[ids].sum() / max(int(total.sum()), 1)
            print(f"{a.paths[-1]}: {ids.size} draft tokens covering {cover:.4f} of {int(total.sum())} answer tokens "
                  f"in {len(counts)} archives", file=sys.stderr)
        elif a.cmd == "pack":
            dirs = {s: d for s, d in _dirs(a.workdir).items() if records.shard_paths(d)}
            counts = os.path.join(a.workdir, "data", "token_counts.npy")
            vocab = int(np.load(counts).size) if os.path.exists(counts) else 0
            got = records.pack(dirs, a.file, vocab_size=vocab)
            print(f"packed {got['sequences']} sequences ({got['tokens']} tokens, {got['shards']} shards) "
                  f"into {a.file} ({os.path.getsize(a.file) / 1e6:.1f} MB)", file=sys.stderr)
        else:
            if len(a.paths) < 2:
                ap.error("unpack needs at least one archive and the workdir")
            workdir = a.paths[-1]
            files, samples = [], []
            for spec in a.paths[:-1]:
                f, at, n = spec.rpartition("@") if "@" in spec else (spec, "", "0")
                if at and not (n.isdigit() and int(n) > 0):
                    raise ValueError(f"{spec!r}: after '@' give the number of train sequences to keep (> 0)")
                files.append(f)
                samples.append(int(n))
            for f in files:
                if not os.path.isfile(f):
                    raise FileNotFoundError(f"no packed data at {f!r}")
            stems = [os.path.splitext(os.path.basename(f))[0] for f in files]
            if len(set(stems)) != len(stems):
                raise ValueError(f"archives with the same name would share shard names: {files}")
            stored = []
            for i, f in enumerate(files):
                got = records.unpack(f, _dirs(workdir), prefix="" if i == 0 else stems[i] + "-", sample=samples[i])
                stored.append(got["vocab_size"] or int(np.load(f)["tokens"].max()) + 1)
                print(f"unpacked {got['sequences']} sequences of {f} ({got['shards_written']} shards written)",
                      file=sys.stderr)
            vocab = a.vocab_size or max(stored)
            counts = records.token_counts(_dirs(workdir)["train"], vocab)
            np.save(os.path.join(workdir, "data", "token_counts.npy"), counts)
            print(f"{workdir}/data: {int(counts.sum())} supervised tokens", file=sys.stderr)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
