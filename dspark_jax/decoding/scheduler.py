"""Confidence-scheduled verification lengths (lossless prefix schedulers).

Shape letters (docs/architecture.md, "Shape letters"): S requests (slots), G draft positions γ, C = S·G
candidates (request, draft position), U buckets.

Every scheduler maps calibrated per-position conditional confidences c′ [S, G] to
verification lengths ℓ [S] (a prefix of each request's drafts). The survival
a_{r,j} = Π_{i≤j} c′_{r,i} is the probability that draft j of request r is accepted; a step
verifying N = S + Σℓ packed tokens yields τ = S + Σ_{admitted} a tokens in expectation and
runs at SPS(B) steps/s, so tokens/s is Θ = τ · SPS(B).

Why these rules are lossless: a rule may decide whether draft (r, j) is verified from
anything except draft j's own realisation and later drafts of request r. Survival a_{r,j}
depends on x_{r,<j} only (c′_j is produced before x_j is sampled), and a_{r,j+1} ≤ a_{r,j};
so with ties broken by position first, every candidate ranked above (r, j) in the global
order is either an earlier draft of request r or a draft of another (independent) request.
Algorithm 1 decides (r, j) from candidates ranked at or above it (the early exit stops
*before* looking further), and a top-K with K fixed beforehand does too. A search that looks
at all prefixes and keeps the best one is NOT lossless: whether (r, j) is worth verifying
then depends on a_{r,j+1}, i.e. on x_{r,j} itself (paper Appendix A).

Static buckets: SPS is a table over packed-token buckets N_0 < … < N_{U−1}; a step of B
tokens runs in the smallest bucket N ≥ B and costs that bucket's rate. "sync" therefore
walks the greedy order bucket by bucket (`_sync_count`), and in the decode loop every
confidence policy fills the free slots of its bucket with the next-best candidates: this
stays causal because the bucket depends only on candidates ranked above any candidate it
admits extra (for the threshold rule: on candidates above the threshold, which rank above
every candidate below it).

All functions are pure and jit-friendly; Python-level knobs (policy, buckets, k) are static.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

# The schedules a decode cycle runs: what `DecodeConfig`'s user-facing policy (+ scheduler)
# resolves to (`DecodeConfig.loop_schedule`), and what `schedule(policy=...)` takes.
SCHEDULES = ("sync", "async", "threshold", "fixed")


def survival(conf_SG: jax.Array) -> jax.Array:
    """a_{r,j} = Π_{i≤j} c′_{r,i}, with c′ clipped to [0, 1] so a is non-increasing in j
    (rounding x·c with c ≤ 1 never exceeds x, so the float product is monotone too)."""
    return jnp.cumprod(jnp.clip(conf_SG.astype(jnp.float32), 0.0, 1.0), axis=1)


def _rank_order(a_SG, avail_SG):
    """Candidate order: survival descending, unavailable last; ties by position j, then r.

    Flattening j-major and sorting stably puts (r, j) before (r, j+1) on ties (c′ = 1), so
    the sorted order always admits prefixes. Returns (order [M] into the j-major flat
    index, sorted survival [M], sorted availability [M])."""
    a_C = jnp.where(avail_SG, a_SG, -1.0).T.reshape(-1)
    order = jnp.argsort(-a_C, stable=True)
    return order, a_C[order], (a_C >= 0)[order]


def _lengths_from_count(order_C, n_admit, shape_SG):
    """ℓ_r of admitting the first `n_admit` candidates in `order` (a prefix per request)."""
    S, G = shape_SG
    admitted_C = jnp.zeros(order_C.shape, bool).at[order_C].set(jnp.arange(order_C.shape[0]) < n_admit)
    adm_SG = admitted_C.reshape(G, S).T
    # Leading run, not the count: robust even if a caller's availability mask had holes.
    return jnp.sum(jnp.cumprod(adm_SG.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def bucket_index(N, buckets: Sequence[int]):
    """Index of the smallest bucket holding N tokens (len(buckets) when none does)."""
    return jnp.searchsorted(jnp.asarray(buckets, jnp.int32), N, side="left")


def rate_at(N, rates_U, buckets: Sequence[int]):
    """SPS(N): the rate of the bucket N runs in; 0 above the largest bucket (impossible)."""
    u = bucket_index(N, buckets)
    return jnp.where(u < len(buckets), rates_U[jnp.minimum(u, len(buckets) - 1)], 0.0)


def _sync_count(a_sorted_C, avail_sorted_C, S, rates_U, buckets):
    """Algorithm 1 over static buckets, vectorised. Returns the number of candidates admitted.

    Start in the smallest bucket holding the S anchors, filled with the best candidates
    (free: the step costs the same). Open the next bucket only if it raises Θ even
    optimistically — every new slot as good as the best candidate left, the one at the
    bucket edge — and stop at the first bucket that does not. Each decision reads the
    candidates ranked above the edge plus the edge candidate itself, so it is causal. With
    one bucket per token count this is exactly Algorithm 1 (each new "bucket" holds just
    the edge candidate). Admitting one candidate at a time on a staircase instead would
    stall at every edge: one candidate rarely pays for a whole bucket's extra cost."""
    M = a_sorted_C.shape[0]
    U = len(buckets)
    n_avail = jnp.sum(avail_sorted_C)
    n_U = jnp.clip(jnp.asarray(buckets, jnp.int32) - S, 0, n_avail)  # candidates bucket u holds
    csum = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.where(avail_sorted_C, a_sorted_C, 0.0))])
    rates_U = jnp.asarray(rates_U, jnp.float32)
    theta_fill = (S + csum[n_U]) * rates_U
    prev_n = jnp.concatenate([jnp.zeros((1,), jnp.int32), n_U[:-1]])
    a_edge = jnp.where(prev_n < n_avail, a_sorted_C[jnp.clip(prev_n, 0, M - 1)], 0.0)
    theta_est = (S + csum[prev_n] + (n_U - prev_n) * a_edge) * rates_U
    prev_theta = jnp.concatenate([jnp.full((1,), -jnp.inf), theta_fill[:-1]])
    u0 = bucket_index(S, buckets)
    u = jnp.arange(U)
    opens = (u <= u0) | ((theta_est > prev_theta) & (n_U > prev_n))
    u_star = jnp.clip(jnp.sum(jnp.cumprod(opens.astype(jnp.int32))) - 1, 0, U - 1)
    return n_U[u_star]


