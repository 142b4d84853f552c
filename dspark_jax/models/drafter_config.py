"""`DrafterConfig`: the frozen, hashable description of a DSpark / DFlash drafter."""

from __future__ import annotations

import dataclasses
from typing import Any

from dspark_jax.config import ModelConfig

HEAD_TYPES = ("markov", "gated", "rnn", "none")


def default_target_layer_ids(num_target_layers: int, n: int = 5) -> tuple[int, ...]:
    """`round(1 + i·(L−4)/(n−1))` (docs/method.md §2.1); Qwen3-8B (L=36) → (1, 9, 17, 25, 33)."""
    L = num_target_layers
    if n > L:
        raise ValueError(f"cannot tap {n} distinct layers of a {L}-layer target")
    if n == 1:
        return (L // 2,)
    ids = tuple(int(round(1 + i * (L - 4) / (n - 1))) for i in range(n))
    if len(set(ids)) < n or min(ids) < 0 or max(ids) >= L:  # tiny targets: spread over all layers
        ids = tuple(int(round(i * (L - 1) / (n - 1))) for i in range(n))
    return ids


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    # Geometry copied from the target (the drafter shares its embedding and LM head).
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_target_layers: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    # Drafter proper.
    block_size: int = 7  # γ: inputs [x0, MASK×(γ−1)], all γ positions predict
    num_layers: int = 5
    target_layer_ids: tuple[int, ...] = ()
    markov_rank: int = 256
    head_type: str = "markov"  # markov | gated | rnn | none (none = plain DFlash)
    confidence_head: bool = True
    confidence_with_markov: bool = True  # confidence reads [h_k; W1[x_{k−1}]]
    loss_decay: float = 4.0  # λ in w_k = exp(−(k−1)/λ)
    sts_temperatures: tuple[float, ...] = ()  # per position; () = all 1 (uncalibrated)
    # STS fitted on greedy cycles (survival = argmax match), used for temperature-0 requests;
    # () = the sampled ones above.
    sts_temperatures_greedy: tuple[float, ...] = ()
    # The drafter's measured acceptance per position (conditional: draft k accepted given
    # drafts 1..k−1 were), on the calibration prompts under sampling and under greedy
    # decoding. The async scheduler's confidences for a request that has not drafted yet;
    # () = 1 everywhere (optimistic: every request's first cycle drafts).
    acceptance_prior: tuple[float, ...] = ()
    acceptance_prior_greedy: tuple[float, ...] = ()
    # Draft vocabulary (EAGLE-3 d2t / FR-Spec): propose only from this many frequent target
    # tokens (ids stored in the checkpoint as `draft_ids`); 0 = the full vocabulary. Lossless:
    # draft logits are -inf outside it, so verification keeps all target mass there.
    draft_vocab_size: int = 0
    # Top-k sequential bias (vLLM's DSpark draft_topk): the head's bias goes only to the k best
    # parallel logits, the rest are -inf; 0 = off. Lossless (what is sampled is what is verified).
    draft_topk: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size (γ) must be >= 1, got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {HEAD_TYPES}, got {self.head_type!r}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.head_type != "none" and self.markov_rank == 0:
            raise ValueError(f"head_type {self.head_type!r} needs markov_rank > 0 (or use head_type='none')")
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("target_layer_ids must not be empty")
        if any(i < -1 or i >= self.num_target_layers for i in ids):
            raise ValueError(
                f"target_layer_ids {ids} out of range for a target with {self.num_target_layers} layers "
                f"(valid ids: -1 = embeddings, 0..{self.num_target_layers - 1})"
            )
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
        if self.sts_temperatures and len(self.sts_temperatures) != self.block_size:
            raise ValueError(
                f"sts_temperatures has {len(self.sts_temperatures)} entries; expected block_size={self.block_size}"
            )
        if any(t <= 0 for t in self.sts_temperatures):
            raise ValueError(f"STS temperatures must be > 0, got {self.sts_temperatures}")
        if self.sts_temperatures_greedy and len(self.sts_temperatures_greedy) != self.block_size:
            raise ValueError(f"sts_temperatures_greedy has {len(self.sts_temperatures_greedy)} entries; "
                             f"expected block_size={self.block_size}")
        if any(t <= 0 for t in self.sts_temperatures_greedy):
            raise ValueError(f"STS temperatures must be > 0, got {self.sts_temperatures_greedy}")
        for name in ("acceptance_prior", "acceptance_prior_greedy"):
            v = getattr(self, name)
            if v and len(v) != self.block_size:
                raise ValueError(f"{name} has {len(v)} entries; expected block_size={self.block_size}")
            if any(not 0.0 <= a <= 1.0 for a in v):
                raise ValueError(f"{name} holds probabilities in [0, 1], got {v}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [0, vocab_size={self.vocab_size}] (0 = full vocabulary), "
                f"got {self.draft_vocab_size}"
            )
        if self.draft_topk < 0:
            raise ValueError(f"draft_topk must be >= 0 (0 = off), got {self.draft_topk}")
        if self.loss_decay <= 0:
            raise ValueError(f"loss_decay (λ) must be > 0, got {self.loss_decay}")

    @property
    def rank(self) -> int:
        """Effective Markov rank (0 when there is no sequential head)."""
        return 0 if self.head_type == "none" else self.markov_rank

    @property
    def proposal_vocab_size(self) -> int:
        """V′: the number of tokens the drafter can propose (its LM head rows, W2 columns)."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def uses_markov_in_confidence(self) -> bool:
        return self.confidence_with_markov and self.rank > 0

    def replace(self, **kw) -> DrafterConfig:
        return dataclasses.replace(self, **kw)

    def layer_config(self) -> ModelConfig:
        """Config of the Qwen3-style draft layers (q_norm/k_norm, no bias)."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps, qk_norm=True,
            qkv_bias=False, family="qwen3", dtype=self.dtype,
        )

    @classmethod
    def for_target(cls, target: ModelConfig, *, num_feature_layers: int = 5, **kw) -> DrafterConfig:
        """A drafter sized for `target`; keyword overrides for everything else."""
        base = dict(
            vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            intermediate_size=target.intermediate_size, num_target_layers=target.num_layers,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
            rms_norm_eps=target.rms_norm_eps, dtype=target.dtype,
        )
        if "target_layer_ids" not in kw:
            kw["target_layer_ids"] = default_target_layer_ids(target.num_layers, num_feature_layers)
        base.update(kw)
        return cls(**base)

    def check_compatible(self, target: ModelConfig) -> None:
        """Raises if this drafter cannot run on `target`."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab size {self.vocab_size} != target's {target.vocab_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(f"trained for a {self.num_target_layers}-layer target, this one has {target.num_layers}")
        if max(self.target_layer_ids) >= target.num_layers:
            problems.append(f"target_layer_ids {self.target_layer_ids} exceed the target's depth")
        if problems:
            raise ValueError("drafter does not match the target: " + "; ".join(problems))
