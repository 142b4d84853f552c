"""Sampling parameters (`SamplingParams`, the user-facing request settings).

The array side (`SamplingArrays`, `transform_logits`, `sample_or_argmax`) lives in
`dspark_jax/sampling_transform.py`, below both models and decoding, and is re-exported here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_jax.sampling_transform import (  # noqa: F401  (re-exported)
    NEG_INF,
    SamplingArrays,
    sample_or_argmax,
    transform_logits,
)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_new_tokens: int = 128
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's EOS ids
    stop: tuple[str, ...] = ()  # stop strings (host-side check)
    ignore_eos: bool = False

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int | np.integer) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not isinstance(self.max_new_tokens, int | np.integer) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
