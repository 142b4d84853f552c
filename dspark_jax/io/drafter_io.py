"""Drafter checkpoints: our export format and DeepSpec (PyTorch) DSpark / DFlash directories.

Our format: a directory with `config.json` (`"format": "dspark_jax.drafter"` plus every
DrafterConfig field, STS temperatures included) and `model.safetensors` holding the
trainable parameters under their flat NNX paths (`layers.0.self_attn.q_proj.kernel`, ...,
kernels stored (in, out)). The embedding and LM head are the target's and are not stored.

DeepSpec: an HF `save_pretrained` of `Qwen3DSparkModel` (docs/checkpoints.md). Linear weights are
(out, in) and get transposed; the mask embedding is the row `mask_token_id` of the
(frozen, target-equal) token embedding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import ModelConfig, hf_rope
from dspark_jax.io.json_fields import Fields, read_json_object
from dspark_jax.models.drafter import TargetCopy, abstract_drafter
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import Drafter

FORMAT = "dspark_jax.drafter"
FORMAT_VERSION = 1
_DEEPSPEC_HEAD = {"vanilla": "markov", "markov": "markov", "gated": "gated", "rnn": "rnn"}


def flat_name(path) -> str:
    return ".".join(str(p) for p in path)


def _fill(cfg: DrafterConfig, tensors: dict[str, np.ndarray], source: str) -> Drafter:
    """Builds a Drafter from {our flat name: array}; every tensor must be used exactly once."""
    graphdef, abstract = abstract_drafter(cfg)
    flat = nnx.to_flat_state(abstract)
    missing, out = [], []
    for path, var in flat:
        name = flat_name(path)
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
    extra = sorted(set(tensors) - {flat_name(p) for p, v in flat if not isinstance(v, TargetCopy)})
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


# Our format: (field, kind, required). Export writes every field; the few optional ones have
# defaults that are right for a hand-written config (no STS calibration, fp32, training λ).
_OUR_FIELDS = (
    ("vocab_size", "int", True), ("hidden_size", "int", True), ("num_heads", "int", True),
    ("num_kv_heads", "int", True), ("head_dim", "int", True), ("intermediate_size", "int", True),
    ("num_target_layers", "int", True), ("rope_theta", "float", True), ("rope_scaling", "pairs", False),
    ("rms_norm_eps", "float", True), ("block_size", "int", True), ("num_layers", "int", True),
    ("target_layer_ids", "int_list", True), ("markov_rank", "int", True), ("head_type", "str", True),
    ("confidence_head", "bool", True), ("confidence_with_markov", "bool", True),
    ("loss_decay", "float", False), ("sts_temperatures", "float_list", False),
    ("sts_temperatures_greedy", "float_list", False), ("acceptance_prior", "float_list", False),
    ("acceptance_prior_greedy", "float_list", False),
    ("draft_vocab_size", "int", False), ("draft_topk", "int", False), ("dtype", "str", False),
)


def _rope_pairs(f: Fields, name: str):
    v = f.d.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or any(not isinstance(kv, list) or len(kv) != 2 or not isinstance(kv[0], str)
                                      for kv in v):
        raise ValueError(f"{f.source}: field {name!r} must be null or a list of [key, value] pairs, got {v!r}")
    return tuple(sorted(tuple(kv) for kv in v))


def _config_from_json(d: dict, source: str = "drafter config.json") -> DrafterConfig:
    d = {k: v for k, v in d.items() if k not in ("format", "format_version")}
    known = {name for name, _, _ in _OUR_FIELDS}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{source} has unknown fields {unknown}; known fields: {sorted(known)}")
    f = Fields(d, source)
    kw = {}
    for name, kind, required in _OUR_FIELDS:
        if kind == "pairs":
            kw[name] = _rope_pairs(f, name)
        elif required or name in f:
            kw[name] = getattr(f, kind)(name)
    try:
        return DrafterConfig(**kw)
    except ValueError as e:  # range checks of DrafterConfig: they name the field
        raise ValueError(f"{source}: {e}") from e


def save_drafter(drafter: Drafter, path: str, dtype: str | None = None) -> None:
    """Writes our format (config.json + model.safetensors) into directory `path`.

    `dtype` ("bfloat16", "float16", "float32") casts the floating-point tensors for storage
    (loading casts back to the config's dtype); None keeps them as they are.
    """
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {flat_name(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(drafter.state)
               if not isinstance(v, TargetCopy)}
    if dtype is not None:
        dt = jnp.dtype(dtype)
        tensors = {k: np.asarray(jnp.asarray(a).astype(dt)) if np.issubdtype(a.dtype, np.floating)
                   or a.dtype == jnp.bfloat16 else a for k, a in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_config_to_json(drafter.cfg), f, indent=2)


def read_drafter_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path!r}")
    out = {}
    for fn in files:
        out.update(load_file(os.path.join(path, fn)))
    return out


def _deepspec_fields(hf: dict, source: str) -> dict:
    """Typed reads of a DeepSpec config.json; fields it may leave to the target come back None.

    Structural switches (markov_rank, head type, confidence head) keep DeepSpec's defaults:
    a wrong one cannot load silently, because every tensor must then match exactly.
    """
    f = Fields(hf, source)
    rank = f.int("markov_rank", 0, minimum=0)
    head_name = f.str("markov_head_type", "vanilla")
    head = "none" if rank == 0 else _DEEPSPEC_HEAD.get(head_name.lower())
    if head is None:
        raise ValueError(f"{source}: unsupported markov_head_type {head_name!r}; supported: {sorted(_DEEPSPEC_HEAD)}")
    if f.bool("attention_bias", False):
        raise ValueError(f"{source}: draft layers with attention_bias=true are not supported")
    theta, scaling = hf_rope(hf, source)
    has_rope_spec = "rope_scaling" in f or "rope_parameters" in f
    return dict(
        vocab_size=f.int("vocab_size", minimum=1), hidden_size=f.int("hidden_size", minimum=1),
        num_heads=f.int("num_attention_heads", minimum=1),
        num_kv_heads=f.int("num_key_value_heads", None, minimum=1),
        head_dim=f.int("head_dim", None, minimum=1),
        intermediate_size=f.int("intermediate_size", minimum=1),
        num_target_layers=f.int("num_target_layers", minimum=1),
        rope_theta=theta, rope_scaling=scaling if has_rope_spec else None,
        rms_norm_eps=f.float("rms_norm_eps", None), block_size=f.int("block_size"),
        num_layers=f.int("num_hidden_layers"), target_layer_ids=f.int_list("target_layer_ids"),
        markov_rank=rank, head_type=head,
        confidence_head=f.bool("enable_confidence_head", False),
        confidence_with_markov=f.bool("confidence_head_with_markov", False),
        mask_token_id=f.int("mask_token_id", minimum=0),
        _has_rope_spec=has_rope_spec,
    )


# Fields a DeepSpec config may omit, taken from the target instead: (our name, config.json name).
_FROM_TARGET = (("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                ("rms_norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta (or rope_parameters.rope_theta)"))


def deepspec_config(hf: dict, target: ModelConfig | None = None, source: str = "DeepSpec config.json"
                    ) -> DrafterConfig:
    """DrafterConfig from a DeepSpec `config.json` (the target's config, amended).

    Nothing that changes the numerics gets a silent default: a field the file omits is
    taken from `target` (the file is a copy of the target's config, so that is what the
    trainer used), and without a target the load fails naming the field.
    """
    kw = _deepspec_fields(hf, source)
    kw.pop("mask_token_id")
    has_rope_spec = kw.pop("_has_rope_spec")
    for ours, theirs in _FROM_TARGET:
        if kw[ours] is None:
            if target is None:
                raise ValueError(f"{source} lacks the field {theirs!r}; load it with target= so the "
                                 "target's value is used, or add the field")
            kw[ours] = getattr(target, ours)
    if target is not None:
        kw["dtype"] = target.dtype
        if not has_rope_spec:
            kw["rope_scaling"] = target.rope_scaling
    try:
        return DrafterConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def check_rope_matches(cfg: DrafterConfig, target: ModelConfig, source: str) -> None:
    """The drafter reads the target's features at the target's positions: same RoPE or fail."""
    same_theta = math.isclose(cfg.rope_theta, target.rope_theta, rel_tol=1e-9)
    if not same_theta or (cfg.rope_scaling or None) != (target.rope_scaling or None):
        raise ValueError(
            f"{source}: the drafter's RoPE (rope_theta={cfg.rope_theta:g}, rope_scaling={cfg.rope_scaling}) "
            f"differs from the target's (rope_theta={target.rope_theta:g}, rope_scaling={target.rope_scaling}); "
            "is this drafter for this target?"
        )


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


def _looks_like_deepspec(d: dict) -> bool:
    archs = d.get("architectures")
    archs = archs if isinstance(archs, list) else []
    named = any(isinstance(a, str) and ("DSpark" in a or "DFlash" in a) for a in archs)
    return named or "block_size" in d or "target_layer_ids" in d


# Drafters that ship inside the package (dspark_jax/drafters/NAME), loadable by name.
SHIPPED_DRAFTERS = {"smollm2-135m-dspark": "smollm2-135m"}  # name → the target it was trained for


def shipped_drafter_path(name: str) -> str:
    """The directory of a drafter shipped with the package."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters", name)


def resolve_drafter_path(path: str) -> str:
    """A drafter directory, or the name of a shipped drafter (an existing directory wins)."""
    if path in SHIPPED_DRAFTERS and not os.path.isdir(path):
        p = shipped_drafter_path(path)
        if not os.path.isdir(p):
            raise FileNotFoundError(f"the shipped drafter {path!r} is missing from this installation ({p})")
        return p
    return path


def inspect_drafter(path: str) -> tuple[str, dict]:
    """Checks a drafter directory without loading weights: ("ours" | "deepspec", config dict).

    Cheap (reads config.json only), so a CLI can call it before the multi-second target load.
    `path` may also name a shipped drafter (`SHIPPED_DRAFTERS`).
    """
    path = resolve_drafter_path(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no drafter directory at {path!r}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json; is it a drafter directory?")
    d = read_json_object(cfg_path, "drafter config")
    if d.get("format") == FORMAT:
        version = Fields(d, cfg_path).int("format_version", 1)
        if version > FORMAT_VERSION:
            raise ValueError(f"{cfg_path!r}: drafter format version {version} is newer than this library "
                             f"(reads version {FORMAT_VERSION}); upgrade dspark_jax")
        _config_from_json(d, cfg_path)
        kind = "ours"
    elif _looks_like_deepspec(d):
        _deepspec_fields(d, cfg_path)
        kind = "deepspec"
    else:
        raise ValueError(
            f"{cfg_path!r} is neither a dspark_jax drafter export nor a DeepSpec DSpark/DFlash config "
            "(expected 'format': 'dspark_jax.drafter', or a DSpark/DFlash architecture with 'block_size' "
            "and 'target_layer_ids')"
        )
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise FileNotFoundError(f"no .safetensors file in {path!r}")
    return kind, d


def load_drafter(path: str, target=None) -> Drafter:
    """Loads our export or a DeepSpec DSpark/DFlash checkpoint directory, or a shipped drafter
    by name (`"smollm2-135m-dspark"`); `"ngram"` is prompt lookup (`NgramDrafter`, no weights), and
    `"<drafter>+ngram"` the hybrid of both (`HybridDrafter`: lookup where the context repeats).

    With `target` given, checks that the drafter fits it (hidden size, vocab, depth, RoPE,
    and for DeepSpec checkpoints that the stored embedding equals the target's). A DeepSpec
    config that omits a numeric field (e.g. RoPE θ) needs `target` to supply it.
    """
    if path == "ngram":
        from dspark_jax.models.ngram import NgramDrafter

        return NgramDrafter().bind(target) if target is not None else NgramDrafter()
    if path.endswith("+ngram"):
        from dspark_jax.models.ngram import HybridDrafter, NgramDrafter

        base = load_drafter(path[: -len("+ngram")], target)
        hyb = HybridDrafter(base, NgramDrafter(block_size=base.block_size))
        return hyb.bind(target) if target is not None else hyb
    path = resolve_drafter_path(path)
    kind, d = inspect_drafter(path)
    source = os.path.join(path, "config.json")
    if kind == "ours":
        cfg = _config_from_json(d, source)
        if target is not None:
            cfg.check_compatible(target.cfg)
            check_rope_matches(cfg, target.cfg, source)
        drafter = _fill(cfg, read_drafter_tensors(path), f"drafter checkpoint {path!r}")
        return drafter.bind(target) if target is not None else drafter
    cfg = deepspec_config(d, target.cfg if target is not None else None, source)
    embed = lm = None
    if target is not None:
        cfg.check_compatible(target.cfg)
        check_rope_matches(cfg, target.cfg, source)
        embed = np.asarray(target.state["embed_tokens"].get_value())
        lm = np.asarray(target.module().lm_head_matrix()).T  # (V, D) like torch's lm_head.weight
    tensors = deepspec_tensors(cfg, read_drafter_tensors(path), d["mask_token_id"], embed, lm)
    return _fill(cfg, tensors, f"DeepSpec checkpoint {path!r}")
