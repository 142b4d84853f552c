"""Lossless verification (docs/method.md §4-5): direct, vectorised calls of `verify`.

Each statistical test runs the rule on R = 200 000 independent rows (one PRNG key per row)
over a 6-token vocabulary, with a fixed target and a deliberately poor draft, and compares
the emitted tokens with the *exact* transformed target distribution (float64 NumPy
reference, `spec_helpers.ref_probs`) by Pearson's chi-square.

False-failure rates. Every "must pass" chi-square asserts p > P_PASS = 1e-4 and every
acceptance-rate check allows 5σ (two-sided rate 6e-7). For a correct implementation and a
fresh seed a test would therefore fail with probability ≤ 1e-4 per statistic; this file
checks 22 chi-squares and 10 acceptance rates, so ≤ 2.2e-3 for the whole file. The seeds
are fixed, so in practice the outcome is deterministic: a failure means the output changed,
not bad luck.
Negative controls (known-wrong rules) must give p < P_REJECT = 1e-6; at R = 200 000 their
biases give p-values that underflow to ~0, so this is not a close call either.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import chi2_pvalue, counts, joint_counts, ref_probs, sample_rows

from dspark_jax.decoding.sampling import SamplingArrays, transform_logits
from dspark_jax.decoding.verification import verify

V = 6
R = 200_000  # rows per call; every call uses this shape (one compile per K and flag set)
K = 2
P_PASS = 1e-4
P_REJECT = 1e-6
SIGMAS = 5.0

# Target: position-1 logits (after the anchor) and the table of next-token logits given the
# previous token. The draft is a poor, different model of the same two things.
T0 = np.array([2.0, 1.0, 0.3, -0.5, 0.8, -1.5], np.float32)
D0 = np.array([-1.0, 1.2, 1.5, 1.0, -0.5, 0.8], np.float32)
_rng = np.random.default_rng(1234)
TABLE = _rng.normal(0.0, 1.3, (V, V)).astype(np.float32)  # TABLE[a] = target logits after a
DTABLE = _rng.normal(0.0, 1.3, (V, V)).astype(np.float32)  # draft logits after a

SAMPLING = {
    "t1": dict(temperature=1.0),
    "t0.7": dict(temperature=0.7),
    "topk3": dict(temperature=1.0, top_k=3),
    "topp0.75": dict(temperature=0.8, top_p=0.75),
    "minp0.15": dict(temperature=1.0, min_p=0.15),
}

_verify = jax.jit(verify)


def make_sa(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, filters=None) -> SamplingArrays:
    """The same sampling parameters for n rows (array-valued arguments: per row).

    The static `use_*` flags are all on when any row filters (or when `filters=True`): rows
    with neutral values (top_k 0, top_p 1, min_p 0) are unaffected, and sharing one flag set
    keeps this file at three compiled programs (each compile costs several seconds on CPU).
    """
    t = np.broadcast_to(np.asarray(temperature, np.float32), (n,))
    k = np.broadcast_to(np.asarray(top_k, np.int32), (n,))
    p = np.broadcast_to(np.asarray(top_p, np.float32), (n,))
    m = np.broadcast_to(np.asarray(min_p, np.float32), (n,))
    if filters is None:
        filters = bool(np.any((k > 0) | (p < 1) | (m > 0)))
    return SamplingArrays(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p), jnp.asarray(m),
                          use_top_k=filters, use_top_p=filters, use_min_p=filters)


def row_keys(n, seed):
    return jax.random.split(jax.random.key(seed), n)


def log(p):
    with np.errstate(divide="ignore"):
        return np.log(p).astype(np.float32)


def run(keys, draft_tokens, draft_logits, target_logits, num_verify, sa):
    acc, em = _verify(keys, jnp.asarray(draft_tokens, jnp.int32), jnp.asarray(draft_logits, jnp.float32),
                      jnp.asarray(target_logits, jnp.float32), jnp.asarray(num_verify, jnp.int32), sa)
    return np.asarray(acc), np.asarray(em)


def check_layout(acc, em, num_verify, drafts):
    """The documented output layout: accepted drafts, one correction/bonus, then -1."""
    K = drafts.shape[1]
    assert np.all((acc >= 0) & (acc <= num_verify))
    j = np.arange(K + 1)[None]
    d = np.concatenate([drafts, np.zeros((len(acc), 1), np.int32)], 1)
    assert np.array_equal(np.where(j < acc[:, None], em, 0), np.where(j < acc[:, None], d, 0))
    assert np.all(np.where(j > acc[:, None], em, -1) == -1)
    last = em[np.arange(len(acc)), acc]
    assert np.all((last >= 0) & (last < V))


def two_tokens(sp, seed, num_verify=None, corrupt=None):
    """First two emitted tokens of a speculative decode with K = 2 drafts per cycle.

    Cycle 1 drafts d1 ~ p_d(·), d2 ~ p_d(·|d1); the target logits are T0 at position 0 and
    TABLE[d_k] at position k (the context the target saw). If cycle 1 emits only one token
    (a rejection of d1, or num_verify = 0), cycle 2 runs from the new anchor x1 exactly as the
    engine would: fresh drafts from p_d(·|x1), target logits TABLE[x1], TABLE[e1], TABLE[e2].
    `corrupt(draft_logits)` may poison cycle 1's draft logits.
    Returns (x1, x2, accepted in cycle 1, num_verify).
    """
    rng = np.random.default_rng(seed)
    pd0, pdt = ref_probs(D0, **sp), ref_probs(DTABLE, **sp)
    d1 = sample_rows(rng, np.broadcast_to(pd0, (R, V)))
    d2 = sample_rows(rng, pdt[d1])
    drafts = np.stack([d1, d2], 1)
    dlog = np.stack([np.broadcast_to(log(pd0), (R, V)), log(pdt[d1])], 1)
    if corrupt is not None:
        dlog = corrupt(dlog)
    tgt = np.stack([np.broadcast_to(T0, (R, V)), TABLE[d1], TABLE[d2]], 1)
    nv = np.full(R, 2, np.int32) if num_verify is None else num_verify
    sa = make_sa(R, **sp)
    acc, em = run(row_keys(R, seed), drafts, dlog, tgt, nv, sa)
    check_layout(acc, em, nv, drafts)
    x1 = em[:, 0]
    e1 = sample_rows(rng, pdt[x1])
    e2 = sample_rows(rng, pdt[e1])
    acc2, em2 = run(row_keys(R, seed + 1), np.stack([e1, e2], 1),
                    np.stack([log(pdt[x1]), log(pdt[e1])], 1),
                    np.stack([TABLE[x1], TABLE[e1], TABLE[e2]], 1), np.full(R, 2, np.int32), sa)
    x2 = np.where(acc >= 1, em[:, 1], em2[:, 0])
    return x1, x2, acc, nv


def exact_joint(sp):
    return ref_probs(T0, **sp)[:, None] * ref_probs(TABLE, **sp)


def assert_binomial(k, n, p):
    sd = np.sqrt(p * (1 - p) / n)
    assert abs(k / n - p) <= SIGMAS * sd, f"empirical {k / n:.5f}, exact {p:.5f} ± {SIGMAS * sd:.5f} (5σ)"


def test_reference_thresholds_are_not_borderline():
    """The top-p / min-p cut-offs of every distribution used here sit far from the threshold,
    so float32 (library) and float64 (reference) agree on the kept set."""
    for sp in SAMPLING.values():
        for logits in np.concatenate([T0[None], D0[None], TABLE, DTABLE]):
            x = logits.astype(np.float64) / sp["temperature"]
            p = np.exp(x - x.max())
            p /= p.sum()
            if sp.get("top_p", 1.0) < 1.0:
                q = np.sort(p)[::-1]
                if sp.get("top_k"):
                    q = q[: sp["top_k"]] / q[: sp["top_k"]].sum()
                before = np.cumsum(q) - q
                assert np.min(np.abs(before - sp["top_p"])) > 1e-3
            if sp.get("min_p", 0.0) > 0:
                assert np.min(np.abs(p / p.max() - sp["min_p"])) > 1e-3


# --------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("name", list(SAMPLING))
def test_first_two_tokens_follow_target(name):
    sp = SAMPLING[name]
    x1, x2, acc, _ = two_tokens(sp, seed=10)
    joint = exact_joint(sp)
    assert chi2_pvalue(counts(x1, V), joint.sum(1)) > P_PASS
    assert chi2_pvalue(joint_counts(x1, x2, V), joint) > P_PASS
    # P(d1 accepted) = Σ min(p_t, p_d) = 1 − TV(p_t, p_d); P(d1, d2 accepted) likewise.
    pt0, pd0 = ref_probs(T0, **sp), ref_probs(D0, **sp)
    ptab, pdt = ref_probs(TABLE, **sp), ref_probs(DTABLE, **sp)
    a1 = np.minimum(pt0, pd0)
    assert_binomial(np.sum(acc >= 1), R, a1.sum())
    assert_binomial(np.sum(acc >= 2), R, float(a1 @ np.minimum(ptab, pdt).sum(1)))
    # The draft really is poor (rejections are the common case) but not useless.
    assert 0.15 < a1.sum() < 0.6


def test_lossless_with_per_row_num_verify():
    """Any per-row number of verified drafts (chosen independently of the drafts) is lossless."""
    sp = SAMPLING["t0.7"]
    nv = np.random.default_rng(5).integers(0, 3, R).astype(np.int32)
    x1, x2, acc, _ = two_tokens(sp, seed=20, num_verify=nv)
    joint = exact_joint(sp)
    assert chi2_pvalue(joint_counts(x1, x2, V), joint) > P_PASS
    assert np.all(acc[nv == 0] == 0) and np.all(acc[nv == 1] <= 1)


# --------------------------------------------------------------------------- negative controls


def first_token_rule(rng, pt, pd, bug=None):
    """Our own NumPy version of one verification step (K = 1), optionally with a known bug."""
    d = sample_rows(rng, np.broadcast_to(pd, (R, V)))
    u = rng.random(R)
    if bug == "inverted_ratio":
        acc = u < np.minimum(1.0, pd[d] / pt[d])
    else:
        acc = u * pd[d] < pt[d]
    resid = np.maximum(pt - pd, 0.0)
    corr = pt if bug == "resample_from_target" else resid / resid.sum()
    return np.where(acc, d, sample_rows(rng, np.broadcast_to(corr, (R, V))))


@pytest.mark.parametrize("bug", [None, "resample_from_target", "inverted_ratio", "temperature_on_draft_only"])
def test_statistic_rejects_known_wrong_rules(bug):
    """The chi-square used above has the power to see each classic mistake (and accepts the
    correct rule in the same harness)."""
    rng = np.random.default_rng(30)
    sp = SAMPLING["t0.7"]
    want = ref_probs(T0, **sp)
    pd = ref_probs(D0, **sp)
    # The temperature bug: the draft is tempered but verification uses the raw target.
    pt = ref_probs(T0, temperature=1.0) if bug == "temperature_on_draft_only" else want
    x = first_token_rule(rng, pt, pd, None if bug == "temperature_on_draft_only" else bug)
    p = chi2_pvalue(counts(x, V), want)
    if bug is None:
        assert p > P_PASS
    else:
        assert p < P_REJECT, f"{bug}: p = {p}"


# --------------------------------------------------------------------------- greedy


def test_greedy_accepts_prefix_matching_argmax():
    rng = np.random.default_rng(40)
    tgt = rng.normal(0, 2, (R, K + 1, V)).astype(np.float32)
    am = tgt.argmax(-1)
    drafts = np.where(rng.random((R, K)) < 0.7, am[:, :K], rng.integers(0, V, (R, K))).astype(np.int32)
    nv = rng.integers(0, K + 1, R).astype(np.int32)
    # Draft logits are irrelevant to greedy rows: give them garbage, NaNs included.
    dlog = rng.normal(0, 5, (R, K, V)).astype(np.float32)
    dlog[::7, :, 2] = np.nan
    acc, em = run(row_keys(R, 41), drafts, dlog, tgt, nv, make_sa(R, temperature=0.0))
    match = (drafts == am[:, :K]) & (np.arange(K)[None] < nv[:, None])
    assert np.array_equal(acc, np.cumprod(match, 1).sum(1))
    check_layout(acc, em, nv, drafts)
    rows = np.arange(R)
    assert np.array_equal(em[rows, acc], am[rows, acc])  # correction / bonus = argmax there
    assert 0 < np.mean(acc == nv) < 1  # both outcomes occur


def test_mixed_greedy_and_sampled_rows():
    """Greedy and sampled rows in one batch: each row follows its own rule, unaffected by the
    others (the sampled rows turn the top-k path on; greedy rows ignore it)."""
    sp = dict(temperature=0.7, top_k=3)
    rng = np.random.default_rng(50)
    greedy = np.arange(R) % 2 == 0
    pd0 = ref_probs(D0, **sp)
    d1 = sample_rows(rng, np.broadcast_to(pd0, (R, V)))
    drafts = np.stack([d1, np.zeros_like(d1)], 1)
    dlog = np.broadcast_to(log(pd0), (R, K, V))
    tgt = np.stack([np.broadcast_to(T0, (R, V)), TABLE[d1], np.broadcast_to(TABLE[0], (R, V))], 1)
    tgt = np.where(greedy[:, None, None], rng.normal(0, 2, (R, K + 1, V)).astype(np.float32), tgt)
    nv = np.ones(R, np.int32)
    keys = row_keys(R, 51)
    acc, em = run(keys, drafts, dlog, tgt, nv, make_sa(R, temperature=np.where(greedy, 0.0, 0.7), top_k=3))
    check_layout(acc, em, nv, drafts)
    # Greedy rows: the deterministic rule, and the same result as in an all-greedy batch.
    g = np.flatnonzero(greedy)
    am = tgt[g].argmax(-1)
    assert np.array_equal(acc[g], (drafts[g, 0] == am[:, 0]).astype(int))
    assert np.array_equal(em[g, acc[g]], am[np.arange(len(g)), acc[g]])
    acc_g, em_g = run(keys, drafts, dlog, tgt, nv, make_sa(R, temperature=0.0))
    assert np.array_equal(acc_g[g], acc[g]) and np.array_equal(em_g[g], em[g])
    # Sampled rows: first emitted token ~ transformed target.
    assert chi2_pvalue(counts(em[~greedy, 0], V), ref_probs(T0, **sp)) > P_PASS


def test_rows_do_not_depend_on_the_rest_of_the_batch():
    """A row's result depends only on its own key and inputs: move a set of rows elsewhere in
    the batch and replace every other row with different data and parameters."""
    sp = SAMPLING["topp0.75"]
    rng = np.random.default_rng(55)
    pd0 = ref_probs(D0, **sp)
    d = sample_rows(rng, np.broadcast_to(pd0, (R, V)))
    drafts = np.stack([d, sample_rows(rng, ref_probs(DTABLE, **sp)[d])], 1)
    dlog = np.stack([np.broadcast_to(log(pd0), (R, V)), log(ref_probs(DTABLE, **sp)[d])], 1)
    tgt = rng.normal(0, 1.5, (R, K + 1, V)).astype(np.float32)
    keys = row_keys(R, 56)
    temp = np.where(np.arange(R) % 3 == 0, 0.0, sp["temperature"])
    acc, em = run(keys, drafts, dlog, tgt, np.full(R, K, np.int32), make_sa(R, temp, top_p=sp["top_p"]))
    sel = rng.choice(R, 500, replace=False)
    dest = rng.permutation(R)[:500]
    others = np.random.default_rng(57)
    drafts2 = others.integers(0, V, (R, K)).astype(np.int32)
    dlog2 = others.normal(0, 1, (R, K, V)).astype(np.float32)
    tgt2 = others.normal(0, 1, (R, K + 1, V)).astype(np.float32)
    keys2 = row_keys(R, 58)
    nv2 = others.integers(0, K + 1, R).astype(np.int32)
    temp2, topp2 = others.choice([0.0, 0.5, 1.3], R), others.choice([1.0, 0.5], R)
    drafts2[dest], dlog2[dest], tgt2[dest], nv2[dest] = drafts[sel], dlog[sel], tgt[sel], K
    keys2 = keys2.at[dest].set(keys[sel])
    temp2[dest], topp2[dest] = temp[sel], sp["top_p"]
    acc2, em2 = run(keys2, drafts2, dlog2, tgt2, nv2, make_sa(R, temp2, top_p=topp2))
    assert np.array_equal(acc2[dest], acc[sel]) and np.array_equal(em2[dest], em[sel])


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("k", [0, K])
def test_num_verify_zero_samples_target(k):
    """Zero verified drafts (k = 0 drafts is the autoregressive step) = one draw from p_t, or
    the argmax for greedy rows."""
    sp = SAMPLING["topp0.75"]
    rng = np.random.default_rng(60 + k)
    greedy = np.arange(R) < 1000
    drafts = rng.integers(0, V, (R, k)).astype(np.int32)
    dlog = np.zeros((R, k, V), np.float32)  # a uniform draft: often accepted, were it checked
    tgt = np.broadcast_to(np.concatenate([T0[None], TABLE[:k]]), (R, k + 1, V))
    nv = np.zeros(R, np.int32)
    acc, em = run(row_keys(R, 62), drafts, dlog, tgt, nv,
                  make_sa(R, np.where(greedy, 0.0, sp["temperature"]), top_p=sp["top_p"]))
    assert np.all(acc == 0) and np.all(em[:, 1:] == -1)
    assert np.all(em[greedy, 0] == T0.argmax())
    assert chi2_pvalue(counts(em[~greedy, 0], V), ref_probs(T0, **sp)) > P_PASS


@pytest.mark.parametrize("name", ["t1", "t0.7"])
def test_draft_equal_to_target_is_always_accepted(name):
    """p_d == p_t: acceptance is certain (the residual has no mass), and the bonus token is
    drawn from the target's last position."""
    sp = SAMPLING[name]
    rng = np.random.default_rng(70)
    TB = np.array([0.5, -1.0, 1.5, 0.0, 1.0, -0.5], np.float32)
    pt0, ptab = ref_probs(T0, **sp), ref_probs(TABLE, **sp)
    d1 = sample_rows(rng, np.broadcast_to(pt0, (R, V)))
    d2 = sample_rows(rng, ptab[d1])
    tgt = np.stack([np.broadcast_to(T0, (R, V)), TABLE[d1], np.broadcast_to(TB, (R, V))], 1)
    # What a drafter that is the target would hand over: its transformed logits.
    dlog = np.asarray(transform_logits(jnp.asarray(tgt[:, :K]), make_sa(R, **sp)))
    nv = np.full(R, K, np.int32)
    acc, em = run(row_keys(R, 71), np.stack([d1, d2], 1), dlog, tgt, nv, make_sa(R, **sp))
    assert np.all(acc == K)
    assert chi2_pvalue(counts(em[:, K], V), ref_probs(TB, **sp)) > P_PASS
    # Greedy: drafts equal to the argmax are all accepted, the bonus is the last argmax.
    am = tgt.argmax(-1)
    acc, em = run(row_keys(R, 72), am[:, :K], dlog, tgt, nv, make_sa(R, temperature=0.0))
    assert np.all(acc == K) and np.array_equal(em, am)


