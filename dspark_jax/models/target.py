"""`Target`: a loaded, frozen target model (config, split NNX state, tokenizer)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import ModelConfig
from dspark_jax.models.transformer import Transformer, full_logits


@dataclasses.dataclass
class Target:
    cfg: ModelConfig
    graphdef: Any
    state: Any  # nnx.State of parameters
    tokenizer: Any = None  # dspark_jax.io.tokenizer.TextTokenizer, or None for raw-id models
    name: str = ""

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, tokenizer=None, name="random") -> Target:
        full = cfg.replace(weight_dtype=None)  # built at the activation dtype, then narrowed
        graphdef, state = nnx.split(Transformer(full, rngs=nnx.Rngs(seed)))
        return cls(full, graphdef, state, tokenizer, name).with_weight_dtype(cfg.weight_dtype, cfg.weight_terms)

    def with_weight_dtype(self, weight_dtype: str | None, terms: int = 3) -> Target:
        """This target with its matmul weights stored as `weight_dtype` ("bfloat16" under
        float32 activations; see `Transformer.narrow_weights`), each activation multiplied as
        `terms` bf16 terms (`ModelConfig.weight_terms`: 3, the float32 products; 1, rounded
        activations, a third of the rows, with batch-invariant decode steps). None or the activation dtype: itself."""
        if weight_dtype in (None, self.cfg.dtype) or (weight_dtype, terms) == (self.cfg.weight_dtype,
                                                                                self.cfg.weight_terms):
            return self
        if self.cfg.weight_dtype not in (None, self.cfg.dtype):
            raise ValueError(f"the weights are already {self.cfg.weight_dtype} ({self.cfg.weight_terms} terms)")
        cfg = self.cfg.replace(weight_dtype=weight_dtype, weight_terms=terms)  # validates them
        model = self.module()
        model.narrow_weights(jnp.dtype(weight_dtype), terms)
        model.set_config(cfg)
        graphdef, state = nnx.split(model)
        return dataclasses.replace(self, cfg=cfg, graphdef=graphdef, state=state)

    def with_batch_invariant(self, on: bool | None) -> Target:
        """This target with `ModelConfig.batch_invariant` set (None: on exactly with rounded
        activations, `weight_terms` < 3): the same weights, decode steps compiled batch-invariant
        or not."""
        cfg = self.cfg.replace(batch_invariant=on)
        model = self.module()
        model.set_config(cfg)
        graphdef, state = nnx.split(model)
        return dataclasses.replace(self, cfg=cfg, graphdef=graphdef, state=state)

    @classmethod
    def abstract(cls, cfg: ModelConfig):
        """(graphdef, abstract state) without allocating any weights."""
        return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.cfg.eos_token_ids)

    def module(self) -> Transformer:
        return nnx.merge(self.graphdef, self.state)

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state))


def logits(target: Target, token_ids) -> jax.Array:
    """Full causal forward: token ids [B, T] (or [T]) → float32 logits [B, T, V] (or [T, V])."""
    ids = jnp.asarray(token_ids, jnp.int32)
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"token_ids must be [T] or [B, T], got shape {ids.shape}")
    if ids.shape[1] > target.cfg.max_position_embeddings:
        raise ValueError(
            f"sequence of {ids.shape[1]} tokens is longer than the model's context "
            f"({target.cfg.max_position_embeddings})"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= target.cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, {target.cfg.vocab_size})")
    out = full_logits(target.graphdef, target.state, ids)
    return out[0] if squeeze else out
