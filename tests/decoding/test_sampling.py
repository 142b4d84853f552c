"""Sampling: the logits transform against a NumPy reference, and end-to-end sampling
through `ds.generate` against the model's own distribution (chi-square)."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dspark_jax as ds
from dspark_jax.decoding.sampling import SamplingArrays, transform_logits

# --------------------------------------------------------------------------- NumPy reference


def _softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def reference_keep(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The documented semantics, written plainly (float64): temperature → top-k → top-p on
    the top-k-renormalised distribution → min-p relative to the most likely token; a token
    tied with the last one kept at a threshold is kept. Returns (kept mask, scaled logits,
    margin) where margin is the distance of the closest token to a top-p / min-p threshold."""
    x = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    x = np.where(np.isnan(x), -np.inf, x)
    keep = np.isfinite(x)
    margin = np.inf
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, x.size) - 1]
        keep &= x >= kth
    if top_p < 1.0:
        p = _softmax(np.where(keep, x, -np.inf))
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # probability mass of more likely tokens
        n_keep = max(1, int(np.sum(before < top_p)))
        # (The most likely token is always kept: no threshold to be close to.)
        margin = min(margin, np.abs(before[1:][keep[order][1:]] - top_p).min(initial=np.inf))
        keep &= x >= x[order[n_keep - 1]]
    if min_p > 0.0:
        p = _softmax(np.where(keep, x, -np.inf))
        others = keep & (np.arange(x.size) != np.argmax(p))
        margin = min(margin, np.abs(np.log(p[others]) - np.log(min_p * p.max())).min(initial=np.inf))
        keep &= p >= min_p * p.max()
    return keep, x, margin


def assert_transform_matches(logits_RV, params, **transform_kw):
    sa = SamplingArrays.from_params(params)
    got = np.asarray(transform_logits(jnp.asarray(logits_RV, jnp.float32), sa, **transform_kw))
    check_rows(got, logits_RV, params)


