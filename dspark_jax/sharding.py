"""Logical-axis sharding: one rules table per layout, mapping parameter axis names to mesh axes.

Every parameter carries its logical axes in the `axes` metadata (see models/layers.py).
A mesh has named axes (data, fsdp, tensor); a rules table maps each logical name to a mesh
axis (or None = replicated). A parameter whose two axes map to the same mesh axis is a
collision and raises. Stacked (scan_layers) parameters get a leading "layers" axis.

Usage:
    mesh = make_mesh(tensor=2)
    target.state = shard_state(target.state, mesh, SERVING_RULES)
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Training: parameters fully sharded over fsdp, Megatron-style splits over tensor.
TRAINING_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "features": None,  # fc: (features, embed) — embed already takes fsdp
    "rank": None,
    "draft_vocab": None,  # the draft vocabulary's ids: small, read by every step
    "norm": None,
    "layers": None,
}

# Serving: weights replicated across data/fsdp (no per-step all-gathers), split over tensor.
SERVING_RULES: dict[str, str | None] = {**TRAINING_RULES, "embed": None}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    n = data * fsdp * tensor
    if n != len(devices):
        raise ValueError(f"mesh {data}×{fsdp}×{tensor} = {n} devices, but {len(devices)} are available")
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def logical_to_spec(axes: tuple, rules: dict[str, str | None], ndim: int | None = None) -> PartitionSpec:
    """Logical axis names → PartitionSpec; raises on unknown names and on collisions."""
    axes = tuple(axes)
    if ndim is not None and ndim == len(axes) + 1:
        axes = ("layers",) + axes  # stacked by scan_layers
    mesh_axes = []
    for a in axes:
        if a is not None and a not in rules:
            raise ValueError(f"logical axis {a!r} has no sharding rule; known: {sorted(rules)}")
        mesh_axes.append(None if a is None else rules[a])
    used = [m for m in mesh_axes if m is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"sharding rules map two axes of {axes} to the same mesh axis: {mesh_axes}")
    return PartitionSpec(*mesh_axes)


def state_specs(state, rules):
    """A pytree of PartitionSpecs matching `state` (an nnx.State of annotated parameters)."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"parameter {'.'.join(map(str, path))} has no logical axes")
        flat.append((path, var.replace(logical_to_spec(axes, rules, var.get_value().ndim))))
    return nnx.from_flat_state(flat)


def state_shardings(state, mesh: Mesh, rules):
    """NamedShardings for every variable of `state` (concrete or abstract, e.g. from
    `nnx.eval_shape`); a dimension the mesh axis does not divide is replicated instead
    (e.g. 3 KV heads over 2 devices)."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        spec = logical_to_spec(var.get_metadata()["axes"], rules, v.ndim)
        spec = PartitionSpec(*(m if m is None or v.shape[i] % mesh.shape[m] == 0 else None
                               for i, m in enumerate(spec)))
        flat.append((path, var.replace(NamedSharding(mesh, spec))))
    return nnx.from_flat_state(flat)


def shard_state(state, mesh: Mesh, rules):
    """Places every parameter according to `rules` (see `state_shardings`)."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over data × fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
