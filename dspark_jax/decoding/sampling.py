"""Sampling parameters and the sampling transform (temperature, top-k, top-p, min-p).

The transform maps raw logits to *transformed logits*: `logits / T` with the tokens that
top-k / top-p / min-p remove set to -inf. The output distribution of every decoding path
is softmax(transformed logits) of the target; speculative decoding applies the same
transform to the draft logits (DESIGN.md §3.2).

Order: temperature → top-k → top-p (on the top-k-renormalised distribution) → min-p
(relative to the most likely token). Ties at a threshold are kept (as HF does for top-k).
Temperature 0 means greedy: callers take the argmax of the raw logits, which always lies
inside the kept set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

NEG_INF = -jnp.inf


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


@struct.dataclass
class SamplingArrays:
    """Per-request sampling values on device; the `use_*` flags are static (shape the graph)."""

    temperature: jax.Array  # [R] float32, 0 = greedy
    top_k: jax.Array  # [R] int32, 0 = off
    top_p: jax.Array  # [R] float32
    min_p: jax.Array  # [R] float32
    use_top_k: bool = struct.field(pytree_node=False, default=False)
    use_top_p: bool = struct.field(pytree_node=False, default=False)
    use_min_p: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> SamplingArrays:
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            min_p=jnp.asarray([p.min_p for p in params], jnp.float32),
            use_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            use_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            use_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
        )

    @property
    def greedy(self):
        return self.temperature == 0.0


def transform_logits(logits, sa: SamplingArrays):
    """logits [R, ..., V] (any number of middle axes) → transformed logits, fp32."""
    x = logits.astype(jnp.float32)
    extra = x.ndim - 2

    def per_row(a):  # [R] → [R, 1, ..., 1]
        return a.reshape(a.shape + (1,) * (extra + 1))

    t = per_row(sa.temperature)
    x = x / jnp.where(t > 0, t, 1.0)
    # A NaN logit would poison softmax and every comparison below; treat it as impossible.
    x = jnp.where(jnp.isnan(x), NEG_INF, x)
    if sa.use_top_k or sa.use_top_p:
        srt = -jnp.sort(-x, axis=-1)  # descending
        V = x.shape[-1]
        if sa.use_top_k:
            k = per_row(sa.top_k)
            kk = jnp.clip(jnp.where(k > 0, k, V), 1, V)
            thr = jnp.take_along_axis(srt, kk - 1, axis=-1)
            x = jnp.where(x >= thr, x, NEG_INF)
            # By value, not by position: top-p must renormalise over every token top-k kept,
            # including those tied with the k-th.
            srt = jnp.where(srt >= thr, srt, NEG_INF)
        if sa.use_top_p:
            p = jax.nn.softmax(srt, axis=-1)
            before = jnp.cumsum(p, axis=-1) - p
            n_keep = jnp.maximum(jnp.sum(before < per_row(sa.top_p), axis=-1, keepdims=True), 1)
            thr = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
            # A row with top_p = 1 (off) keeps everything: in float32 the mass before the
            # least likely tokens rounds up to 1, which would drop them.
            x = jnp.where((x >= thr) | (per_row(sa.top_p) >= 1.0), x, NEG_INF)
    if sa.use_min_p:
        m = jnp.max(x, axis=-1, keepdims=True)
        mp = per_row(sa.min_p)
        # p_i >= min_p * p_max  ⇔  x_i >= x_max + log(min_p); min_p = 0 (off) keeps everything.
        x = jnp.where((x >= m + jnp.log(jnp.maximum(mp, 1e-30))) | (mp <= 0.0), x, NEG_INF)
    return x


def sample_or_argmax(key, raw_logits, transformed, greedy):
    """One token per row: argmax of the raw logits where greedy, else a categorical draw.

    key: one PRNG key per row [R]; raw/transformed [R, V]; greedy [R] bool.
    """
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(key, transformed)
    return jnp.where(greedy, jnp.argmax(raw_logits, -1), drawn).astype(jnp.int32)
