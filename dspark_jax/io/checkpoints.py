"""Reading target weights: HF safetensors directories (sharded or not) and GGUF files.

Both readers present tensors under HF names (`model.layers.3.self_attn.q_proj.weight`,
(out, in) layout), so one function (`fill_target_state`) maps them onto our parameters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

# HF tensors we know and deliberately do not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsSource:
    """All `*.safetensors` of an HF directory (follows `model.safetensors.index.json` if present)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path!r}")
        self._where = {}
        self._handles = []
        for fn in files:
            fp = os.path.join(path, fn)
            if not os.path.exists(fp):
                raise FileNotFoundError(f"{fp!r} is listed in the safetensors index but missing")
            h = safe_open(fp, framework="numpy")
            self._handles.append(h)
            for k in h.keys():
                self._where[k] = h

    def keys(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get_tensor(name)


def _hf_name(path: tuple) -> tuple[str, bool]:
    """Our flat state path → (HF tensor name, transpose?)."""
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight", False
    if path == ("lm_head",):
        return "lm_head.weight", True
    parts = [str(p) for p in path]
    transpose = parts[-1] == "kernel"
    if parts[-1] == "kernel":
        parts[-1] = "weight"
    return "model." + ".".join(parts), transpose


def fill_target_state(abstract_state: nnx.State, get: Callable[[str], np.ndarray],
                      available: set[str], num_layers: int, scan_layers: bool
                      ) -> tuple[nnx.State, set[str]]:
    """Replaces every abstract leaf with the checkpoint tensor; raises listing anything missing."""
    flat = nnx.to_flat_state(abstract_state)
    used, missing, out = set(), [], []
    for path, var in flat:
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if scan_layers and path[0] == "layers":
            names = [_hf_name(("layers", i) + tuple(path[1:])) for i in range(num_layers)]
        else:
            names = [_hf_name(path)]
        arrays = []
        for name, transpose in names:
            if name not in available:
                missing.append(name)
                continue
            a = get(name)
            arrays.append(a.T if transpose else a)
            used.add(name)
        if missing:
            continue
        a = np.stack(arrays) if len(names) > 1 else arrays[0]
        if a.shape != shape:
            raise ValueError(f"checkpoint tensor {names[0][0]!r} has shape {a.shape}, expected {shape}")
        out.append((path, var.replace(jnp.asarray(a, dtype=dtype))))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    return nnx.from_flat_state(out), used


def unused_tensors(available: set[str], used: set[str], tied: bool) -> list[str]:
    """Checkpoint tensors the model did not consume (a tied model may still ship lm_head)."""
    skip = {"lm_head.weight"} if tied else set()
    return sorted(k for k in available - used - skip if not k.endswith(_IGNORED_SUFFIXES))
