"""Building blocks shared by the target decoder and the drafter.

Shape letters (docs/architecture.md, "Shape letters"): S cache slots (requests), Q query positions per
slot, T key positions, N packed tokens, D model width, H query heads, I query heads per KV
head, K KV heads, E head dim, V vocab.

Every parameter carries its logical axis names in the `axes` metadata; the rules table
in `dspark_jax/sharding.py` maps them to mesh axes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import ModelConfig


def param(rngs: nnx.Rngs | None, shape, axes, dtype, init="normal", scale=0.02) -> nnx.Param:
    """A parameter with logical axes. `rngs=None` gives zeros (used under eval_shape/loading)."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=tuple(axes))


def tree_sum(x, axis: int = -1, keepdims: bool = False):
    """Sum over `axis` in one fixed order whatever the other dimensions: the axis zero-padded
    to a power of two and halved by elementwise adds. A reduction's order is XLA's choice and
    on CPU it depends on the shape (a row of one token sums differently from the same row among
    eight), which makes a speculative step's numbers differ from an autoregressive step's; this
    does not. Zero padding at the end leaves the sum exact, so a longer zero-padded axis (a
    wider attention window) gives the same result."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return jnp.moveaxis(x, -1, axis) if keepdims else x[..., 0]


class RMSNorm(nnx.Module):
    # Sum the squares in one fixed order (`tree_sum`) instead of XLA's shape-dependent one:
    # set by the target when its decode steps run batch-invariant (`ModelConfig.batch_invariant`).
    fixed_order = False

    def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm"):
        self.eps = eps
        self.weight = param(None, (dim,), (axis_name,), dtype, init="ones")

    def __call__(self, x):
        # Normalise in fp32: bf16 variance loses too many bits for long contexts.
        x32 = x.astype(jnp.float32)
        if self.fixed_order:
            var = tree_sum(x32 * x32, keepdims=True) / x32.shape[-1]
        else:
            var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


# Fewer bf16 rows than this are zero-padded to it. XLA:CPU multiplies 1, 2 and ≥ 3 rows with
# different kernels, which sum a row's products in different orders (measured on a Xeon with
# AMX and AVX512-FP16; 1 row is also its slow path): padded, a row's result does not depend on
# how many rows its step has, which batch-invariant decoding rests on (`benchmarks/
# bench_batch_invariance.py` measures it). The weights' memory traffic dominates a few rows' cost.
MIN_DOT_ROWS = 4


def narrow_weight_dot(x, w_OI, terms: int = 3):
    """x [..., I] (float32) @ w_OI.T for weights stored narrower (bfloat16) as [O, I].

    Exact in the activations: x = hi + mid + lo, three bfloat16 terms (exact for normal
    float32 values), each term's products with the weights accumulated in float32 — the
    float32 product of x and the bf16-rounded weights, up to summation order. Rounding x
    itself to bfloat16 (the TPU convention) would make the result depend on 1-ulp
    differences in x, which break greedy identity between a speculative and an
    autoregressive step at near-ties. The three terms are stacked as rows of one matmul: on a
    CPU with AMX / AVX512-BF16, bf16 rows cost little up to ~8 tokens (24 rows; the weights'
    memory traffic dominates), then each row costs its arithmetic, so three terms triple a
    large step's matmuls (BENCHMARKS.md, "Stop 37"); the [O, I] layout is the one its kernels
    read without repacking. The result has x's dtype.

    `terms` < 3 keeps only the leading terms: 1 rounds x to bfloat16 (the accelerators'
    convention; a third of the rows — decode steps then run batch-invariant, see
    `ModelConfig.batch_invariant`)."""
    lead, din = x.shape[:-1], x.shape[-1]
    x_MI = x.reshape(-1, din).astype(jnp.float32)
    parts, rest = [], x_MI
    for _ in range(terms):
        p = rest.astype(w_OI.dtype)
        parts.append(p)
        rest = rest - p.astype(jnp.float32)
    m = x_MI.shape[0]
    rows = jnp.concatenate(parts)
    if rows.shape[0] < MIN_DOT_ROWS:
        rows = jnp.pad(rows, ((0, MIN_DOT_ROWS - rows.shape[0]), (0, 0)))
    y = jnp.einsum("mi,oi->mo", rows, w_OI, preferred_element_type=jnp.float32)
    y = functools.reduce(jnp.add, [y[i * m:(i + 1) * m] for i in reversed(range(terms))])  # smallest first
    return y.reshape(*lead, w_OI.shape[0]).astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ W (+ b). The kernel is stored (in, out), or — after `narrow_weights` — as
    narrower (bfloat16) weights (out, in), multiplied by `narrow_weight_dot`."""

    kernel_layout = "io"
    narrow_terms = 3  # bf16 terms per activation once narrowed (`narrow_weight_dot`)

    def __init__(self, din, dout, axes, *, rngs, dtype, bias=False):
        self.kernel = param(rngs, (din, dout), axes, dtype)
        self.bias = param(None, (dout,), axes[1:], dtype, init="zeros") if bias else None

    def __call__(self, x):
        if self.kernel_layout == "oi":
            y = narrow_weight_dot(x, self.kernel[...], self.narrow_terms)
        else:
            y = x @ self.kernel[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y

    def narrow(self, dtype, terms: int = 3):
        """Stores the kernel as `dtype` in the (out, in) layout (see `narrow_weight_dot`)."""
        self.narrow_terms = terms
        if self.kernel_layout == "oi":
            return
        k = self.kernel
        axes = tuple(k.get_metadata().get("axes", ()))
        if len(axes) >= 2:
            axes = (*axes[:-2], axes[-1], axes[-2])
        self.kernel = nnx.Param(jnp.swapaxes(k[...], -1, -2).astype(dtype), axes=axes)
        self.kernel_layout = "oi"


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> jnp.ndarray:
    """Inverse frequencies [E/2], with HF's `linear` and `llama3` rope scaling."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if not scaling:
        return inv
    rtype = scaling.get("rope_type", "default")
    if rtype == "linear":
        return inv / scaling["factor"]
    if rtype == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    return inv


def apply_rope(x, positions, inv_freq):
    """x [..., E] with positions [...] (broadcast over the head axis); HF rotate-half layout."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., E/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    cos = jnp.concatenate([cos, cos], -1)[..., None, :]
    sin = jnp.concatenate([sin, sin], -1)[..., None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rot * sin).astype(x.dtype)


# --------------------------------------------------------------------------- attention


def attend(q_SQHE, k_STKE, v_STKE, mask_SQT):
    """Grouped-query attention; scores and softmax in fp32. Fully masked rows give zeros."""
    S, Q, H, E = q_SQHE.shape
    K = k_STKE.shape[2]
    q = q_SQHE.reshape(S, Q, K, H // K, E)
    s = jnp.einsum("sqkge,stke->skgqt", q, k_STKE, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(E))
    m = mask_SQT[:, None, None]
    s = jnp.where(m, s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(m, p, 0.0)
    o = jnp.einsum("skgqt,stke->sqkge", p.astype(v_STKE.dtype), v_STKE)
    return o.reshape(S, Q, H, E)


# Queries per slot up to which `attend_cached` uses the multiply-reduce form on CPU.
SMALL_Q = 16


def _cached_scores(q_SQHE, kt_SKET):
    """The queries as Q·I rows per KV head (fp32, scaled) [S, K, Q·I, E], their scores against
    the heads-major keys [S, K, Q·I, T] in fp32, and whether the CPU multiply-reduce form ran.
    (With the additive mask, XLA:CPU's batched matmuls measure the same as the multiply-reduce
    at decode and verification sizes: BENCHMARKS.md, "Stop 34".)"""
    S, Q, H, E = q_SQHE.shape
    K = kt_SKET.shape[1]
    q = q_SQHE.reshape(S, Q, K, H // K, E).transpose(0, 2, 1, 3, 4).reshape(S, K, Q * (H // K), E)
    q = q.astype(jnp.float32) * (1.0 / math.sqrt(E))
    fused = Q <= SMALL_Q and jax.default_backend() == "cpu"
    if fused:
        s = jnp.sum(q[..., None] * kt_SKET[:, :, None].astype(jnp.float32), axis=-2)
    else:
        s = jnp.einsum("skne,sket->sknt", q.astype(kt_SKET.dtype), kt_SKET, preferred_element_type=jnp.float32)
    return q, s, fused


def _additive(mask):
    """0 where `mask` allows a key, -1e30 where it does not: added to the scores. On CPU a
    select on the [.., T] scores splits XLA's fusion of the score reduction from the softmax
    (decode attention at 64 slots ~1.45× slower, BENCHMARKS.md "Stop 34"); an added
    bias keeps it one pass. A masked score becomes exactly -1e30 (|score| ≪ 1e22), so its
    exponential is exactly 0 in any row with an allowed key: the same softmax as a select."""
    return jnp.where(mask, 0.0, -1e30).astype(jnp.float32)


def attend_cached(q_SQHE, kt_SKET, v_SKTE, mask_SQT):
    """Grouped-query attention over a heads-major cache (keys transposed, `KVCache`); scores
    and softmax in fp32, fully masked rows give zeros. Same result as `attend` on the
    position-major layout.

    Each KV head's I query heads and the slot's Q queries form Q·I rows against the head's
    [E, T] keys. For a few queries per slot (decode, verification: Q ≤ SMALL_Q) on CPU the
    scores and outputs are a multiply-reduce vectorised over T / E (`_cached_scores` says
    why); otherwise (prefill; every step on TPU/GPU) batched matmuls. The mask is added to the
    scores (`_additive`) and the softmax normalised after the value reduction.
    """
    S, Q, H, E = q_SQHE.shape
    K = kt_SKET.shape[1]
    I = H // K
    T = kt_SKET.shape[-1]
    q, s, fused = _cached_scores(q_SQHE, kt_SKET)
    bias = jnp.broadcast_to(_additive(mask_SQT)[:, None, :, None, :], (S, 1, Q, I, T)).reshape(S, 1, Q * I, T)
    s = s + bias
    p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    den = jnp.sum(p, -1, keepdims=True)
    if fused:
        o = jnp.sum(p[..., None] * v_SKTE[:, :, None].astype(jnp.float32), axis=-2)  # [S, K, Q·I, E]
    else:
        o = jnp.einsum("sknt,skte->skne", p.astype(v_SKTE.dtype), v_SKTE, preferred_element_type=jnp.float32)
    live = jnp.any(mask_SQT, -1)  # [S, Q]: rows with an allowed key (the others give zeros)
    live = jnp.broadcast_to(live[:, None, :, None], (S, 1, Q, I)).reshape(S, 1, Q * I, 1)
    o = jnp.where(live, o / den, 0.0).astype(q_SQHE.dtype)
    return o.reshape(S, K, Q, I, E).transpose(0, 2, 1, 3, 4).reshape(S, Q, H, E)


def attend_cached_and_new(q_SQHE, kt_SKET, v_SKTE, ctx_ST, k_SQKE, v_SQKE, new_SQQ):
    """`attend_cached` over a cache that does not hold this step's tokens yet: each query
    attends to its slot's cached positions allowed by `ctx_ST` plus the step's own keys and
    values (the [S, Q] grid, `new_SQQ` [query, key] allowed), with one softmax over both parts
    (max and sum merged, flash-style). The cache is only read — what lets a step run inside
    `lax.switch` without XLA copying the whole cache (the write happens after the switch).
    Fully masked rows give zeros."""
    S, Q, H, E = q_SQHE.shape
    K = kt_SKET.shape[1]
    I = H // K
    q, s1, fused = _cached_scores(q_SQHE, kt_SKET)
    # The step's own keys and values in the cache's precision, as if written there first.
    dt = jnp.float32 if fused else kt_SKET.dtype
    kn = k_SQKE.astype(kt_SKET.dtype).transpose(0, 2, 1, 3).astype(dt)  # [S, K, Q, E]
    vn = v_SQKE.astype(v_SKTE.dtype).transpose(0, 2, 1, 3).astype(dt)
    s2 = jnp.einsum("skne,skqe->sknq", q.astype(dt), kn, preferred_element_type=jnp.float32)  # [S, K, Q·I, Q]
    m2 = jnp.broadcast_to(new_SQQ[:, None, :, None, :], (S, 1, Q, I, Q)).reshape(S, 1, Q * I, Q)
    s1 = s1 + _additive(ctx_ST)[:, None, None, :]
    s2 = s2 + _additive(m2)
    mx = jnp.maximum(jnp.max(s1, -1, keepdims=True), jnp.max(s2, -1, keepdims=True))
    p1 = jnp.exp(s1 - mx)
    p2 = jnp.exp(s2 - mx)
    den = jnp.sum(p1, -1, keepdims=True) + jnp.sum(p2, -1, keepdims=True)
    if fused:
        o = jnp.sum(p1[..., None] * v_SKTE[:, :, None].astype(jnp.float32), axis=-2)  # [S, K, Q·I, E]
    else:
        o = jnp.einsum("sknt,skte->skne", p1.astype(v_SKTE.dtype), v_SKTE, preferred_element_type=jnp.float32)
    o = o + jnp.einsum("sknq,skqe->skne", p2.astype(vn.dtype), vn, preferred_element_type=jnp.float32)
    live = jnp.any(ctx_ST, -1)[:, None, None, None] | jnp.any(m2, -1, keepdims=True)  # [S, 1, Q·I, 1]
    o = jnp.where(live, o / den, 0.0).astype(q_SQHE.dtype)
    return o.reshape(S, K, Q, I, E).transpose(0, 2, 1, 3, 4).reshape(S, Q, H, E)


# Keys each batch-invariant decode query reads outside the cache-wide reduction
# (`attend_in_fixed_order`): itself and the RECENT - 1 positions before it. A step's queries
# per slot must not exceed it (a longer block widens it, and is then exact but not invariant).
RECENT = 16


def _chained_scores(q_SKQIE, k_SKQER):
    """q · k over the head dim as a chain of E multiply-adds in index order (one fused loop
    vectorised along the keys), for keys gathered per query: q [S, K, Q, I, E], keys
    [S, K, Q, E, R] → [S, K, Q, I, R]. One order by construction, whatever S and Q."""
    acc = q_SKQIE[..., 0, None] * k_SKQER[:, :, :, None, 0, :]
    for e in range(1, q_SKQIE.shape[-1]):
        acc = acc + q_SKQIE[..., e, None] * k_SKQER[:, :, :, None, e, :]
    return acc


# Positions per block of the cache-wide scores (`_blocked_scores`): the largest of these that
# divides the window; a window none divides is padded to blocks of the smallest (a window no
# longer than the smallest is one block).
SCORE_BLOCKS = (256, 128)


def score_block(T: int) -> int:
    """The position block of `_blocked_scores` at window T."""
    if T <= SCORE_BLOCKS[-1]:
        return T
    return next((b for b in SCORE_BLOCKS if T % b == 0), SCORE_BLOCKS[-1])


def _blocked_scores(q_SKQIE, kt_SKET):
    """q · k for every cached position, [S, K, Q, I, T]: the keys regrouped in blocks of B
    positions (`score_block`), [S, K, T/B, E, B], and XLA's multiply-reduce over the head dim.
    Over the flat [E, T] layout XLA:CPU sums the head dim in an order that changes with T
    (measured: every T ≥ 640 differs from 256, 384 and 512 do not); over blocks of 128 or 256
    positions every window is the same reduction repeated, and a position's score is the same
    at every slot count, query count and window (`benchmarks/bench_batch_invariance.py`
    measures it). The regrouping is a transpose: a copy of the keys each layer and step
    (at 8 slots and 256 positions ~6 ms of a ~58 ms one-token step of SmolLM2), which a
    window of one block skips — hence blocks of 256 where the window allows (BENCHMARKS.md,
    "Stop 52"). Reducing over E of a merely reshaped [E, T/B, B] view instead is equally
    invariant but ~10× slower on XLA:CPU. A window of at most 128 positions is one block; a
    longer one that 128 does not divide is padded with zero keys to blocks of 128 (as one flat
    block its scores differed from 256's at windows of 576, 672, 704 and 960 positions)."""
    S, K, E, T = kt_SKET.shape
    B = score_block(T)
    Tp = -(-T // B) * B
    if Tp != T:  # zero keys after the window: their scores are cut off below
        kt_SKET = jnp.pad(kt_SKET, ((0, 0), (0, 0), (0, 0), (0, Tp - T)))
    k = kt_SKET.reshape(S, K, E, Tp // B, B).transpose(0, 1, 3, 2, 4)  # [S, K, T/B, E, B]
    s = jnp.sum(q_SKQIE[:, :, :, :, None, :, None] * k[:, :, None, None], axis=-2)  # [S, K, Q, I, T/B, B]
    return s.reshape(*s.shape[:4], Tp)[..., :T]


def attend_in_fixed_order(q_SQHE, kt_SKET, v_SKTE, pos_SQ, valid_SQ, new=None, recent: int = RECENT):
    """Attention of a decode step's queries whose every number is the same whether the step
    carries one token per slot (autoregressive) or a block of them (verification), at any
    slot count and attention window — what makes a speculative step's logits bitwise equal to
    the autoregressive steps' it replaces (`ModelConfig.batch_invariant`; measured by
    `benchmarks/bench_batch_invariance.py`, tested in `tests/models/test_narrow_weights.py`).

    A query at position p splits its keys by position alone: the cache-wide part, positions
    ≤ p − `recent`, and the recent part, the `recent` positions p − `recent` + 1 … p. Which
    keys sit in the cache and which come with the step (`new`) then never decides how they
    are summed: the recent part is gathered, from the cache or from the step, into the same
    `recent` slots for every query. Each sum is one whose order does not depend on the shape:
    scores over position blocks (`_blocked_scores`) and chained multiply-adds
    (`_chained_scores`), the softmax denominator as a `tree_sum`, the values as XLA's
    multiply-reduce over positions vectorised along the head dim (measured invariant:
    `bench_batch_invariance`); masked keys add exact zeros, so a wider window or a masked-out
    key changes nothing. This rests on XLA:CPU's code generation as measured, not on a
    guarantee: the tests and the benchmark check it on the machine they run on.

    q [S, Q, H, E] with Q ≤ `recent`; the cache (heads-major: keys [S, K, E, T], values
    [S, K, T, E]); pos [S, Q] each query's position (a slot's queries consecutive); valid
    [S, Q]. `new` = (k, v) [S, Q, K, E]: the step's own keys and values, not in the cache yet
    (positions ≥ pos[:, 0] come from them); None: the cache already holds them. Scores and
    softmax in fp32; invalid queries give zeros."""
    S, Q, H, E = q_SQHE.shape
    K = kt_SKET.shape[1]
    I = H // K
    T = kt_SKET.shape[-1]
    R = recent
    if Q > R:
        raise ValueError(f"a fixed-order decode step takes at most {R} queries per slot, got {Q}")
    f32 = jnp.float32
    q = q_SQHE.reshape(S, Q, K, I, E).transpose(0, 2, 1, 3, 4).astype(f32) * (1.0 / math.sqrt(E))  # [S, K, Q, I, E]
    # Cache-wide part: positions <= p - R.
    s1 = _blocked_scores(q, kt_SKET.astype(f32))  # [S, K, Q, I, T]
    old = (jnp.arange(T)[None, None, :] <= pos_SQ[..., None] - R) & valid_SQ[..., None]  # [S, Q, T]
    s1 = s1 + _additive(old)[:, None, :, None, :]
    # Recent part: C[s, c] is position start_s - R + c (c < R + Q); query j reads C[j + r], r < R.
    start = pos_SQ[:, 0]
    cpos = start[:, None] - R + jnp.arange(R + Q)[None, :]  # [S, R + Q]
    from_cache = jnp.clip(cpos, 0, T - 1)
    kc = jnp.take_along_axis(kt_SKET, from_cache[:, None, None, :], axis=-1).astype(f32)  # [S, K, E, R + Q]
    vc = jnp.take_along_axis(v_SKTE, from_cache[:, None, :, None], axis=2).astype(f32)  # [S, K, R + Q, E]
    if new is not None:  # the step's keys, at the cache's precision as if written there first
        k_new, v_new = new
        step = (cpos >= start[:, None])[:, None]
        kn = jnp.pad(k_new.astype(kt_SKET.dtype).astype(f32).transpose(0, 2, 3, 1), ((0, 0), (0, 0), (0, 0), (R, 0)))
        vn = jnp.pad(v_new.astype(v_SKTE.dtype).astype(f32).transpose(0, 2, 1, 3), ((0, 0), (0, 0), (R, 0), (0, 0)))
        kc = jnp.where(step[:, :, None, :], kn, kc)
        vc = jnp.where(step[..., None], vn, vc)
    win = jnp.arange(Q)[:, None] + jnp.arange(R)[None, :] + 1  # [Q, R]: positions p - R + 1 … p
    kw = kc[..., win]  # [S, K, E, Q, R]
    vw = vc[:, :, win]  # [S, K, Q, R, E]
    s2 = _chained_scores(q, kw.transpose(0, 1, 3, 2, 4))  # [S, K, Q, I, R]
    wpos = pos_SQ[..., None] - R + 1 + jnp.arange(R)  # [S, Q, R]
    recent = (wpos >= 0) & valid_SQ[..., None]
    s2 = s2 + _additive(recent)[:, None, :, None, :]
    mx = jnp.maximum(jnp.max(s1, -1, keepdims=True), jnp.max(s2, -1, keepdims=True))
    p1 = jnp.exp(s1 - mx)
    p2 = jnp.exp(s2 - mx)
    den = tree_sum(p1, keepdims=True) + tree_sum(p2, keepdims=True)
    o = (jnp.sum(p1[..., None] * v_SKTE[:, :, None, None].astype(f32), axis=-2)
         + jnp.sum(p2[..., None] * vw[:, :, :, None], axis=-2))  # [S, K, Q, I, E]
    o = jnp.where(valid_SQ[:, None, :, None, None], o / den, 0.0).astype(q_SQHE.dtype)
    return o.transpose(0, 2, 1, 3, 4).reshape(S, Q, H, E)


class Attention(nnx.Module):
    """Q/K/V/O projections with optional QKV bias (Qwen2) and q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, *, rngs, qk_norm=None):
        dt = cfg.jnp_dtype
        D, H, K, E = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, E
        bias = cfg.qkv_bias
        self.q_proj = Linear(D, H * E, ("embed", "q_heads"), rngs=rngs, dtype=dt, bias=bias)
        self.k_proj = Linear(D, K * E, ("embed", "kv_heads"), rngs=rngs, dtype=dt, bias=bias)
        self.v_proj = Linear(D, K * E, ("embed", "kv_heads"), rngs=rngs, dtype=dt, bias=bias)
        self.o_proj = Linear(H * E, D, ("q_heads", "embed"), rngs=rngs, dtype=dt)
        use_qk_norm = cfg.qk_norm if qk_norm is None else qk_norm
        self.q_norm = RMSNorm(E, cfg.rms_norm_eps, dt, "head_dim") if use_qk_norm else None
        self.k_norm = RMSNorm(E, cfg.rms_norm_eps, dt, "head_dim") if use_qk_norm else None

    def project_q(self, x, positions, inv_freq):
        q = self.q_proj(x).reshape(*x.shape[:-1], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, positions, inv_freq)

    def project_kv(self, x, positions, inv_freq):
        k = self.k_proj(x).reshape(*x.shape[:-1], self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*x.shape[:-1], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, positions, inv_freq), v

    def project_out(self, o):
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: ModelConfig, *, rngs):
        dt = cfg.jnp_dtype
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(D, F, ("embed", "mlp"), rngs=rngs, dtype=dt)
        self.up_proj = Linear(D, F, ("embed", "mlp"), rngs=rngs, dtype=dt)
        self.down_proj = Linear(F, D, ("mlp", "embed"), rngs=rngs, dtype=dt)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