def test_draft_outside_target_support_is_always_rejected():
    """A one-hot draft on a token that top-k removed from the target: always rejected, and
    the residual max(0, p_t − p_d) = p_t, so the output is exact."""
    sp = SAMPLING["topk3"]
    out = int(np.argmin(T0))
    drafts = np.full((R, K), out, np.int32)
    dlog = np.broadcast_to(np.where(np.arange(V) == out, 0.0, -np.inf).astype(np.float32), (R, K, V))
    tgt = np.broadcast_to(np.stack([T0, TABLE[out], TABLE[out]]), (R, K + 1, V))
    acc, em = run(row_keys(R, 80), drafts, dlog, tgt, np.full(R, K, np.int32), make_sa(R, **sp))
    assert np.all(acc == 0) and np.all(em[:, 1:] == -1)
    assert chi2_pvalue(counts(em[:, 0], V), ref_probs(T0, **sp)) > P_PASS


def test_rejection_with_empty_residual_falls_back_to_target():
    """Forced case: p_t = p_d = one-hot on token a, but the draft token is b ≠ a (a token
    that could not have been drawn from p_d). It is rejected and the residual has no mass;
    the correction must still be a valid draw from p_t, i.e. a."""
    a, b = 3, 1
    onehot = np.where(np.arange(V) == a, 0.0, -np.inf).astype(np.float32)
    tgt = np.broadcast_to(onehot, (R, K + 1, V))
    dlog = np.broadcast_to(onehot, (R, K, V))
    drafts = np.full((R, K), b, np.int32)
    acc, em = run(row_keys(R, 90), drafts, dlog, tgt, np.full(R, K, np.int32), make_sa(R))
    assert np.all(acc == 0) and np.all(em[:, 0] == a)


