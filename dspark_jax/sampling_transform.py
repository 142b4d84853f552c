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
- `top_k_max`: when every sampled row has top-k on, `lax.top_k` over that static bound
  is all the sorting there is.

No full sort of V: otherwise the thresholds come from the `window` largest values
(`lax.top_k`; a [32, 49152] sort took ~250 ms on 2 CPU cores, the top 256 ~5 ms), which
decides every row whose top-k and top-p cut falls inside it; a row whose cut lies beyond it
(k > window, or a top-p mass spread over more tokens) gets its exact threshold from a
bisection over the float order (32 passes over V, `lax.cond`-guarded: only paid when a row
needs it).
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


# Largest values taken with `lax.top_k` when no static top-k bound applies; a row whose
# threshold lies beyond them falls back to the exact bisection.
SORT_WINDOW = 256


def _order_key(x):
    """float32 → int32 with the same order (-0.0 and +0.0 map to one key: they are equal)."""
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.int32)
    return jnp.where(b >= 0, b, b ^ 0x7FFFFFFF)


def _key_value(key):
    """Inverse of `_order_key`."""
    return jax.lax.bitcast_convert_type(jnp.where(key >= 0, key, key ^ 0x7FFFFFFF), jnp.float32)


def _bisect(keys, lo, hi, go_up):
    """Bisection over int32 keys: `go_up(mid)` [R, 1] bool says the answer is ≥ mid (lo ← mid),
    else it is < mid (hi ← mid). 32 halvings cover the whole int32 range. Returns (lo, hi)."""

    def body(_, c):
        lo, hi = c
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        up = go_up(mid)
        return jnp.where(up, mid, lo), jnp.where(up, hi, mid)

    return jax.lax.fori_loop(0, 32, body, (lo, hi))


def _kth_largest(x, k):
    """Exact k-th largest value of each row (x [R, V], k [R, 1] in 1..V), ties counted."""
    keys = _order_key(x)
    lo = jnp.min(keys, -1, keepdims=True)  # count(keys ≥ lo) = V ≥ k
    hi = jnp.max(keys, -1, keepdims=True) + 1  # count(keys ≥ hi) = 0 < k
    lo, _ = _bisect(keys, lo, hi, lambda mid: jnp.sum(keys >= mid, -1, keepdims=True) >= k)
    return _key_value(lo)


def _top_p_cut(x, m, z, top_p):
    """Exact top-p threshold of each row: the smallest value whose strictly-larger mass
    (softmax of x, max m, normaliser z) is below top_p; x [R, V], m/z/top_p [R, 1]."""
    keys = _order_key(x)
    p = jnp.exp(x - m) / z
    lo = jnp.min(keys, -1, keepdims=True) - 1  # mass above: everything (≥ top_p)
    hi = jnp.max(keys, -1, keepdims=True)  # mass above: nothing (< top_p)
    _, hi = _bisect(keys, lo, hi,
                    lambda mid: jnp.sum(jnp.where(keys > mid, p, 0.0), -1, keepdims=True) >= top_p)
    return _key_value(hi)


def transform_logits(logits, sa: SamplingArrays, window: int = SORT_WINDOW):
    """logits [R, ..., V] (any number of middle axes) → transformed logits, fp32.

    `window` (static): how many of the largest values `lax.top_k` takes when `sa.top_k_max`
    does not bound top-k (module docstring); any value gives the same result."""
    x = logits.astype(jnp.float32)
    if sa.all_greedy:
        return x  # never sampled from: greedy paths read the raw argmax
    shape = x.shape
    x = x.reshape(shape[0], -1, shape[-1])  # [R, M, V]

    def per_row(a):  # [R] → [R, 1, 1]
        return a.reshape(a.shape + (1, 1))

    t = per_row(sa.temperature)
    x = x / jnp.where(t > 0, t, 1.0)
    # A NaN logit would poison softmax and every comparison below; treat it as impossible.
    x = jnp.where(jnp.isnan(x), NEG_INF, x)
    V = x.shape[-1]
    if sa.use_top_k or sa.use_top_p:
        bounded = sa.use_top_k and sa.top_k_max > 0
        W = min(sa.top_k_max if bounded else max(int(window), 1), V)
        srt = jax.lax.top_k(x, W)[0]  # the W largest, descending
        if sa.use_top_k:
            k = per_row(sa.top_k)
            kk = jnp.clip(k, 1, V)
            thr = jnp.where(k > 0, jnp.take_along_axis(srt, jnp.minimum(kk, W) - 1, axis=-1), NEG_INF)
            if not bounded and W < V:  # sampled rows with k > W: the exact k-th largest value
                beyond = jnp.broadcast_to((kk > W) & (k > 0) & (t > 0), thr.shape)
                thr = jax.lax.cond(
                    jnp.any(beyond),
                    lambda: jnp.where(beyond, _kth_largest(x.reshape(-1, V), jnp.broadcast_to(kk, thr.shape)
                                                           .reshape(-1, 1)).reshape(thr.shape), thr),
                    lambda: thr)
            x = jnp.where(x >= thr, x, NEG_INF)
            # By value, not by position: top-p must renormalise over every token top-k kept,
            # including those tied with the k-th.
            srt = jnp.where(srt >= thr, srt, NEG_INF)
        if sa.use_top_p:
            top_p = per_row(sa.top_p)
            m = srt[..., :1]
            e = jnp.exp(srt - m)
            # The normaliser runs over the whole kept set (x), not the W largest values:
            # tokens tied with the k-th beyond the window still carry mass.
            z = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
            p = e / z
            before = jnp.cumsum(p, axis=-1) - p
            n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
            thr = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
            if W < V:  # the window's mass is below top_p and kept tokens lie beyond it
                beyond = ((jnp.sum(p, -1, keepdims=True) < top_p)
                          & (jnp.sum(x > NEG_INF, -1, keepdims=True) > W) & (top_p < 1.0) & (t > 0))
                R_ = thr.size
                thr = jax.lax.cond(
                    jnp.any(beyond),
                    lambda: jnp.where(beyond, _top_p_cut(x.reshape(R_, V), m.reshape(R_, 1), z.reshape(R_, 1),
                                                         jnp.broadcast_to(top_p, thr.shape).reshape(R_, 1))
                                      .reshape(thr.shape), thr),
                    lambda: thr)
            # A row with top_p = 1 (off) keeps everything: in float32 the mass before the
            # least likely tokens rounds up to 1, which would drop them.
            x = jnp.where((x >= thr) | (top_p >= 1.0), x, NEG_INF)
    if sa.use_min_p:
        m = jnp.max(x, axis=-1, keepdims=True)
        mp = per_row(sa.min_p)
        # p_i >= min_p * p_max  ⇔  x_i >= x_max + log(min_p); min_p = 0 (off) keeps everything.
        x = jnp.where((x >= m + jnp.log(jnp.maximum(mp, 1e-30))) | (mp <= 0.0), x, NEG_INF)
    return x.reshape(shape)


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
