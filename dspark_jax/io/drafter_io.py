"""Drafter checkpoints: our export format and DeepSpec (PyTorch) DSpark / DFlash directories.

Our format: a directory with `config.json` (`"format": "dspark_jax.drafter"` plus every
DrafterConfig field, STS temperatures included) and `model.safetensors` holding the
trainable parameters under their flat NNX paths (`layers.0.self_attn.q_proj.kernel`, ...,
kernels stored (in, out)). The embedding and LM head are the target's and are not stored.

DeepSpec: an HF `save_pretrained` of `Qwen3DSparkModel` (DESIGN.md §8). Linear weights are
(out, in) and get transposed; the mask embedding is the row `mask_token_id` of the
(frozen, target-equal) token embedding.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.drafting import Drafter
from dspark_jax.models.drafter import TargetCopy, abstract_drafter
from dspark_jax.models.drafter_config import DrafterConfig

FORMAT = "dspark_jax.drafter"
FORMAT_VERSION = 1
_DEEPSPEC_HEAD = {"vanilla": "markov", "markov": "markov", "gated": "gated", "rnn": "rnn"}


def _flat_name(path) -> str:
    return ".".join(str(p) for p in path)


def _fill(cfg: DrafterConfig, tensors: dict[str, np.ndarray], source: str) -> Drafter:
    """Builds a Drafter from {our flat name: array}; every tensor must be used exactly once."""
    graphdef, abstract = abstract_drafter(cfg)
    flat = nnx.to_flat_state(abstract)
    missing, out = [], []
    for path, var in flat:
        name = _flat_name(path)
        if isinstance(var, TargetCopy):  # runtime copy of target weights: filled by Drafter.bind
            out.append((path, var.replace(jnp.zeros(var.get_value().shape, var.get_value().dtype))))
            continue
        if name not in tensors:
            missing.append(name)
            continue
        a = np.asarray(tensors[name])
        if a.shape != var.get_value().shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {a.shape}, expected {var.get_value().shape}")
        out.append((path, var.replace(jnp.asarray(a, dtype=var.get_value().dtype))))
    extra = sorted(set(tensors) - {_flat_name(p) for p, v in flat if not isinstance(v, TargetCopy)})
    if missing or extra:
        raise ValueError(
            f"{source} does not match the drafter config: "
            + (f"missing tensors {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected tensors {extra}" if extra else "")
        )
    return Drafter(cfg, graphdef, nnx.from_flat_state(out))


def _config_to_json(cfg: DrafterConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = [list(kv) for kv in cfg.rope_scaling] if cfg.rope_scaling else None
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **d}


def _config_from_json(d: dict) -> DrafterConfig:
    d = {k: v for k, v in d.items() if k not in ("format", "format_version")}
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"drafter config.json has unknown fields {unknown}")
    for k in ("target_layer_ids", "sts_temperatures"):
        if k in d:
            d[k] = tuple(d[k])
    if d.get("rope_scaling"):
        d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
    return DrafterConfig(**d)


def save_drafter(drafter: Drafter, path: str, dtype: str | None = None) -> None:
    """Writes our format (config.json + model.safetensors) into directory `path`.

    `dtype` ("bfloat16", "float16", "float32") casts the floating-point tensors for storage
    (loading casts back to the config's dtype); None keeps them as they are.
    """
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {_flat_name(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(drafter.state)
               if not isinstance(v, TargetCopy)}
    if dtype is not None:
        dt = jnp.dtype(dtype)
        tensors = {k: np.asarray(jnp.asarray(a).astype(dt)) if np.issubdtype(a.dtype, np.floating)
                   or a.dtype == jnp.bfloat16 else a for k, a in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_config_to_json(drafter.cfg), f, indent=2)


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path!r}")
    out = {}
    for fn in files:
        out.update(load_file(os.path.join(path, fn)))
    return out


def deepspec_config(hf: dict) -> DrafterConfig:
    """DrafterConfig from a DeepSpec `config.json` (the target's config, amended)."""
    try:
        rank = int(hf.get("markov_rank", 0))
        head = "none" if rank == 0 else _DEEPSPEC_HEAD.get(str(hf.get("markov_head_type", "vanilla")).lower())
        if head is None:
            raise ValueError(f"unsupported markov_head_type {hf.get('markov_head_type')!r}")
        if hf.get("attention_bias"):
            raise ValueError("draft layers with attention_bias=true are not supported")
        n_heads = hf["num_attention_heads"]
        rope = hf.get("rope_scaling")
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            rope = tuple(sorted({**rope, "rope_type": rope.get("rope_type", rope.get("type"))}.items()))
        else:
            rope = None
        return DrafterConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads", n_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"], num_target_layers=hf["num_target_layers"],
            rope_theta=float(hf.get("rope_theta", 10000.0)), rope_scaling=rope,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), block_size=int(hf["block_size"]),
            num_layers=hf["num_hidden_layers"], target_layer_ids=tuple(hf["target_layer_ids"]),
            markov_rank=rank, head_type=head,
            confidence_head=bool(hf.get("enable_confidence_head", False)),
            confidence_with_markov=bool(hf.get("confidence_head_with_markov", False)),
        )
    except KeyError as e:
        raise ValueError(f"DeepSpec config.json lacks the field {e.args[0]!r}") from e


