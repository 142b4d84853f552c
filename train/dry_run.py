"""Sizing a training run without weights or devices: `jax.eval_shape` of the target, the
drafter and the AdamW state, laid out by the training sharding rules on a (data, fsdp,
tensor) mesh given as numbers, and the bytes each device holds.

    python -m train.dry_run --config configs/qwen3_8b_tpu.py --mesh 1,16,4
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
from flax import nnx

from dspark_jax.config import PRESETS, ModelConfig
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.target import Target
from dspark_jax.sharding import TRAINING_RULES, logical_to_spec
from dspark_jax.training import train_step as ts
from train.main import load_config
from train.stages import drafter_config


def per_device_bytes(state, mesh: dict[str, int]) -> tuple[int, int]:
    """(total bytes, bytes on one device) of an (abstract) nnx.State under TRAINING_RULES;
    a dimension its mesh axis does not divide stays whole (replicated), as in shard_state."""
    total = per = 0
    for _, var in nnx.to_flat_state(state):
        v = var.get_value()
        nbytes = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        spec = logical_to_spec(var.get_metadata()["axes"], TRAINING_RULES, len(v.shape))
        div = 1
        for i, m in enumerate(spec):
            if m is not None and v.shape[i] % mesh[m] == 0:
                div *= mesh[m]
        total += nbytes
        per += nbytes // div
    return total, per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.dry_run", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor sizes")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    name = cfg.target
    if name not in PRESETS:
        print(f"error: dry runs need a preset target geometry ({sorted(PRESETS)}), got {name!r}", file=sys.stderr)
        return 2
    mesh = dict(zip(("data", "fsdp", "tensor"), (int(x) for x in args.mesh.split(","))))
    tcfg = ModelConfig(**{**PRESETS[name], "dtype": cfg.target_dtype})  # as the stages load it
    _, tstate = Target.abstract(tcfg)

    class _T:  # what drafter_config reads
        pass

    t = _T()
    t.cfg = tcfg
    dcfg = drafter_config(cfg, t).replace(dtype="float32")
    _, params, rest = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(dcfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    tx = ts.OptimConfig().optimizer()
    opt = jax.eval_shape(tx.init, params)
    # AdamW's two moments mirror the parameters (and their shardings).
    rows = [("target (frozen)", *per_device_bytes(tstate, mesh)), ("drafter params", *per_device_bytes(params, mesh))]
    p_tot, p_per = rows[1][1], rows[1][2]
    opt_tot = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt))
    rows.append(("AdamW state", opt_tot, opt_tot * p_per // max(p_tot, 1)))
    n_dev = mesh["data"] * mesh["fsdp"] * mesh["tensor"]
    print(f"{name}: mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']} ({n_dev} devices); "
          f"drafter {dcfg.num_layers} layers, γ={dcfg.block_size}, r={dcfg.rank}, V′={dcfg.proposal_vocab_size}")
    for label, tot, per in rows:
        print(f"  {label:16s} {tot / 2**30:8.2f} GiB total  {per / 2**30:8.3f} GiB per device")
    print(f"  {'sum':16s} {sum(r[1] for r in rows) / 2**30:8.2f} GiB total  "
          f"{sum(r[2] for r in rows) / 2**30:8.3f} GiB per device (activations not included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
