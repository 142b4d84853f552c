"""Training throughput of the SmolLM2 preset: online (the frozen target runs every step),
from the feature cache (target features computed once), and on a simulated 8-device CPU mesh
(data 2 × fsdp 2 × tensor 2, feature cache) — supervised tokens per second.

Each configuration is a real `python -m train.main --stage train` run of `--steps` steps in a
scratch work directory whose `data/` (and `features/`) link to an existing run's, so all three
train on the same sequences. Throughput is the median over the log intervals after the first
(which holds the compile). The simulated mesh shares this machine's cores between its 8
"devices": it shows that the sharded program runs and what partitioning costs here, not
what 8 chips would do.

    python -m benchmarks.bench_train --from runs/smollm2 [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import machine_load, median, table

CONFIGS = {
    "online (target forward every step)": (dict(feature_cache="False"), {}),
    "feature cache": (dict(feature_cache="True"), {}),
    "feature cache, 8 simulated devices (data 2 × fsdp 2 × tensor 2)": (
        dict(feature_cache="True", mesh_data=2, mesh_fsdp=2, mesh_tensor=2),
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}),
}


def run(src: str, steps: int, sets: dict, env_extra: dict) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory() as wd:
        for name in ("data", "features"):
            p = os.path.abspath(os.path.join(src, name))
            if os.path.exists(p):
                os.symlink(p, os.path.join(wd, name))
        cmd = [sys.executable, "-m", "train.main", "--config", "configs/smollm2_135m.py", "--workdir", wd,
               "--stage", "train", "--set", f"max_steps={steps}", "--set", "log_every=2",
               "--set", "checkpoint_every=100000"]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env={**os.environ, **env_extra}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        with open(os.path.join(wd, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        return [x["supervised_tokens_per_s"] for x in recs[1:]], wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", default="runs/smollm2", help="a run whose data/ (and features/) to use")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    print(f"# before: {machine_load()}")
    rows = []
    for name, (sets, env) in CONFIGS.items():
        tps, wall = run(args.src, args.steps, sets, env)
        rows.append([name, f"{median(tps):.0f} ({min(tps):.0f}–{max(tps):.0f})", f"{wall:.0f}"])
        print(rows[-1], flush=True)
    print(f"# after: {machine_load()}\n")
    print(table(["configuration", "supervised tokens/s, median (min–max)", "wall s (incl. start + compile)"],
                rows))


if __name__ == "__main__":
    main()
