"""STS calibration: events with censoring, ECE, the fit on synthetic over-confident scores,
temperatures through save/load into drafting, and cycle collection on the real engine.

The synthetic tests use fixed seeds, so they are deterministic; their thresholds sit several
standard errors from the measured values (ECE noise with 4000 cycles is ~1%).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as ds
from dspark_jax.decoding.drafting import draft_block
from dspark_jax.decoding.sampling import SamplingArrays
from dspark_jax.models.draft_heads import sts_confidence
from dspark_jax.training import calibration as cal
from dspark_jax.training import sts

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"


def _synthetic(n=4000, G=5, scale=3.0, seed=0, short=0.3):
    """Cycles whose true conditional acceptance is p [N, G]; the head reports scale·logit(p) + noise
    (over-confident for scale > 1). A fraction `short` of the cycles verify fewer than γ drafts
    (as at the end of a request), so positions beyond them are censored."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.5, 0.99, (n, G))
    z = scale * np.log(p / (1 - p)) + 0.1 * rng.standard_normal((n, G))
    lead = np.cumprod(rng.random((n, G)) < p, axis=1).sum(1)  # leading acceptances
    verified = np.where(rng.random(n) < short, rng.integers(1, G + 1, n), G)
    return z, np.minimum(lead, verified), verified, np.cumprod(p, axis=1)


