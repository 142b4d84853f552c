"""Prompt lookup's survival by match length, replayed on greedy answers: the data behind
`NgramDrafter`'s confidence prior (`dspark_jax/models/ngram.py: DEFAULT_CONFIDENCE`).

Each record is a prompt and the target's greedy answer: ArrayRecord shards as the training
program writes them (e.g. `runs/smollm2/data/heldout` from `train.main --stage data` with
`regen_temperature=0`), or an archive of them (`.npz`, `records.pack`: the committed
`train/data/smollm2-135m-greedy*.npz`; `--split` picks one of its splits). Greedy decoding
with prompt lookup is replayed exactly: at every cycle the longest suffix match (the anchor
included) proposes up to γ tokens, the longest prefix equal to the greedy answer is accepted,
and accepted + 1 tokens are emitted. Printed:
per match length n, the cycles, P(draft k survives | drafts < k survived) for k = 1..γ
(pooled over k, the number the prior uses, and each k), and τ.

    python -m benchmarks.bench_ngram_prior --data runs/smollm2/data/heldout [--block-size 7]
    python -m benchmarks.bench_ngram_prior --data train/data/smollm2-135m-greedy-5.npz [--limit 1000]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.common import table
from dspark_jax.training import records


def lookup(ctx: list[int], G: int, max_n: int, min_n: int):
    """(proposal, match length): the most recent longest match of the context's suffix."""
    p = len(ctx) - 1
    for n in range(min(max_n, p), min_n - 1, -1):
        suffix = ctx[p - n + 1:]
        for t in range(p - 1, n - 2, -1):
            if ctx[t - n + 1:t + 1] == suffix:
                return ctx[t + 1:t + 1 + G], n
    return [], 0


def answers(path: str, split: str | None = None):
    """(prompt, greedy answer) token lists from ArrayRecord shards or a `records.pack` archive."""
    if path.endswith(".npz"):
        seqs = list(records.read_archive(path))
        if split is not None and split not in {sp for sp, _, _ in seqs}:
            raise ValueError(f"{path} has splits {sorted({sp for sp, _, _ in seqs})}, not {split!r}")
        for sp, prompt, ans in seqs:
            if split is None or sp == split:
                yield prompt.tolist(), ans.tolist()
        return
    for tokens, mask in records.read_all(path):
        tokens, mask = np.asarray(tokens).tolist(), np.asarray(mask)
        start = int(np.argmax(mask > 0)) if mask.any() else len(tokens)
        yield tokens[:start], tokens[start:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a directory of ArrayRecord shards (prompt + greedy answer)")
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--max-ngram", type=int, default=4)
    ap.add_argument("--split", default=None, help="an .npz archive's split (default: all)")
    ap.add_argument("--limit", type=int, default=0, help="the first N records only (0: all)")
    args = ap.parse_args(argv)
    G, J = args.block_size, args.max_ngram
    reached = np.zeros((J + 1, G))
    survived = np.zeros((J + 1, G))
    cycles = np.zeros(J + 1)
    emitted = np.zeros(J + 1)
    for i, (prompt, ans) in enumerate(answers(args.data, args.split)):
        if args.limit and i >= args.limit:
            break
        m = 1
        while m < len(ans):
            cont, n = lookup(prompt + ans[:m], G, J, 1)
            acc = 0
            while acc < min(G, len(cont)) and m + acc < len(ans) and cont[acc] == ans[m + acc]:
                acc += 1
            for k in range(min(len(cont), acc + 1)):
                reached[n, k] += 1
                survived[n, k] += k < acc
            cycles[n] += 1
            emitted[n] += min(acc + 1, len(ans) - m)
            m += acc + 1
    rows = []
    for n in range(J + 1):
        pooled = survived[n].sum() / max(reached[n].sum(), 1)
        per_k = " / ".join(f"{survived[n, k] / reached[n, k]:.2f}" if reached[n, k] else "–" for k in range(G))
        rows.append([n, int(cycles[n]), f"{pooled:.2f}", per_k, f"{emitted[n] / max(cycles[n], 1):.2f}"])
    print(table(["match length", "cycles", "P(survive), pooled", "P(survive) at k = 1 .. γ", "τ"], rows))
    print(f"\noverall τ {emitted.sum() / max(cycles.sum(), 1):.2f} over {int(cycles.sum())} cycles")


if __name__ == "__main__":
    main()
