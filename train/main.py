"""The drafter training program.

    python -m train.main --config configs/smollm2_135m.py --workdir runs/smollm2 [--stage all]
        [--set key=value ...]

Stages (each resumable; `all` runs them in order, skipping finished work):
  data       prompts → on-policy answers by the target (ArrayRecord shards) + token counts
  train      draft vocabulary from the counts, then the jitted train step over a grain
             pipeline; orbax checkpoints (train state + data iterator) every N steps, on
             SIGTERM, and at the end; metrics to metrics.jsonl
  calibrate  STS temperatures from real draft-and-verify cycles on the held-out prompts
  export     our inference format (config.json + bf16 model.safetensors) in WORKDIR/export
Not part of `all`:
  prompts    the config's prompts as WORKDIR/prompts.jsonl, for a machine without the
             prompt sources' packages
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

from train.config import TrainConfig

STAGES = ("data", "train", "calibrate", "export")


def load_config(path: str) -> TrainConfig:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config file at {path!r} (presets live in configs/)")
    spec = importlib.util.spec_from_file_location("_train_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "get_config"):
        raise ValueError(f"{path!r} has no get_config()")
    cfg = mod.get_config()
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"{path!r}: get_config() must return a train.config.TrainConfig, got {type(cfg).__name__}")
    return cfg


def check_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, ".write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"work directory {workdir!r} is not writable: {e.strerror}") from e


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.main", description="Train a DSpark drafter for a target model.")
    ap.add_argument("--config", required=True, help="a preset file from configs/ (get_config() → TrainConfig)")
    ap.add_argument("--workdir", required=True, help="directory for data, checkpoints, metrics and the export")
    ap.add_argument("--stage", default="all", choices=STAGES + ("prompts", "all"), help="stage to run (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field (repeatable), e.g. --set num_epochs=2")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config).with_overrides(args.set)
        check_workdir(args.workdir)
        from dspark_jax.training import distributed
        from train import stages

        distributed.initialize()

        with open(os.path.join(args.workdir, "train_config.json"), "w") as f:
            json.dump({k: v for k, v in cfg.__dict__.items()}, f, indent=1)
        todo = STAGES if args.stage == "all" else (args.stage,)
        for name in todo:
            t0 = time.perf_counter()
            print(f"== stage {name}", file=sys.stderr, flush=True)
            getattr(stages, name)(cfg, args.workdir)
            print(f"== stage {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    except (ValueError, FileNotFoundError, PermissionError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