def test_cumulative_events_and_censoring():
    event, observed = sts.cumulative_events([0, 2, 3, 1, 0], [4, 4, 3, 1, 2], 4)
    np.testing.assert_array_equal(event, [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # Inside the verified prefix a rejection makes every later position a known 0; beyond ℓ
    # everything is censored: after full acceptance (rows 3, 4) and after a rejection (row 5).
    np.testing.assert_array_equal(observed, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="accepted <= verified"):
        sts.cumulative_events([3], [2], 4)
    with pytest.raises(ValueError, match="gamma=4"):
        sts.cumulative_events([1], [5], 4)


def test_ece_values():
    assert sts.ece([0.9] * 4, [1, 0, 1, 0]) == pytest.approx(0.4)
    assert sts.ece([0.25] * 4 + [0.75] * 4, [1, 0, 0, 0, 1, 1, 1, 0]) == pytest.approx(0.0)
    # Unobserved entries do not count, whatever their "event" says.
    assert sts.ece([0.9, 0.9, 0.1], [1, 1, 1], [True, True, False]) == pytest.approx(0.1)
    assert sts.ece([1.0, 0.0], [1, 0]) == 0.0  # the ends fall into the outer bins
    assert np.isnan(sts.ece([0.5], [1], [False]))


def test_sts_on_overconfident_scores():
    z, acc, ver, true_surv = _synthetic()
    G = z.shape[1]
    event, observed = sts.cumulative_events(acc, ver, G)
    temps = sts.fit_sts(z, event, observed)
    assert len(temps) == G and all(t > 0 for t in temps)
    # Over-confidence (logits 3× too large) needs T > 1; the true factor is 3. Later positions
    # are identified less sharply (T_k moves a_k less once the prefix product is small).
    assert 2.5 < temps[0] < 3.7 and all(t > 1.5 for t in temps), temps
    before, after = sts.survival(z), sts.survival(z, temps)
    for k in range(G):
        e0 = sts.ece(before[:, k], event[:, k], observed[:, k])
        e1 = sts.ece(after[:, k], event[:, k], observed[:, k])
        floor = sts.ece(true_surv[:, k], event[:, k], observed[:, k])  # what sampling noise allows
        assert e0 > 0.05 and e1 < 0.4 * e0 and e1 < floor + 0.02, (k, e0, e1, floor)
    # A temperature is monotone: within each position the order of candidates is unchanged.
    raw, calib = sts.apply_sts(z), sts.apply_sts(z, temps)
    for k in range(G):
        order = np.argsort(z[:, k], kind="stable")
        assert np.all(np.diff(calib[order, k]) >= 0) and np.all(np.diff(raw[order, k]) >= 0)


def test_sts_ignores_censored_entries_and_unobserved_positions():
    z, acc, ver, _ = _synthetic(n=1500, seed=1)
    event, observed = sts.cumulative_events(acc, ver, z.shape[1])
    temps = sts.fit_sts(z, event, observed)
    junk = np.where(observed, event, np.random.default_rng(2).integers(0, 2, event.shape))
    assert sts.fit_sts(z, junk, observed) == temps
    # Nothing observed at the last position: it keeps T = 1.
    obs = observed.copy()
    obs[:, -1] = False
    t2 = sts.fit_sts(z, event, obs)
    assert t2[-1] == 1.0 and t2[:-1] == temps[:-1]
    # Calibrated confidences (T = 1 exactly) fit T = 1: 1.0 lies on the grid and wins ties.
    assert 1.0 in sts.DEFAULT_GRID and len(sts.DEFAULT_GRID) == 49
    assert min(sts.DEFAULT_GRID) == 0.125 and max(sts.DEFAULT_GRID) == 8.0


def test_censoring_beyond_verified_length_is_unbiased():
    """Counting the known zeros beyond ℓ (after a rejection) while censoring full acceptances
    selects on the outcome: the observed rate falls far below the true survival, and the fit
    answers with too-high temperatures. Censoring everything beyond ℓ keeps the rate honest."""
    z, acc, ver, true_surv = _synthetic(short=1.0)
    G = z.shape[1]
    event, observed = sts.cumulative_events(acc, ver, G)
    naive = observed | (acc < ver)[:, None]
    assert np.all(event[naive & ~observed] == 0)  # the extra entries are all zeros
    k = G - 1
    rate, truth = event[observed[:, k], k].mean(), true_surv[observed[:, k], k].mean()
    rate_naive, truth_naive = event[naive[:, k], k].mean(), true_surv[naive[:, k], k].mean()
    assert abs(rate - truth) < 0.04 and rate_naive < truth_naive - 0.1, (rate, truth, rate_naive, truth_naive)
    assert sts.fit_sts(z, event, naive)[-1] == max(sts.DEFAULT_GRID)
    # With ℓ = γ (fixed-length collection) nothing is censored at all.
    assert sts.cumulative_events(acc, np.full_like(ver, G), G)[1].all()


def test_apply_sts_matches_drafter_sts_confidence():
    z = np.random.default_rng(0).normal(0, 4, (6, 5)).astype(np.float32)
    temps = (0.5, 1.0, 2.0, 3.0, 8.0)
    np.testing.assert_allclose(sts.apply_sts(z, temps), np.asarray(sts_confidence(jnp.asarray(z), temps)),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sts.apply_sts(z), np.asarray(sts_confidence(jnp.asarray(z), ())), rtol=1e-5)
    np.testing.assert_allclose(sts.survival(z, temps), np.cumprod(sts.apply_sts(z, temps), 1))
    with pytest.raises(ValueError, match="3 temperatures for 5"):
        sts.apply_sts(z, (1.0, 2.0, 3.0))


@pytest.fixture(scope="module")
def pair(tiny_target):
    target = tiny_target("llama", seed=3)
    cfg = ds.DrafterConfig.for_target(target.cfg, block_size=4, num_layers=1, markov_rank=16,
                                      num_feature_layers=2)
    return target, ds.Drafter.random(cfg, seed=1)


def test_temperatures_saved_and_applied_on_load(pair, tmp_path):
    target, drafter = pair
    z, acc, ver, _ = _synthetic(n=1000, G=drafter.block_size, seed=3)
    temps = sts.fit_sts(z, *sts.cumulative_events(acc, ver, drafter.block_size))
    ds.save_drafter(cal.with_temperatures(drafter, temps), str(tmp_path / "d"))
    loaded = ds.load_drafter(str(tmp_path / "d"), target)
    assert loaded.cfg.sts_temperatures == temps
    assert json.load(open(tmp_path / "d" / "config.json"))["sts_temperatures"] == list(temps)

    S, T = 2, 16
    sa = SamplingArrays.from_params([ds.SamplingParams(temperature=0.0)] * S)
    anchor, pos = jnp.asarray([5, 9], jnp.int32), jnp.asarray([0, 3], jnp.int32)
    keys = jax.vmap(jax.random.key)(jnp.arange(S, dtype=jnp.uint32))
    cache = loaded.init_cache(loaded.params, S, T)
    _, _, conf = draft_block(loaded, loaded.params, target.graphdef, target.state, cache, anchor, pos, keys, sa)
    _, _, raw = loaded.draft(loaded.params, cache, target.module(), anchor, pos, keys, sa, raw_confidence=True)
    np.testing.assert_allclose(np.asarray(conf), sts.apply_sts(np.asarray(raw), temps), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(conf), sts.apply_sts(np.asarray(raw)), atol=1e-4)


def test_collect_cycles_matches_generate(pair):
    target, drafter = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, target.cfg.vocab_size, n).tolist() for n in (5, 9, 7)]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ref = ds.generate(target, prompts, drafter=drafter, sampling=sp, policy="fixed")
    st, _ = cal._run_cycles(target, drafter, [list(p) for p in prompts], [sp] * 3)
    out, n_out = np.asarray(st.out), np.asarray(st.n_out)
    assert [out[i, : n_out[i]].tolist() for i in range(3)] == ref.token_ids

    conf, acc, ver = cal.collect_cycles(target, drafter, prompts, max_new_tokens=12, sampling=sp)
    N = len(acc)
    assert conf.shape == (N, drafter.block_size) and ver.shape == (N,) and np.isfinite(conf).all()
    assert np.all((0 <= acc) & (acc <= ver) & (ver <= drafter.block_size))
    assert N == sum(ref.stats["cycles"])
    assert int(np.sum(acc + 1)) + len(prompts) == ref.stats["new_tokens"]  # + each first token


