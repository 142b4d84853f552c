"""The prefix schedulers as pure functions (`dspark_jax.decoding.scheduler`).

- `sync` on random confidences and random step-rate tables: with one bucket per token
  count it equals a plain-Python transcription of the paper's Algorithm 1 and reaches the
  exhaustive optimum over all length vectors whenever Θ is unimodal along the greedy order;
  with a few static buckets it equals a transcription of the same rule stepped bucket by
  bucket (open the next bucket iff it raises Θ with every new slot as good as the edge
  candidate; fill the bucket).
- Every policy returns prefixes within the caps, ignores inactive requests, breaks ties
  deterministically, and jits with the table as an argument (a new table compiles nothing).
Everything here is exact (no statistics); ~5 s.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding import scheduler as sch
from dspark_jax.decoding.scheduler import schedule


def algorithm1(conf, rate_of):
    """The paper's Algorithm 1, transcribed: candidates by survival descending; start from
    B = R, τ = R; admit one at a time; stop at the first admission that does not raise Θ."""
    conf = np.clip(np.asarray(conf, np.float64), 0.0, 1.0)
    R, G = conf.shape
    a = np.cumprod(conf, axis=1)
    cands = sorted(((a[r, j], j, r) for r in range(R) for j in range(G)), key=lambda t: (-t[0], t[1], t[2]))
    B, tau = R, float(R)
    best = tau * rate_of(B)
    ell = np.zeros(R, np.int64)
    margins = []  # relative margin of every comparison made
    for a_rj, _, r in cands:
        theta = (tau + a_rj) * rate_of(B + 1)
        margins.append((theta - best) / max(abs(theta), 1e-30))
        if not theta > best:
            break
        B, tau, best = B + 1, tau + a_rj, theta
        ell[r] += 1
    return ell, margins


def algorithm1_buckets(conf, buckets, rates):
    """Algorithm 1 over static buckets, transcribed: start in the bucket of the R anchors,
    filled; open the next one iff (τ + n_new · a_edge) · SPS_next > Θ; stop at the first
    that does not."""
    conf = np.clip(np.asarray(conf, np.float64), 0.0, 1.0)
    R, G = conf.shape
    a = np.cumprod(conf, axis=1)
    cands = sorted(((a[r, j], j, r) for r in range(R) for j in range(G)), key=lambda t: (-t[0], t[1], t[2]))
    M = len(cands)
    u = next(i for i, n in enumerate(buckets) if n >= R)
    n = min(buckets[u] - R, M)
    tau = R + sum(c[0] for c in cands[:n])
    theta = tau * rates[u]
    margins = []
    while u + 1 < len(buckets):
        n_next = min(buckets[u + 1] - R, M)
        if n_next == n:
            break
        est = (tau + (n_next - n) * cands[n][0]) * rates[u + 1]
        margins.append((est - theta) / max(abs(est), 1e-30))
        if not est > theta:
            break
        u, n = u + 1, n_next
        tau = R + sum(c[0] for c in cands[:n])
        theta = tau * rates[u]
    ell = np.zeros(R, np.int64)
    for _, _, r in cands[:n]:
        ell[r] += 1
    return ell, margins


def greedy_thetas(conf, rate_of):
    """Θ after admitting the first i candidates of the greedy order, i = 0..R·G."""
    a = np.cumprod(np.clip(np.asarray(conf, np.float64), 0, 1), axis=1)
    R, G = a.shape
    s = np.sort(a.ravel())[::-1]
    return np.array([(R + s[:i].sum()) * rate_of(R + i) for i in range(R * G + 1)])


def theta_of(conf, ell, rate_of):
    a = np.cumprod(np.clip(np.asarray(conf, np.float64), 0, 1), axis=1)
    R = a.shape[0]
    return (R + sum(a[r, : ell[r]].sum() for r in range(R))) * rate_of(R + int(np.sum(ell)))


def rate_fn(buckets, rates):
    def rate_of(B):
        for n, r in zip(buckets, rates):
            if B <= n:
                return float(np.float32(r))
        return 0.0

    return rate_of


def random_case(rng, R, G):
    conf = rng.uniform(0.0, 1.0, (R, G)).astype(np.float32)
    conf[rng.random((R, G)) < 0.2] = rng.uniform(0.9, 1.0)  # confident runs, like a trained drafter
    kind = rng.integers(3)
    if kind == 0:  # dense table, every B its own bucket
        buckets = tuple(range(1, R * (G + 1) + 1))
    else:  # a few static buckets covering R..R(G+1)
        inner = sorted(rng.choice(np.arange(R, R * (G + 1)), size=min(3, R * G), replace=False).tolist())
        buckets = tuple(sorted(set(inner + [R * (G + 1)])))
    if kind == 2:  # arbitrary (non-monotone) rates
        rates = rng.uniform(0.2, 1.0, len(buckets))
    else:  # decreasing with tokens, as profiled
        rates = np.sort(rng.uniform(0.2, 1.0, len(buckets)))[::-1]
    return conf, buckets, rates.astype(np.float32)


def near_tie(margins, tol=1e-5):
    """A comparison within float32 noise (fp32 vs fp64 may decide it either way)."""
    return np.any(np.abs(np.asarray(margins)) <= tol)


@pytest.mark.slow
def test_sync_equals_algorithm1_and_the_optimum_when_unimodal():
    rng = np.random.default_rng(0)
    checked = unimodal = 0
    for _ in range(300):
        R, G = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        conf, buckets, rates = random_case(rng, R, G)
        rate_of = rate_fn(buckets, rates)
        dense = len(buckets) == R * (G + 1) and buckets[0] == 1
        ref, margins = algorithm1(conf, rate_of) if dense else algorithm1_buckets(conf, buckets, rates)
        if near_tie(margins):
            continue  # fp32 vs fp64 could decide a tie differently; not a scheduling question
        table = {n: float(r) for n, r in zip(buckets, rates)} if dense else rates
        ell = np.asarray(schedule(conf, table, "sync", buckets=None if dense else buckets))
        np.testing.assert_array_equal(ell, ref, err_msg=f"conf={conf}, buckets={buckets}, rates={rates}")
        checked += 1
        if not dense:
            continue
        th = greedy_thetas(conf, rate_of)
        peak = int(np.argmax(th))
        if np.all(np.diff(th[: peak + 1]) > 0) and np.all(np.diff(th[peak:]) <= 0):
            best = max(theta_of(conf, e, rate_of) for e in itertools.product(range(G + 1), repeat=R))
            assert theta_of(conf, ell, rate_of) == pytest.approx(best, rel=1e-6), (conf, buckets, rates)
            unimodal += 1
    assert checked > 250 and unimodal > 50, (checked, unimodal)


def test_bucketed_sync_on_one_bucket_per_token_is_algorithm1():
    """The bucket-by-bucket rule is Algorithm 1 itself when every token count is a bucket."""
    rng = np.random.default_rng(2)
    for _ in range(50):
        conf, _, _ = random_case(rng, 3, 3)
        buckets = tuple(range(1, 13))
        rates = np.sort(rng.uniform(0.2, 1.0, 12))[::-1].astype(np.float32)
        a1, margins = algorithm1(conf, rate_fn(buckets, rates))
        ab, _ = algorithm1_buckets(conf, buckets, rates)
        if not near_tie(margins):
            np.testing.assert_array_equal(a1, ab)


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_sync_opens_a_coarse_bucket_that_pays_as_a_whole():
    """On a staircase, one candidate at a time would never leave the first bucket (5·0.8 ≤ 4);
    the bucket rule sees that four sure drafts pay for it together: (4 + 4)·0.8 > 4·1.0."""
    conf = np.ones((4, 2), np.float32)
    ell = schedule(conf, jnp.array([1.0, 0.8, 0.3]), "sync", buckets=(4, 8, 12))
    assert np.asarray(ell).tolist() == [1, 1, 1, 1]


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_sync_stops_early_on_a_multimodal_table():
    """The early exit is the point: Algorithm 1 does not look past the first non-improving
    admission, even when a larger batch would be better (that look-ahead would not be causal)."""
    conf = np.array([[0.5, 1.0]], np.float32)  # survival 0.5, 0.5
    table = {1: 1.0, 2: 0.6, 3: 0.55}  # Θ: 1.0, 0.9, 1.1
    assert np.asarray(schedule(conf, table, "sync")).tolist() == [0]


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_lengths_are_prefixes_within_caps_and_ties_are_deterministic():
    # Equal survival everywhere (c' = 1): position order breaks the ties, so prefixes result.
    conf = np.ones((3, 4), np.float32)
    table = {n: 1.0 for n in range(1, 16)}  # free tokens: admit everything available
    ell = schedule(conf, table, "sync", caps=jnp.array([4, 2, 0]), active=jnp.array([True, True, False]))
    assert np.asarray(ell).tolist() == [4, 2, 0]
    # A budget of 3 extra tokens among equal candidates: first positions first, then rows.
    ell = schedule(conf, jnp.ones(2), "async", buckets=(3, 6), prev_confidences=conf)
    assert np.asarray(ell).tolist() == [1, 1, 1]


@pytest.mark.parametrize("policy", ["sync", "async", "threshold", "fixed"])
def test_every_policy_gives_prefixes_of_decreasing_survival(policy):
    rng = np.random.default_rng(1)
    R, G = 6, 5
    for _ in range(20):
        conf = rng.uniform(0.3, 1.0, (R, G)).astype(np.float32)
        caps = rng.integers(0, G + 1, R)
        active = rng.random(R) < 0.8
        buckets = (R, R + 4, R + 12, R * (G + 1))
        rates = np.array([1.0, 0.9, 0.7, 0.5], np.float32)
        ell = np.asarray(schedule(conf, rates, policy, buckets=buckets, caps=caps, active=active, k=3,
                                  threshold=0.5, prev_confidences=conf, fill=True))
        assert np.all(ell <= np.minimum(caps, G)) and np.all(ell[~active] == 0)
        assert active.sum() + ell.sum() <= buckets[-1]
        # Admitted candidates all have survival ≥ every available candidate left out
        # (except for "fixed", which ignores confidences).
        if policy != "fixed":
            a = np.cumprod(conf, 1)
            avail = active[:, None] & (np.arange(G)[None] < caps[:, None])
            adm = np.arange(G)[None] < ell[:, None]
            if adm.any() and (avail & ~adm).any():
                assert a[adm].min() >= a[avail & ~adm].max()


def test_threshold_and_fixed():
    conf = np.array([[0.9, 0.9, 0.5], [0.4, 1.0, 1.0]], np.float32)  # survival .9 .81 .405 / .4 .4 .4
    assert np.asarray(schedule(conf, {8: 1.0}, "threshold", threshold=0.5)).tolist() == [2, 0]
    assert np.asarray(schedule(conf, {8: 1.0}, "threshold", threshold=0.4)).tolist() == [3, 3]
    assert np.asarray(schedule(conf, {8: 1.0}, "fixed", k=2, caps=jnp.array([1, 3]))).tolist() == [1, 2]
    # Fill: bucket 6 holds 2 anchors + 4 drafts, the threshold admitted 2 → 2 more, best first.
    ell = schedule(conf, jnp.array([1.0, 1.0]), "threshold", buckets=(6, 8), threshold=0.5, fill=True)
    assert np.asarray(ell).tolist() == [3, 1]


def test_async_budget_comes_from_the_previous_confidences():
    R, G = 4, 3
    buckets = (4, 8, 16)
    rates = jnp.array([1.0, 0.8, 0.5])
    good = jnp.full((R, G), 0.95)
    bad = jnp.full((R, G), 0.05)
    active, caps = jnp.ones(R, bool), jnp.full(R, G)
    # Confident history: the largest bucket wins ((4 + 4·(.95+.90+.86))·.5 > (4 + 4·.95)·.8).
    assert int(sch.async_budget(good, active, caps, rates, buckets)) == 2
    # Useless drafter: not drafting (rate 1.2 without the draft model) beats every bucket.
    assert int(sch.async_budget(bad, active, caps, rates, buckets, skip_rate=1.2)) == -1
    # A static batch waits for its slowest request: with half the slots hopeless, drafting
    # for the other half is worth tokens/s but not time to the end of the batch.
    mixed = jnp.where(jnp.arange(R)[:, None] < 2, good, bad)
    assert int(sch.async_budget(mixed, active, caps, rates, buckets, skip_rate=1.0)) == 1  # (4 + 3.7)·.8 > 4
    assert int(sch.async_budget(mixed, active, caps, rates, buckets, skip_rate=1.0, critical_S=active)) == -1
    # ... unless the hopeless ones are not the last to finish: then it is worth it again.
    ahead = jnp.arange(R) < 2
    u = int(sch.async_budget(mixed, active, jnp.where(ahead, caps, 0), rates, buckets, skip_rate=1.0,
                             critical_S=ahead))
    assert u >= 0
    # With every slot critical and equally confident it is the throughput objective.
    for conf in (good, bad, jnp.full((R, G), 0.6)):
        assert int(sch.async_budget(conf, active, caps, rates, buckets, skip_rate=0.9, critical_S=active)) == int(
            sch.async_budget(conf, active, caps, rates, buckets, skip_rate=0.9))
    # The current confidences choose *which* candidates, never how many.
    cur = jnp.array([[0.1, 0.1, 0.1], [0.99, 0.99, 0.99], [0.5, 0.5, 0.5], [0.2, 0.2, 0.2]])
    ell = np.asarray(schedule(cur, rates, "async", buckets=buckets, prev_confidences=bad))
    assert ell.tolist() == [0, 0, 0, 0]  # the smallest bucket: anchors only
    ell = np.asarray(schedule(cur, rates, "async", buckets=buckets, prev_confidences=good))
    assert ell.tolist() == [3, 3, 3, 3]  # bucket 16: 4 anchors + 12 drafts
    ell = np.asarray(schedule(cur, rates, "async", buckets=buckets, prev_confidences=good, skip_rate=10.0))
    assert ell.tolist() == [0, 0, 0, 0]  # 4 anchors at 10 steps/s beat every bucket: no drafting
    with pytest.raises(ValueError, match="prev_confidences"):
        schedule(cur, rates, "async", buckets=buckets)


def test_jitted_with_the_table_as_an_argument_compiles_once():
    conf = jax.random.uniform(jax.random.key(0), (4, 3))
    f = jax.jit(lambda c, r: schedule(c, r, "sync", buckets=(4, 8, 12, 16)))
    f(conf, jnp.array([1.0, 0.9, 0.8, 0.7]))
    f(conf, jnp.array([1.0, 0.5, 0.4, 0.3]))
    assert f._cache_size() == 1


def test_errors_say_what_was_wrong():
    conf = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="policy must be one of"):
        schedule(conf, {4: 1.0}, "best")
    with pytest.raises(ValueError, match="needs k"):
        schedule(conf, {4: 1.0}, "fixed")
    with pytest.raises(ValueError, match="2 buckets"):
        schedule(conf, jnp.ones(3), "sync", buckets=(2, 4))
    with pytest.raises(ValueError, match="strictly increasing"):
        schedule(conf, jnp.ones(2), "sync", buckets=(4, 2))
    with pytest.raises(ValueError, match="empty"):
        schedule(conf, {}, "sync")


def test_narrow_bucket_widths_cap_the_drafts_a_slot_and_pick_a_bucket_that_holds_them():
    # 4 slots, K = 3, buckets of 4 / 8 / 12 / 16 tokens with query widths 2 / 3 / 4 / 4.
    buckets, widths = (4, 8, 12, 16), (2, 3, 4, 4)
    conf = jnp.asarray([[1.0, 1.0, 1.0], [0.9, 0.9, 0.9], [0.2, 0.2, 0.2], [0.1, 0.1, 0.1]])
    active, caps = jnp.ones((4,), bool), jnp.full((4,), 3, jnp.int32)
    a = np.cumprod(np.asarray(conf), 1)
    *_, expected, admitted = sch.expected_accepted(conf, active, caps, buckets)
    *_, exp_w, adm_w = sch.expected_accepted(conf, active, caps, buckets, widths)
    # Bucket 8 holds 4 drafts: the best 4 overall are slot 0's 3 and slot 1's first; at width 3
    # (2 drafts a slot) they are slots 0 and 1's first two.
    np.testing.assert_allclose(expected[1], a[0].sum() + a[1, 0], rtol=1e-6)
    np.testing.assert_allclose(exp_w[1], a[0, :2].sum() + a[1, :2].sum(), rtol=1e-6)
    assert float(exp_w[0]) == 0.0 and np.allclose(exp_w[2:], expected[2:])  # width K + 1: uncapped
    assert int(jnp.sum(adm_w[1])) == 4 and int(jnp.sum(admitted[1])) == 4
    # A table under which bucket 8 wins: the async budget picks it and admits ≤ 2 drafts a slot.
    rates = jnp.asarray([1.0, 0.99, 0.5, 0.4])
    u = sch.async_budget(conf, active, caps, rates, buckets, widths=widths)
    assert int(u) == 1
    ell, v = sch.schedule_lengths(conf, "async", rates, buckets, active_S=active, caps_S=caps, k=3,
                                  threshold=0.0, bucket_u=u, fill=True, widths=widths)
    assert ell.tolist() == [2, 2, 0, 0] and int(v) == 1
    # Any policy's lengths land in a bucket wide enough for the longest: 3 drafts need width 4.
    ell, v = sch.schedule_lengths(conf, "threshold", rates, buckets, active_S=active, caps_S=caps, k=3,
                                  threshold=0.5, bucket_u=jnp.int32(0), fill=False, widths=widths)
    assert ell.tolist() == [3, 3, 0, 0] and int(v) == 2  # 10 tokens: bucket 12 (width 4)
    assert int(sch.bucket_for(5, 3, buckets, widths)) == 2 and int(sch.bucket_for(5, 1, buckets, widths)) == 1
    assert int(sch.bucket_for(5, 3, buckets)) == 1
