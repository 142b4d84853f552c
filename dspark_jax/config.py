"""Frozen, hashable model configs.

`ModelConfig` describes a decoder-only target (Llama / Qwen2 / Qwen3 family) and is
passed to jitted functions as a static argument, so it must stay hashable: every field
is a scalar, a string or a tuple.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


ROPE_TYPES = ("default", "linear", "llama3")


def hf_rope(hf: dict[str, Any], source: str = "config.json") -> tuple[float | None, tuple | None]:
    """RoPE settings of an HF config dict: (θ or None when the config names none, scaling).

    transformers ≤ 4 writes a top-level `rope_theta` and an optional `rope_scaling` dict;
    transformers 5 writes one `rope_parameters` dict holding `rope_theta` and `rope_type`
    (plus the scaling keys). Both layouts are read. Scaling comes back as a sorted tuple of
    (key, value) pairs, or None for plain RoPE.
    """
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for name, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"{source}: {name} must be a JSON object, got {v!r}")
    if params and any(isinstance(v, dict) for v in params.values()):
        # transformers 5 nests RoPE per attention type for models that mix them (e.g. Gemma).
        raise ValueError(f"{source}: per-layer-type rope_parameters ({sorted(params)}) are not supported; "
                         "supported families use one RoPE for every layer")
    theta = hf.get("rope_theta")
    if theta is None and params:
        theta = params.get("rope_theta")
    if theta is not None:
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise ValueError(f"{source}: rope_theta must be a positive number, got {theta!r}")
        theta = float(theta)
    spec = scaling or params
    if not spec:
        return theta, None
    spec = {k: v for k, v in spec.items() if k != "rope_theta"}
    rtype = spec.pop("rope_type", spec.pop("type", "default"))
    spec.pop("type", None)
    if rtype not in ROPE_TYPES:
        raise ValueError(f"{source}: unsupported rope_scaling type {rtype!r}; supported: {', '.join(ROPE_TYPES)}")
    if rtype == "default":
        return theta, None
    return theta, tuple(sorted({**spec, "rope_type": rtype}.items()))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    # Rope scaling as a sorted tuple of (key, value) pairs, e.g. (("factor", 8.0), ("rope_type", "llama3"), ...).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 4096
    family: str = "llama"
    dtype: str = "float32"  # activation / parameter dtype: float32 on CPU, bfloat16 on TPU/GPU
    scan_layers: bool = False  # lax.scan over stacked layers (faster compile) vs unrolled (faster on CPU)
    # Weights stored narrower than `dtype` ("bfloat16" under float32 activations: half the
    # memory and traffic, float32 arithmetic; see layers.narrow_weight_dot). None: `dtype`.
    weight_dtype: str | None = None
    # bfloat16 terms each float32 activation is split into for a narrowed weight's matmul
    # (`narrow_weight_dot`): 3 = the float32 products (default; greedy speculative output
    # stays identical to autoregressive), 1 = activations rounded to bf16, the accelerators'
    # convention: a third of the matmul rows, but a 1-ulp difference in an activation can flip
    # its rounding, which would make speculative and autoregressive greedy output part at
    # near-ties; with it decode steps run batch-invariant (`batch_invariant`), which keeps
    # them identical.
    weight_terms: int = 3
    # Decode steps whose numbers do not depend on the step's shape (how many tokens a slot,
    # how many slots, the attention window): `layers.attend_in_fixed_order`, every decode
    # step's cache write deferred. A verification step's logits are then bitwise the
    # autoregressive steps' it replaces, so greedy speculative output is identical by
    # construction, not only up to float32 summation order — with bf16 weights, whose matmul
    # rows XLA:CPU computes alike at any row count (float32 matmuls it does not). It costs
    # attention time at many slots (BENCHMARKS.md, "Stop 41"). None: on exactly when identity
    # needs it, with bf16-rounded activations (`weight_terms` < 3 under narrowed weights).
    batch_invariant: bool | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weight_dtype not in (None, self.dtype) and (self.weight_dtype, self.dtype) != ("bfloat16", "float32"):
            raise ValueError(f"weight_dtype must be None, the dtype ({self.dtype!r}) or 'bfloat16' under float32 "
                             f"activations, got {self.weight_dtype!r}")
        if self.weight_terms not in (1, 2, 3):
            raise ValueError(f"weight_terms must be 1, 2 or 3 (bf16 terms per float32 activation), got "
                             f"{self.weight_terms!r}")

    @property
    def fixed_order_decode(self) -> bool:
        """Whether decode steps run batch-invariant (`batch_invariant`, resolved)."""
        if self.batch_invariant is not None:
            return bool(self.batch_invariant)
        return self.weight_dtype is not None and self.weight_dtype != self.dtype and self.weight_terms < 3

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """Builds a config from an HF `config.json` dict; raises on unsupported architectures."""
        archs = hf.get("architectures") or []
        family = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                family = SUPPORTED_ARCHITECTURES[a]
        if family is None:
            model_type = hf.get("model_type")
            if model_type in ("llama", "qwen2", "qwen3") and not archs:
                family = model_type
            else:
                raise ValueError(
                    f"unsupported architecture {archs or model_type!r} in config.json; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_scaling = hf_rope(hf)
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        kw = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            # HF's own default for these families when a config names no θ.
            rope_theta=10000.0 if rope_theta is None else rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            family=family,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def tiny(cls, family: str = "llama", **kw) -> ModelConfig:
        """A small random model for unit tests."""
        base = dict(
            vocab_size=128,
            hidden_size=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=family == "llama",
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            max_position_embeddings=512,
            family=family,
            eos_token_ids=(2,),
            bos_token_id=1,
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def smollm2_135m(cls, **kw) -> ModelConfig:
        base = dict(
            vocab_size=49152,
            hidden_size=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            intermediate_size=1536,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            family="llama",
            bos_token_id=1,
            eos_token_ids=(2,),
        )
        base.update(kw)
        return cls(**base)


# Published geometries of larger targets (for sizing runs with `jax.eval_shape`; the weights
# come from the user's own HF directory at training time).
PRESETS = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=12288, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     qk_norm=True, max_position_embeddings=40960, family="qwen3", dtype="bfloat16"),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, intermediate_size=14336, rope_theta=500000.0,
                         rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
                         rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
                         family="llama", dtype="bfloat16"),
}