def test_collect_sampled_and_report(pair, tmp_path):
    target, drafter = pair
    prompts = [[1, 2, 3, 4], [7, 8, 9]]
    sp = ds.SamplingParams(temperature=1.0, seed=4, ignore_eos=True)
    # Sampled cycles: _run_cycles raises if its re-drafted tokens differ from the engine's.
    # One request per batch: the rows are request-major, so they equal each request's own rows.
    conf, acc, ver = cal.collect_cycles(target, drafter, prompts, max_new_tokens=10, sampling=sp, batch_size=1)
    assert np.all(acc <= ver) and len(acc) > 0
    each = [cal.collect_cycles(target, drafter, [p], max_new_tokens=10, sampling=sp) for p in prompts]
    for got, want in zip((conf, acc, ver), (np.concatenate(x) for x in zip(*each))):
        np.testing.assert_array_equal(got, want)
    rep = sts.fit_and_report(conf, acc, ver, drafter.block_size, png_path=str(tmp_path / "rel.png"))
    assert len(rep["temperatures"]) == drafter.block_size and rep["num_cycles"] == len(acc)
    json.dumps(rep)  # JSON-ready
    with open(rep["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="gamma=5"):
        sts.fit_and_report(conf, acc, ver, 5)


def test_reliability_diagram_needs_matplotlib(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    e, o = sts.cumulative_events([1], [2], 2)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        sts.reliability_diagram(str(tmp_path / "x.png"), e, e, e, o)


def test_acceptance_prior_saved_loaded_and_validated(pair, tmp_path):
    """The measured survival becomes the drafter's conditional acceptance prior, which the
    export keeps and the scheduler reads per request (greedy or sampled row)."""
    from dspark_jax.decoding.decode_loop import acceptance_prior, prior_confidence

    target, drafter = pair
    assert cal.conditional_acceptance([0.5, 0.25, 0.0, 0.0]) == (0.5, 0.5, 0.0, 0.0)
    d = cal.with_temperatures(drafter, (1.0,) * 4, (2.0,) * 4, survival=[0.4, 0.2, 0.1, 0.05],
                              survival_greedy=[0.8, 0.6, 0.3, 0.3])
    ds.save_drafter(d, str(tmp_path / "d"))
    loaded = ds.load_drafter(str(tmp_path / "d"), target)
    assert loaded.cfg.acceptance_prior == (0.4, 0.5, 0.5, 0.5)
    assert loaded.cfg.acceptance_prior_greedy == (0.8, 0.75, 0.5, 1.0)
    prior = acceptance_prior(loaded, 3)  # the first K positions
    np.testing.assert_allclose(prior, [[0.4, 0.5, 0.5], [0.8, 0.75, 0.5]])
    sa = SamplingArrays.from_params([ds.SamplingParams(temperature=t) for t in (0.0, 0.7)])
    np.testing.assert_allclose(prior_confidence(prior, sa), [[0.8, 0.75, 0.5], [0.4, 0.5, 0.5]])
    np.testing.assert_array_equal(acceptance_prior(drafter, 2), np.ones((2, 2)))  # uncalibrated: optimistic
    with pytest.raises(ValueError, match="acceptance_prior holds probabilities"):
        drafter.cfg.replace(acceptance_prior=(0.5, 1.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="acceptance_prior_greedy has 2 entries"):
        drafter.cfg.replace(acceptance_prior_greedy=(0.5, 0.5))
