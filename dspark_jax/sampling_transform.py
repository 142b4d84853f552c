"""The sampling transform on logits (temperature, top-k, top-p, min-p) and per-row draws.

Shared by the drafter's sequential heads (which sample draft tokens) and by decoding
(which verifies them), so it sits below both: models never import decoding.

The transform maps raw logits to *transformed logits*: `logits / T` with the tokens that
top-k / top-p / min-p remove set to -inf. Every decoding path outputs softmax(transformed
logits) of the target; speculative decoding applies the same transform to the draft logits.

Order: temperature → top-k → top-p (on the top-k-renormalised distribution) → min-p
(relative to the most likely token). Ties at a threshold are kept (as HF does for top-k).
Temperature 0 means greedy: callers take the argmax of the raw logits, which always lies
inside the kept set.

Fast paths (all exact, selected by static flags so that each is its own program):
- `all_greedy`: no transform and no categorical draw anywhere (their results would be
  thrown away); the draw over V costs as much as a small matmul on CPU.
- `top_k_max`: when every sampled row has top-k on, `lax.top_k` over a static bound
  replaces the full sort of V (a 49k-wide sort per row per step cost 60% of throughput).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -jnp.inf


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


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
    all_greedy: bool = struct.field(pytree_node=False, default=False)
    # Static bound on top_k over sampled rows when all of them use top-k (0: full sort).
    top_k_max: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def from_params(cls, params: Sequence) -> SamplingArrays:
        """From objects with temperature / top_k / top_p / min_p (e.g. `SamplingParams`)."""
        sampled = [p for p in params if p.temperature != 0.0]
        use_top_k = any(p.top_k > 0 for p in sampled)
        vocab_bound = 0
        if use_top_k and all(p.top_k > 0 for p in sampled):
            # A power of two: request mixes with nearby k share one compiled program.
            vocab_bound = _pow2(max(p.top_k for p in sampled))
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            min_p=jnp.asarray([p.min_p for p in params], jnp.float32),
            use_top_k=use_top_k,
            use_top_p=any(p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
            all_greedy=not sampled,
            top_k_max=vocab_bound,
        )

    @property
    def greedy(self):
        return self.temperature == 0.0


def transform_logits(logits, sa: SamplingArrays):
    """logits [R, ..., V] (any number of middle axes) → transformed logits, fp32."""
    x = logits.astype(jnp.float32)
    if sa.all_greedy:
        return x  # never sampled from: greedy paths read the raw argmax
    extra = x.ndim - 2

    def per_row(a):  # [R] → [R, 1, ..., 1]
        return a.reshape(a.shape + (1,) * (extra + 1))

    t = per_row(sa.temperature)
    x = x / jnp.where(t > 0, t, 1.0)
    # A NaN logit would poison softmax and every comparison below; treat it as impossible.
    x = jnp.where(jnp.isnan(x), NEG_INF, x)
    V = x.shape[-1]
    if sa.use_top_k or sa.use_top_p:
        kmax = min(sa.top_k_max, V) if sa.use_top_k else 0
        # Descending values: the top `kmax` (lax.top_k) when that bounds every row, else all V.
        srt = jax.lax.top_k(x, kmax)[0] if kmax else -jnp.sort(-x, axis=-1)
        W = srt.shape[-1]
        if sa.use_top_k:
            k = per_row(sa.top_k)
            kk = jnp.clip(jnp.where(k > 0, k, W), 1, W)
            thr = jnp.take_along_axis(srt, kk - 1, axis=-1)
            x = jnp.where(x >= thr, x, NEG_INF)
            # By value, not by position: top-p must renormalise over every token top-k kept,
            # including those tied with the k-th.
            srt = jnp.where(srt >= thr, srt, NEG_INF)
        if sa.use_top_p:
            m = srt[..., :1]
            e = jnp.exp(srt - m)
            # The normaliser runs over the whole kept set (x), not the W sorted values: tokens
            # tied with the k-th beyond the lax.top_k window still carry mass.
            z = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
            p = e / z
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


def sample_or_argmax(key, raw_logits, transformed, greedy, all_greedy: bool = False):
    """One token per row: argmax of the raw logits where greedy, else a categorical draw.

    key: one PRNG key per row [R]; raw/transformed [R, V]; greedy [R] bool; `all_greedy`
    (static) skips the draw.
    """
    top = jnp.argmax(raw_logits, -1).astype(jnp.int32)
    if all_greedy:
        return top
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(key, transformed)
    return jnp.where(greedy, top, drawn).astype(jnp.int32)