def _poison_first(dlog):
    """Cycle 1's first draft distribution becomes invalid, in four different ways."""
    dlog = dlog.copy()
    kind = np.arange(len(dlog)) % 4
    dlog[kind == 0, 0, 1] = np.nan
    dlog[kind == 1, 0, 2] = np.inf
    dlog[kind == 2, 0, :] = -np.inf
    dlog[kind == 3, 0, :] = np.nan
    return dlog


def _poison_second(dlog):
    dlog = dlog.copy()
    dlog[::2, 1, 0] = np.nan
    dlog[1::2, 1, 3] = np.inf
    return dlog


@pytest.mark.parametrize("where", ["first", "second"])
def test_invalid_draft_logits_accept_nothing_and_stay_exact(where):
    """NaN / +inf / all −inf draft logits: that draft is never accepted, and the output still
    follows the target (the residual of an invalid p_d is p_t itself)."""
    sp = SAMPLING["t0.7"]
    poison = _poison_first if where == "first" else _poison_second
    x1, x2, acc, _ = two_tokens(sp, seed=100, corrupt=poison)
    if where == "first":
        assert np.all(acc == 0)
    else:
        assert np.all(acc <= 1) and np.mean(acc == 1) > 0.2
    joint = exact_joint(sp)
    assert chi2_pvalue(counts(x1, V), joint.sum(1)) > P_PASS
    assert chi2_pvalue(joint_counts(x1, x2, V), joint) > P_PASS
