"""Multi-device and multi-process plumbing for training.

One code path for 1 device, a simulated CPU mesh and several processes: the train state is
created straight into its shardings (`train_step.init_sharded`), and every process builds
the same global batch from the same seeded pipeline, of which each process's devices take
their own shard (`global_array`). Multi-process runs start with `initialize()`, which calls
`jax.distributed.initialize()` from the environment:

    DSPARK_COORDINATOR=host:port DSPARK_NUM_PROCESSES=2 DSPARK_PROCESS_ID=0 python -m train.main ...

(on CPU, collectives go through gloo).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from dspark_jax.sharding import batch_sharding, make_mesh


def initialize() -> None:
    """`jax.distributed.initialize()` when DSPARK_NUM_PROCESSES > 1; a no-op otherwise."""
    n = int(os.environ.get("DSPARK_NUM_PROCESSES", "1"))
    if n <= 1:
        return
    coord = os.environ.get("DSPARK_COORDINATOR")
    pid = os.environ.get("DSPARK_PROCESS_ID")
    if not coord or pid is None:
        raise ValueError("DSPARK_NUM_PROCESSES > 1 needs DSPARK_COORDINATOR (host:port) and DSPARK_PROCESS_ID")
    # Only affects the CPU backend (and asking for the backend here would start it too early).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coord, num_processes=n, process_id=int(pid))


def training_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1) -> Mesh | None:
    """A (data, fsdp, tensor) mesh over every device; -1 takes what the others leave.
    None on a single device (plain jit, no sharding annotations)."""
    n = jax.device_count()
    if n == 1 and data in (-1, 1) and fsdp == 1 and tensor == 1:
        return None
    fixed = fsdp * tensor * (data if data > 0 else 1)
    if data == -1:
        if n % fixed:
            raise ValueError(f"{n} devices are not divisible by fsdp × tensor = {fixed}")
        data = n // fixed
    return make_mesh(data, fsdp, tensor)


def global_array(x: np.ndarray, mesh: Mesh | None):
    """The same host array on every process → one global array split over data × fsdp."""
    if mesh is None:
        return jax.numpy.asarray(x)
    sh = batch_sharding(mesh)
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if x.shape[0] % n:
        raise ValueError(f"batch of {x.shape[0]} does not split over data × fsdp = {n} devices")
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