def check_rows(got, logits_RV, params):
    for r, sp in enumerate(params):
        if sp.greedy:  # greedy rows take the argmax of the raw logits; it must stay allowed
            assert np.isfinite(got[r, np.argmax(logits_RV[r])])
            continue
        keep, x, margin = reference_keep(logits_RV[r], sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        assert margin > 1e-5, "test data too close to a threshold for a float32 comparison"
        np.testing.assert_array_equal(np.isfinite(got[r]), keep, err_msg=f"row {r}: {sp}")
        np.testing.assert_allclose(got[r][keep], x[keep], rtol=1e-6, atol=0)


def random_logits(R, V, seed, scale=2.0):
    return (scale * np.random.default_rng(seed).standard_normal((R, V))).astype(np.float32)


SP = ds.SamplingParams


@pytest.mark.parametrize(
    "sp",
    [
        SP(temperature=1.0),
        SP(temperature=0.3),
        SP(temperature=2.5),
        SP(top_k=1),
        SP(top_k=7),
        SP(top_k=64),  # = V: keeps everything
        SP(top_k=1000),  # > V: clipped
        SP(top_p=0.5),
        SP(top_p=0.9),
        SP(top_p=1e-6),  # only the most likely token
        SP(min_p=0.05),
        SP(min_p=0.5),
        SP(min_p=1.0),  # only the most likely token (and exact ties)
        SP(temperature=0.7, top_k=10, top_p=0.8),
        SP(temperature=1.5, top_k=20, top_p=0.95, min_p=0.02),
        SP(temperature=0.5, top_p=0.6, min_p=0.1),
    ],
    ids=lambda sp: f"T{sp.temperature}-k{sp.top_k}-p{sp.top_p}-m{sp.min_p}",
)
def test_transform_matches_reference(sp):
    logits = random_logits(8, 64, seed=hash((sp.temperature, sp.top_k, sp.top_p, sp.min_p)) % 2**31)
    assert_transform_matches(logits, [sp] * 8)


REFERENCE_PARAMS = [
    SP(top_k=7), SP(top_k=40), SP(top_k=1000), SP(top_p=0.5), SP(top_p=0.97), SP(top_p=1e-6),
    SP(temperature=0.7, top_k=10, top_p=0.8), SP(temperature=1.5, top_k=20, top_p=0.95, min_p=0.02),
    SP(temperature=3.0, top_p=0.99), SP(temperature=0.0, top_k=50), SP(), SP(temperature=0.5, top_k=3),
]


@pytest.mark.parametrize("window", [1, *(pytest.param(w, marks=pytest.mark.slow) for w in (4, 16))])
def test_windowed_thresholds_and_their_fallback_match_the_reference(window):
    """The thresholds come from the `window` largest values, and from the exact bisection for
    rows whose top-k or top-p cut lies beyond them (most rows here, with a window of 1–16 over
    V = 64); the engine's setting (every filter compiled in, no static top-k bound) and the
    default one give the reference's kept set."""
    import dataclasses

    logits = random_logits(len(REFERENCE_PARAMS), 64, seed=11)
    assert_transform_matches(logits, REFERENCE_PARAMS, window=window)
    sa = dataclasses.replace(SamplingArrays.from_params(REFERENCE_PARAMS), use_top_k=True, use_top_p=True,
                             use_min_p=True, top_k_max=0)
    got = np.asarray(transform_logits(jnp.asarray(logits), sa, window=window))
    check_rows(got, logits, REFERENCE_PARAMS)
    # With a middle axis (verification's [R, K+1, V]) each row's settings apply to every position.
    mid = random_logits(len(REFERENCE_PARAMS) * 3, 64, seed=12)
    got = np.asarray(transform_logits(jnp.asarray(mid.reshape(-1, 3, 64)), sa, window=window))
    check_rows(got.reshape(-1, 64), mid, [sp for sp in REFERENCE_PARAMS for _ in range(3)])


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_ties_at_the_window_edge_and_beyond_are_kept():
    """A tie group that straddles the window: top-k and top-p keep all of it."""
    x = np.array([[3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0, -1.0]], np.float32)
    for sp in [SP(top_k=3), SP(top_k=5), SP(top_p=0.8), SP(top_p=0.95)]:
        for window in (1, 2, 3, 8):
            got = np.asarray(transform_logits(jnp.asarray(x), SamplingArrays.from_params([sp]), window=window))
            keep, _, _ = reference_keep(x[0], top_k=sp.top_k, top_p=sp.top_p)
            np.testing.assert_array_equal(np.isfinite(got[0]), keep, err_msg=f"{sp} window={window}")


def test_transform_with_different_params_per_row():
    params = [
        SP(temperature=0.0, top_k=3),  # greedy: its filters are irrelevant
        SP(temperature=1.0),
        SP(temperature=0.5, top_k=5),
        SP(top_p=0.7),
        SP(temperature=2.0, min_p=0.1),
        SP(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05),
        SP(top_k=0, top_p=1.0, min_p=0.0),
        SP(temperature=1.3, top_k=2),
    ]
    assert_transform_matches(random_logits(len(params), 96, seed=1), params)


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_transform_with_middle_axes():
    """Verification transforms [R, K+1, V]; each row's params apply to all its positions."""
    params = [SP(temperature=0.5, top_k=4), SP(top_p=0.6), SP(temperature=1.7, min_p=0.2)]
    logits = random_logits(3 * 5, 50, seed=2).reshape(3, 5, 50)
    sa = SamplingArrays.from_params(params)
    got = np.asarray(transform_logits(jnp.asarray(logits), sa))
    flat_params = [sp for sp in params for _ in range(5)]
    flat_sa = SamplingArrays.from_params(flat_params)
    flat = np.asarray(transform_logits(jnp.asarray(logits.reshape(15, 50)), flat_sa))
    np.testing.assert_array_equal(got.reshape(15, 50), flat)
    assert_transform_matches(logits.reshape(15, 50), flat_params)


def test_disabled_filters_are_no_ops_when_another_row_enables_them():
    """top_k=0, top_p=1, min_p=0 rows must keep every token — including ones of probability
    ~1e-30 — even though other rows switch the filters on for the whole batch."""
    x = random_logits(4, 64, seed=3, scale=12.0)
    assert _softmax(x[0].astype(np.float64)).min() < 1e-20
    params = [SP(), SP(temperature=0.5), SP(top_k=5, top_p=0.5, min_p=0.1), SP(top_p=0.3)]
    got = np.asarray(transform_logits(jnp.asarray(x), SamplingArrays.from_params(params)))
    np.testing.assert_allclose(got[0], x[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], x[1] / 0.5, rtol=1e-6)
    assert_transform_matches(x, params)


def test_ties_at_thresholds_are_kept():
    x = np.array([[3.0, 1.0, 1.0, 1.0, 0.0]], np.float32)
    for sp in [SP(top_k=2), SP(top_p=0.75), SP(min_p=float(np.exp(-2.0)) * 0.999)]:
        got = np.asarray(transform_logits(jnp.asarray(x), SamplingArrays.from_params([sp])))
        # p = [.79, .11, .11, .11, .04]: each threshold falls on the tied 1.0s.
        np.testing.assert_array_equal(np.isfinite(got[0]), [True, True, True, True, False], err_msg=str(sp))
        keep, _, _ = reference_keep(x[0], top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p)
        np.testing.assert_array_equal(np.isfinite(got[0]), keep)


def test_top_p_renormalises_over_every_token_top_k_kept():
    """top-k with a tie at the k-th value keeps all tied tokens; top-p must then work on
    the distribution over *all* of them. Here top-k=2 keeps all four tokens
    (p = .475, .175, .175, .175) and top-p=0.7 needs three of them, so — ties kept — all four."""
    x = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
    sp = SP(top_k=2, top_p=0.7)
    got = np.asarray(transform_logits(jnp.asarray(x), SamplingArrays.from_params([sp])))
    keep, _, _ = reference_keep(x[0], top_k=2, top_p=0.7)
    assert keep.all()
    np.testing.assert_array_equal(np.isfinite(got[0]), keep)


def test_nan_logits_are_never_kept():
    x = np.array([[0.5, np.nan, 2.0, -1.0]], np.float32)
    for sp in [SP(), SP(top_k=3), SP(top_p=0.99), SP(min_p=0.01)]:
        got = np.asarray(transform_logits(jnp.asarray(x), SamplingArrays.from_params([sp])))
        assert got[0, 1] == -np.inf and np.isfinite(got[0, [0, 2]]).all()


# --------------------------------------------------------------------------- end to end

# A correct sampler fails a given choice of seeds with probability CHI2_P_MIN. Power at
# N_SAMPLES (simulated with NumPy draws on this model): sampling at the wrong position fails
# always, a 20% temperature error fails 95% of seed choices, a 10% error 25%.
CHI2_P_MIN = 1e-3
N_SAMPLES = 2048


def _chi_square_p(tokens, probs):
    """Pearson chi-square p-value of observed tokens against `probs`, merging categories with
    expected count < 5 into one bin (the usual validity condition)."""
    n = len(tokens)
    obs = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    exp = n * probs
    assert obs[probs == 0].sum() == 0, "sampled a token of probability 0"
    big = exp >= 5
    f_obs = np.append(obs[big], obs[~big].sum())
    f_exp = np.append(exp[big], exp[~big].sum())
    if f_exp[-1] < 5:  # too small to stand alone: fold it into the smallest big bin
        i = np.argmin(f_exp[:-1])
        f_obs[i] += f_obs[-1]
        f_exp[i] += f_exp[-1]
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    assert len(f_exp) >= 5, "too few bins for a meaningful test"
    return stats.chisquare(f_obs, f_exp * n / f_exp.sum()).pvalue


@pytest.fixture(scope="module")
def sampler_target(tiny_target):
    """A tiny random model with a 32-token vocab whose final norm is scaled down to give
    logits of std ~1 (max probability ~0.2): with 2048 samples nearly every token gets an
    expected count >= 5, so the test checks the whole distribution, not just its head."""
    t = tiny_target("llama", seed=3, vocab_size=32, num_layers=2)
    t.state["norm"]["weight"][...] = 0.35 * t.state["norm"]["weight"][...]
    return t


PROMPT = [5, 17, 3, 9, 30, 1, 22]


PLAIN = SP(temperature=1.0)
TRANSFORMED = SP(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02)


@pytest.mark.slow
def test_sampling_matches_model_distribution(sampler_target):
    """First sampled token over N_SAMPLES seeds ~ softmax(transform(logits at the last
    prompt position)), for plain temperature-1 sampling and for a top-k/top-p/min-p
    transform, both in one batch (so the plain rows also check that filters another row
    switches on are no-ops for them). Deterministic (fixed seeds); for a random choice of
    seeds a correct implementation fails each of the two checks with probability CHI2_P_MIN."""
    import dataclasses

    params = [dataclasses.replace(sp, max_new_tokens=1, seed=s, ignore_eos=True)
              for sp in (PLAIN, TRANSFORMED) for s in range(N_SAMPLES)]
    out = ds.generate(sampler_target, [PROMPT] * len(params), sampling=params)
    assert all(len(t) == 1 for t in out.token_ids)
    tokens = np.array([t[0] for t in out.token_ids])
    last = np.asarray(ds.logits(sampler_target, PROMPT))[-1]
    for i, sp in enumerate((PLAIN, TRANSFORMED)):
        keep, x, _ = reference_keep(last, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        probs = _softmax(np.where(keep, x, -np.inf))
        assert probs.max() < 0.5 and (probs > 0).sum() >= 8  # spread out, so the test has power
        p = _chi_square_p(tokens[i * N_SAMPLES : (i + 1) * N_SAMPLES], probs)
        assert p > CHI2_P_MIN, f"{sp}: chi-square p = {p:.2e}"
    # A request's sample depends on its seed only, not on its row in the batch.
    perm = np.random.default_rng(0).permutation(len(params))
    shuffled = ds.generate(sampler_target, [PROMPT] * len(params), sampling=[params[i] for i in perm])
    assert shuffled.stats["compiles"] == 0
    assert [t[0] for t in shuffled.token_ids] == tokens[perm].tolist()


def test_greedy_generate_is_the_argmax_chain_and_stops(tiny_target):
    """Greedy tokens equal the argmax of the full forward at every step (teacher forcing on
    the generated sequence is the same thing, by causality). Different prompt lengths and
    per-request max_new_tokens in one batch. Then per-request stop tokens: generation ends
    at the first one, which is excluded; a second call with the same buckets compiles nothing."""
    target = tiny_target("qwen3", seed=11, num_layers=2)
    prompts = [[7, 8, 9, 10, 11], [100, 3, 55, 17, 90, 4, 28, 61, 12]]
    max_new = [12, 8]  # both sequences end at 17 tokens: one batched reference forward
    params = [SP(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new]
    out = ds.generate(target, prompts, sampling=params)
    assert [len(t) for t in out.token_ids] == max_new
    seqs = np.array([p + g for p, g in zip(prompts, out.token_ids)], np.int32)
    ref = np.asarray(ds.logits(target, seqs))
    for b, p in enumerate(prompts):
        steps = ref[b, len(p) - 1 : -1]
        top2 = np.sort(steps, -1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 1e-4  # no near-ties: argmax is well defined
        np.testing.assert_array_equal(out.token_ids[b], steps.argmax(-1))

    toks = out.token_ids[0]
    stop = toks[5]
    params[0] = SP(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    stopped = ds.generate(target, prompts, sampling=params)
    assert stopped.token_ids[0] == toks[: toks.index(stop)]
    assert stopped.token_ids[1] == out.token_ids[1]
    assert stopped.stats["compiles"] == 0
