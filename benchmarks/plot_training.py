"""Learning curves of one or more training runs: teacher-forced τ on the training batches
(greedy: 1 + Σ_k Π_{i≤k} 1[draft argmax = target argmax]; sampled: 1 + Σ_k Π_{i≤k} (1 − TV_i))
and CE against cumulative supervised tokens, from each run's `metrics.jsonl`.

    python -m benchmarks.plot_training --run phase1=runs/smollm2/metrics.jsonl \
        --run phase2=runs/phase2/metrics.jsonl --out benchmarks/results/training_curves.png

Runs are drawn one after the other on the token axis (a warm-started run continues where its
parent stopped) when `--chain` is given.
"""

from __future__ import annotations

import argparse
import json


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, metavar="NAME=METRICS_JSONL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--chain", action="store_true", help="continue each run's token axis where the previous ended")
    ap.add_argument("--smooth", type=int, default=1,
                    help="running mean over this many logged points (small batches log noisy per-step values)")
    args = ap.parse_args(argv)

    def smooth(ys):
        k = max(1, args.smooth)
        return [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0.0
    for item in args.run:
        name, path = item.split("=", 1)
        recs = load(path)
        # `supervised` is per step; the log holds every `log_every`-th step: scale by the gap.
        toks, total, prev = [], offset, 0
        for r in recs:
            total += r["supervised"] * (r["step"] - prev)
            prev = r["step"]
            toks.append(total / 1e6)
        if args.chain:
            offset = total
        axes[0].plot(toks, smooth([r.get("greedy_tau", float("nan")) for r in recs]), label=f"{name}: greedy τ")
        axes[0].plot(toks, smooth([r["expected_tau"] for r in recs]), "--", label=f"{name}: sampled τ (1 − TV)")
        axes[1].plot(toks, smooth([r["ce"] for r in recs]), label=name)
    axes[0].set_xlabel("supervised tokens (M)")
    axes[0].set_ylabel("teacher-forced τ on training batches (γ = 7)"
                       + (f", mean of {args.smooth} logs" if args.smooth > 1 else ""))
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("supervised tokens (M)")
    axes[1].set_ylabel("CE (nats)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