def _fill_count(n_admit, avail_sorted_C, S, buckets):
    """Admits the next-best candidates up to the capacity of the bucket already chosen."""
    u = jnp.minimum(bucket_index(S + n_admit, buckets), len(buckets) - 1)
    cap = jnp.asarray(buckets, jnp.int32)[u] - S
    return jnp.clip(cap, n_admit, jnp.sum(avail_sorted_C))


def check_widths(widths: Sequence[int], buckets: Sequence[int], num_draft: int) -> None:
    """Query widths must give each bucket a non-decreasing width in [1, K + 1], the largest
    K + 1 (so every schedule fits some bucket)."""
    w = list(widths)
    if len(w) != len(buckets) or w != sorted(w) or w[0] < 1 or w[-1] != num_draft + 1:
        raise ValueError(f"bucket_widths {tuple(w)} must give each of the buckets {tuple(buckets)} a non-decreasing "
                         f"query width in [1, {num_draft + 1}], the largest {num_draft + 1} (K + 1)")


def bucket_for(N, max_len, buckets: Sequence[int], widths: Sequence[int] | None = None):
    """Index of the smallest bucket holding N packed tokens and, with query `widths` (each
    bucket's tokens per slot, non-decreasing), a slot's `max_len` drafts (len(buckets) when none does)."""
    u = bucket_index(N, buckets)
    if widths is None:
        return u
    return jnp.maximum(u, jnp.searchsorted(jnp.asarray(widths, jnp.int32) - 1, max_len, side="left"))


def expected_accepted(prev_conf_SG, active_S, caps_S, buckets: Sequence[int], widths: Sequence[int] | None = None):
    """What each bucket is expected to accept: (survival [S, G], availability [S, G], candidate
    order, running slots S, candidates n_u bucket u holds, expected_U = Σ of the n_u best
    predicted survivals, admitted [U, M] in the j-major flat order). The async budget's Θ_u is
    (S + expected_U) · SPS_u. With query `widths`, bucket u admits at most widths[u] − 1 drafts
    a slot: its n_u best among those."""
    a_pred = survival(prev_conf_SG)
    G = a_pred.shape[1]
    avail = active_S[:, None] & (jnp.arange(G)[None] < caps_S[:, None])
    order, a_sorted, avail_sorted = _rank_order(a_pred, avail)
    S = jnp.sum(active_S).astype(jnp.int32)
    M = a_sorted.shape[0]
    n_u = jnp.clip(jnp.asarray(buckets, jnp.int32) - S, 0, M)
    if widths is None:  # bucket u admits the n_u best candidates
        csum = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.where(avail_sorted, a_sorted, 0.0))])
        expected_U = csum[n_u]
        adm_UM = jnp.arange(M)[None] < n_u[:, None]
    else:  # the n_u best of those at positions below the bucket's width
        j_sorted = order // a_pred.shape[0]  # the draft position of each sorted candidate (j-major flat)
        ok_UM = avail_sorted[None] & (j_sorted[None] < jnp.asarray(widths, jnp.int32)[:, None] - 1)
        adm_UM = ok_UM & (jnp.cumsum(ok_UM, axis=1) <= n_u[:, None])
        expected_U = jnp.sum(jnp.where(adm_UM, a_sorted[None], 0.0), axis=1)
    admitted_UM = jnp.zeros((len(buckets), M), bool).at[:, order].set(adm_UM)
    return a_pred, avail, order, S, n_u, expected_U, admitted_UM


