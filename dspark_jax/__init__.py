"""DSpark-JAX: lossless speculative decoding with a semi-autoregressive drafter."""

from dspark_jax.config import ModelConfig
from dspark_jax.io.loading import load_target
from dspark_jax.models.target import Target, logits

__all__ = ["ModelConfig", "Target", "load_target", "logits"]
__version__ = "0.1.0"