def deepspec_tensors(cfg: DrafterConfig, sd: dict[str, np.ndarray], mask_token_id: int,
                     target_embed: np.ndarray | None = None, target_lm_head: np.ndarray | None = None
                     ) -> dict[str, np.ndarray]:
    """DeepSpec state dict → our flat names. Consumes every tensor or raises listing leftovers."""
    sd = dict(sd)
    out = {}

    def take(name):
        if name not in sd:
            raise ValueError(f"DeepSpec checkpoint is missing tensor {name!r}")
        return np.asarray(sd.pop(name), np.float32)

    out["fc.kernel"] = take("fc.weight").T
    for n in ("hidden_norm", "norm"):
        out[f"{n}.weight"] = take(f"{n}.weight")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{proj}.kernel"] = take(p + f"self_attn.{proj}.weight").T
        for nrm in ("q_norm", "k_norm"):
            out[p + f"self_attn.{nrm}.weight"] = take(p + f"self_attn.{nrm}.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{proj}.kernel"] = take(p + f"mlp.{proj}.weight").T
        for nrm in ("input_layernorm", "post_attention_layernorm"):
            out[p + f"{nrm}.weight"] = take(p + f"{nrm}.weight")
    if cfg.rank:
        out["head.w1"] = take("markov_head.markov_w1.weight")
        out["head.w2"] = take("markov_head.markov_w2.weight").T
        if cfg.head_type in ("gated", "rnn"):
            name = "gate_proj" if cfg.head_type == "gated" else "joint_proj"
            out[f"head.{name}.kernel"] = take(f"markov_head.{name}.weight").T
            out[f"head.{name}.bias"] = take(f"markov_head.{name}.bias")
    if cfg.confidence_head:
        out["confidence.proj.kernel"] = take("confidence_head.proj.weight").T
        out["confidence.proj.bias"] = take("confidence_head.proj.bias")
    # The frozen embedding / LM head copies: must equal the target's when we can check.
    emb = sd.pop("embed_tokens.weight", None)
    lm = sd.pop("lm_head.weight", None)
    # The mask row is the one row we take from the checkpoint, so it is not compared.
    keep = np.arange(cfg.vocab_size) != mask_token_id
    for name, t, ref in (("embed_tokens.weight", emb, target_embed), ("lm_head.weight", lm, target_lm_head)):
        if t is not None and ref is not None:
            if t.shape != ref.shape or not np.allclose(t[keep], ref[keep], atol=1e-3):
                raise ValueError(f"DeepSpec {name} differs from the target's: is this drafter for this target?")
    table = emb if emb is not None else target_embed
    if table is None:
        raise ValueError("the DeepSpec checkpoint has no embed_tokens.weight; pass target= to load it")
    if not 0 <= mask_token_id < table.shape[0]:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the embedding ({table.shape[0]} rows)")
    out["mask_embedding"] = np.asarray(table[mask_token_id], np.float32)
    leftover = sorted(k for k in sd if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ValueError(f"DeepSpec checkpoint has tensors this drafter config does not use: {leftover}")
    return out


def load_drafter(path: str, target=None) -> Drafter:
    """Loads our export or a DeepSpec DSpark/DFlash checkpoint directory.

    With `target` given, checks that the drafter fits it (hidden size, vocab, depth, and for
    DeepSpec checkpoints that the stored embedding equals the target's).
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no drafter directory at {path!r}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json; is it a drafter directory?")
    with open(cfg_path) as f:
        d = json.load(f)
    if d.get("format") == FORMAT:
        if d.get("format_version", 1) > FORMAT_VERSION:
            raise ValueError(f"drafter format version {d['format_version']} is newer than this library")
        cfg = _config_from_json(d)
        if target is not None:
            cfg.check_compatible(target.cfg)
        drafter = _fill(cfg, _read_safetensors(path), f"drafter checkpoint {path!r}")
        return drafter.bind(target) if target is not None else drafter
    if "block_size" in d and "target_layer_ids" in d:
        cfg = deepspec_config(d)
        if target is not None:
            cfg = cfg.replace(dtype=target.cfg.dtype)
            cfg.check_compatible(target.cfg)
        embed = lm = None
        if target is not None:
            embed = np.asarray(target.state["embed_tokens"].get_value())
            lm = np.asarray(target.module().lm_head_matrix()).T  # (V, D) like torch's lm_head.weight
        tensors = deepspec_tensors(cfg, _read_safetensors(path), int(d.get("mask_token_id", -1)), embed, lm)
        return _fill(cfg, tensors, f"DeepSpec checkpoint {path!r}")
    raise ValueError(
        f"{cfg_path!r} is neither a dspark_jax drafter export nor a DeepSpec DSpark/DFlash config "
        "(expected 'format': 'dspark_jax.drafter', or 'block_size' and 'target_layer_ids')"
    )