def async_budget(prev_conf_SG, active_S, caps_S, rates_U, buckets: Sequence[int], skip_rate=None,
                 critical_S=None, widths: Sequence[int] | None = None):
    """The bucket for this step from *earlier* confidences (never this step's drafts).

    Unconstrained search over the buckets: Θ_u = (S + top-(N_u − S) predicted survival) ·
    SPS_u. With `skip_rate` (the rate of a step that does not draft at all), returns −1
    when skipping drafting beats every bucket: a useless drafter then costs nothing.

    With `critical_S` (a static batch that ends with its slowest request: the slots that
    could be the last to finish), a step's worth is the progress of the slowest critical
    slot, not the batch's sum: Θ_u = S · min over critical r of (1 + Σ admitted a_r) · SPS_u
    (the same units as S · skip_rate). Drafting that speeds up some requests while the
    batch waits for the others is then worth nothing; with one slot it is the same objective.
    """
    a_pred, avail, order, S, n_u, expected_U, admitted_UM = expected_accepted(prev_conf_SG, active_S, caps_S,
                                                                               buckets, widths)
    S_all, G = a_pred.shape
    fits = jnp.asarray(buckets, jnp.int32) >= S
    if critical_S is None:
        worth_U = S + expected_U
    else:
        # Each slot's expected progress when bucket u admits the first n_u candidates.
        a_C = jnp.where(avail, a_pred, 0.0).T.reshape(-1)  # j-major flat
        gain_US = jnp.where(admitted_UM, a_C[None], 0.0).reshape(len(buckets), G, S_all).sum(1)
        slowest_U = jnp.min(jnp.where(critical_S[None], 1.0 + gain_US, jnp.inf), axis=1)
        worth_U = S * jnp.where(jnp.any(critical_S), slowest_U, 1.0)
    theta_U = jnp.where(fits, worth_U * jnp.asarray(rates_U, jnp.float32), -1.0)
    u = jnp.argmax(theta_U).astype(jnp.int32)  # first maximum: the smallest such bucket
    if skip_rate is not None:
        u = jnp.where(S * jnp.asarray(skip_rate, jnp.float32) >= theta_U[u], -1, u)
    return u


def schedule_lengths(conf_SG, policy: str, rates_U, buckets, *, active_S, caps_S, k, threshold,
                     bucket_u, fill: bool, widths: Sequence[int] | None = None):
    """(ℓ [S], bucket index) for the given policy (the in-loop form of `schedule`; all
    arguments already arrays/static, `bucket_u` the async budget). With query `widths` (each
    bucket's tokens a slot), the async budget's bucket admits at most its width − 1 drafts a
    slot, and the returned bucket is the smallest that holds both the tokens and the longest ℓ."""
    R_all, G = conf_SG.shape
    if widths is not None and policy == "async":
        caps_S = jnp.minimum(caps_S, jnp.asarray(widths, jnp.int32)[jnp.maximum(bucket_u, 0)] - 1)
    a = survival(conf_SG)
    avail = active_S[:, None] & (jnp.arange(G)[None] < caps_S[:, None])
    S = jnp.sum(active_S).astype(jnp.int32)
    if policy == "fixed":
        ell = jnp.where(active_S, jnp.minimum(k, caps_S), 0).astype(jnp.int32)
        return ell, bucket_for(S + jnp.sum(ell), jnp.max(ell), buckets, widths)
    order, a_sorted, avail_sorted = _rank_order(a, avail)
    if policy == "sync":
        n = _sync_count(a_sorted, avail_sorted, S, rates_U, buckets)
    elif policy == "threshold":
        n = jnp.sum(avail_sorted & (a_sorted >= threshold))
    elif policy == "async":
        n = jnp.clip(jnp.asarray(buckets, jnp.int32)[jnp.maximum(bucket_u, 0)] - S, 0, None)
        n = jnp.where(bucket_u < 0, 0, jnp.minimum(n, jnp.sum(avail_sorted)))
    else:
        raise ValueError(f"policy must be one of {SCHEDULES}, got {policy!r}")
    if fill and policy == "threshold":  # sync and async fill their bucket by construction
        n = _fill_count(n, avail_sorted, S, buckets)
    ell = _lengths_from_count(order, n, (R_all, G))
    # The smallest bucket holding what was admitted: below the async budget when fewer
    # candidates exist (the cost changes, the output distribution cannot).
    return ell, bucket_for(S + jnp.sum(ell), jnp.max(ell), buckets, widths)


