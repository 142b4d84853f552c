"""DSpark-JAX: lossless speculative decoding with a semi-autoregressive drafter.

    import dspark_jax as ds
    target = ds.load_target("smollm2-135m")
    out = ds.generate(target, ["Hello"], sampling=ds.SamplingParams(temperature=0.0))
"""

from dspark_jax.config import ModelConfig
from dspark_jax.decoding.decode_config import DecodeConfig
from dspark_jax.decoding.generate import GenerationOutput, generate
from dspark_jax.decoding.profiling import StepRates, profile_step_rates, profile_window_rates
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.decoding.scheduler import schedule
from dspark_jax.decoding.verification import verify
from dspark_jax.io.drafter_io import load_drafter, save_drafter
from dspark_jax.io.loading import load_target
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import Drafter, OracleDrafter
from dspark_jax.models.ngram import HybridDrafter, NgramDrafter
from dspark_jax.models.target import Target, logits

__all__ = [
    "DecodeConfig",
    "Drafter",
    "DrafterConfig",
    "GenerationOutput",
    "HybridDrafter",
    "OracleDrafter",
    "ModelConfig",
    "NgramDrafter",
    "SamplingParams",
    "StepRates",
    "Target",
    "generate",
    "load_drafter",
    "load_target",
    "logits",
    "profile_step_rates",
    "profile_window_rates",
    "save_drafter",
    "schedule",
    "verify",
]
__version__ = "0.1.0"
