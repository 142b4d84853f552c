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


def _is_real(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 1.0 = the model's distribution (as HF and vLLM); 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_new_tokens: int = 128
    # Any Python int (reproducible: same seed, same tokens, whatever else is in the batch);
    # None = fresh randomness for every request, as in vLLM.
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's EOS ids
    stop: tuple[str, ...] = ()  # stop strings (host-side check; see decoding/stop_strings.py)
    ignore_eos: bool = False

    def __post_init__(self):
        # Types first: a string temperature would otherwise fail deep inside numpy.
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if not _is_real(v):
                raise ValueError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer (any size) or None for fresh randomness, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, str) or not all(_is_int(t) for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be a sequence of integers, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