def as_table(sps, num_buckets_hint: int | None = None) -> tuple[tuple[int, ...], jax.Array]:
    """(buckets, rates [U]) from a mapping {packed tokens: steps/s} or a dense array.

    A dense array `sps[i]` is the rate at i + 1 packed tokens (every B its own bucket)."""
    if isinstance(sps, Mapping):
        if not sps:
            raise ValueError("the step-rate mapping is empty; it needs {packed tokens: steps/s} entries")
        items = sorted((int(n), float(r)) for n, r in sps.items())
        if items[0][0] < 1:
            raise ValueError(f"bucket sizes must be >= 1 packed token, got {items[0][0]}")
        return tuple(n for n, _ in items), jnp.asarray([r for _, r in items], jnp.float32)
    rates = jnp.asarray(sps, jnp.float32)
    if rates.ndim != 1:
        raise ValueError(f"a step-rate array must be 1-D over buckets, got shape {rates.shape}")
    return tuple(range(1, rates.shape[0] + 1)), rates


def schedule(
    confidences: jax.Array,  # [S, G]
    sps,
    policy: str = "sync",
    *,
    buckets: Sequence[int] | None = None,
    prev_confidences: jax.Array | None = None,  # [S, G]
    k: int | None = None,
    threshold: float | None = None,
    active: jax.Array | None = None,  # [S] bool
    caps: jax.Array | None = None,  # [S] int
    fill: bool = False,
    skip_rate: float | None = None,
) -> jax.Array:
    """Verification lengths ℓ [S] from calibrated confidences c′ [S, G].

    sps: the step-rate table — a mapping {packed tokens: steps/s}, or an array of rates over
      `buckets` (ascending packed-token sizes; without `buckets`, sps[i] is the rate at i + 1
      tokens). A step of N = S + Σℓ tokens costs the rate of the smallest bucket ≥ N.
    policy: "sync" (paper Algorithm 1, over static buckets: see `_sync_count`), "async"
      (budget from `prev_confidences`, the confidences of an earlier step, then top-K by
      current survival), "threshold" (ℓ_r = #{j: a_{r,j} ≥ threshold}), "fixed" (ℓ_r = k).
    active [S] bool: requests taking part (others get 0 and do not count in N).
    caps [S]: the most drafts each request may verify (default G).
    skip_rate: "async": steps/s of a step that does not draft; when that beats every bucket
      the budget is 0 and every length is 0 (in the decode loop the drafter then does not run).
    fill: "threshold" admits next-best candidates into the chosen bucket's free slots
      (causal; see above). "sync" and "async" always fill the bucket they choose.
    """
    conf = jnp.asarray(confidences, jnp.float32)
    if conf.ndim != 2:
        raise ValueError(f"confidences must be [S, G], got shape {conf.shape}")
    S, G = conf.shape
    if buckets is None:
        buckets, rates = as_table(sps)
    else:
        buckets = tuple(int(b) for b in buckets)
        rates = jnp.asarray(sps, jnp.float32)
        if rates.shape != (len(buckets),):
            raise ValueError(f"sps has shape {rates.shape} but there are {len(buckets)} buckets")
    if list(buckets) != sorted(set(buckets)):
        raise ValueError(f"buckets must be strictly increasing, got {buckets}")
    active = jnp.ones((S,), bool) if active is None else jnp.asarray(active, bool)
    caps = jnp.full((S,), G, jnp.int32) if caps is None else jnp.clip(jnp.asarray(caps, jnp.int32), 0, G)
    bucket_u = jnp.int32(0)
    if policy == "fixed":
        if k is None or not 0 <= k <= G:
            raise ValueError(f"policy='fixed' needs k in [0, {G}], got {k}")
    elif policy == "threshold":
        if threshold is None or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"policy='threshold' needs threshold in [0, 1], got {threshold}")
    elif policy == "async":
        if prev_confidences is None:
            raise ValueError("policy='async' needs prev_confidences (an earlier step's confidences); "
                             "using this step's own would not be the async rule")
        bucket_u = async_budget(jnp.asarray(prev_confidences, jnp.float32), active, caps, rates, buckets,
                                skip_rate=skip_rate)
    elif policy not in SCHEDULES:
        raise ValueError(f"policy must be one of {SCHEDULES}, got {policy!r}")
    ell, _ = schedule_lengths(conf, policy, rates, buckets, active_S=active, caps_S=caps, k=k or 0,
                      threshold=threshold or 0.0, bucket_u=bucket_u, fill=fill)

    return ell

