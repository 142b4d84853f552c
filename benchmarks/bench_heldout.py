"""Drafters side by side on held-out training-style data, teacher-forced (offline, T = 0).

    python -m benchmarks.bench_heldout --data train/data/smollm2-135m-greedy.npz \
        [--drafter smollm2-135m-dspark] [--extra new=runs/v4/export ...] [--sequences 32]

For every supervised position of the held-out split (the target's own greedy answers to
prompts no phase trained on), each drafter drafts its block from the real target features;
the table gives the offline greedy τ (1 + Σ_k Π_{i≤k} match_i), per-position acceptance,
position-1 accuracy, the same with the target's features zeroed (context ablation), and a
count-based bigram baseline (counted on the train split). Offline τ tracks the τ `generate()`
measures at T = 0 on the same text (the gates module; train ↔ inference agreement).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import dspark_jax as ds
from benchmarks.common import hardware, machine_load, table
from dspark_jax.training import gates, records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="a packed data file (python -m train.tokens pack) or a workdir")
    ap.add_argument("--drafter", default="smollm2-135m-dspark")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=DIR", help="another drafter (repeatable)")
    ap.add_argument("--sequences", type=int, default=32, help="held-out sequences")
    ap.add_argument("--no-ablation", action="store_true", help="skip the zeroed-features rows")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if os.path.isfile(args.data):
            dirs = {s: os.path.join(tmp, s) for s in ("train", "heldout")}
            records.unpack(args.data, dirs)
        else:
            dirs = {s: os.path.join(args.data, "data", s) for s in ("train", "heldout")}
        held = records.read_all(dirs["heldout"])[: args.sequences]
        train = records.read_all(dirs["train"])
    target = ds.load_target(args.target)
    drafters = {"shipped": ds.load_drafter(args.drafter, target)}
    for item in args.extra:
        name, path = item.split("=", 1)
        drafters[name] = ds.load_drafter(path, target)
    print(f"# {hardware()}; {machine_load()} at start")
    bigram = gates.bigram_accuracy(gates.bigram_table(train, target.cfg.vocab_size), held)
    rows = []
    for name, d in drafters.items():
        modes = ("real",) if args.no_ablation else ("real", "zero")
        for mode in modes:
            r = gates.block_greedy_stats(target, d, held, features=mode)
            rows.append([name, mode, r["blocks"], f"{r['tau']:.2f}", f"{r['first_accuracy']:.3f}",
                         " / ".join(f"{a:.2f}" for a in r["acceptance"]), f"{r['teacher_consistency']:.3f}"])
    print(f"\n## Held-out, teacher-forced greedy ({len(held)} sequences; bigram position-1 accuracy "
          f"{bigram:.3f}, counted on {len(train)} training sequences)\n")
    print(table(["drafter", "features", "blocks", "offline τ", "position-1 acc.", "acceptance per position",
                 "teacher consistency"], rows))
    print(f"\n{machine_load()} at end")


if __name__ == "__main__":
    main()
