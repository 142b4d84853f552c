"""Draft vocabulary and top-k sequential bias (docs/method.md): both stay lossless.

The drafter proposes only from V′ ⊂ V (here V′ excludes the chain's most likely tokens) and,
with the top-k bias, only from the k best parallel logits. Its logits are -inf elsewhere, so
q = 0 there and the residual max(0, p − q) keeps every token outside V′ reachable: the
emitted tokens must follow the target's chain exactly. Chi-square tests as in
test_speculative.py (per position, consecutive joints, pooled transitions), each asserting
p > 1e-4; 2 drafters × 4 sampling settings × 11 statistics give a false-failure rate ≤ 9e-3
for a fresh seed (the seeds are fixed, so the outcome is deterministic). The negative
control: the same samples tested against the target renormalised over V′ (what a verifier
that ignored the mass outside V′ would produce) fail at p ≈ 0.
"""

import os

import numpy as np
import pytest
from spec_helpers import (
    bigram_table,
    bigram_target,
    chi2_pvalue,
    counts,
    joint_counts,
    ref_probs,
    transitions_chi2_pvalue,
)

import dspark_jax as ds
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import Drafter

P_PASS = 1e-4
V = 8
X0 = 0
SLOTS = 4096
CALLS = 2
NEW = 6
SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7": dict(temperature=0.7),
    "topk3": dict(temperature=1.0, top_k=3),
    "topp0.7": dict(temperature=1.0, top_p=0.7),
}


@pytest.fixture(scope="module")
def chain():
    target = bigram_target(V, lm_head_scale=20.0, seed=0)
    table = bigram_table(target)
    # V′ leaves out the three tokens with the most stationary mass under T = 1.
    P = ref_probs(table)
    pi = np.ones(V) / V
    for _ in range(50):
        pi = pi @ P
    excluded = np.argsort(-pi)[:3]
    ids = np.setdiff1d(np.arange(V), excluded)
    return target, table, ids, excluded


def _sample(target, drafter):
    names = list(SETTINGS)
    toks = {n: [] for n in names}
    for c in range(CALLS):
        params = [ds.SamplingParams(**SETTINGS[names[i % 4]], seed=c * SLOTS + i, max_new_tokens=NEW,
                                    ignore_eos=True) for i in range(SLOTS)]
        out = ds.generate(target, [[X0]] * SLOTS, drafter=drafter, sampling=params, num_draft=2)
        arr = np.asarray(out.token_ids)
        for j, n in enumerate(names):
            toks[n].append(arr[j::4])
    return {n: np.concatenate(v) for n, v in toks.items()}, out.stats


@pytest.fixture(scope="module", params=["draft_vocab", "draft_vocab+topk2"])
def samples(chain, request):
    target, _, ids, _ = chain
    cfg = DrafterConfig.for_target(target.cfg, num_feature_layers=1, block_size=3, num_layers=1, markov_rank=4,
                                   draft_vocab_size=len(ids), draft_topk=2 if "topk" in request.param else 0)
    return _sample(target, Drafter.random(cfg, seed=1, draft_ids=ids))


def _check_chain(toks, P):
    pi = P[X0]
    for t in range(NEW):
        assert chi2_pvalue(counts(toks[:, t], V), pi) > P_PASS, f"position {t + 1}"
        pi = pi @ P
    p1 = P[X0]
    assert chi2_pvalue(joint_counts(toks[:, 0], toks[:, 1], V), p1[:, None] * P) > P_PASS
    p2 = p1 @ P
    assert chi2_pvalue(joint_counts(toks[:, 1], toks[:, 2], V), p2[:, None] * P) > P_PASS
    assert transitions_chi2_pvalue(toks[:, :-1], toks[:, 1:], P) > P_PASS


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_draft_vocabulary_is_lossless(chain, samples, name):
    _, table, _, excluded = chain
    toks, stats = samples
    P = ref_probs(table, **SETTINGS[name])
    _check_chain(toks[name], P)
    # Tokens the drafter can never propose still come out (through the residual / bonus).
    assert np.isin(toks[name], excluded).mean() > 0.05
    assert 1.0 < stats["tau"] < 3.0  # drafts are both accepted and rejected


@pytest.mark.slow
def test_negative_control_renormalised_target_is_detected(chain, samples):
    """The samples are far from the chain a V′-restricted verifier would emit."""
    _, table, ids, _ = chain
    toks = samples[0]["t1"]
    P = ref_probs(table)
    Pv = np.zeros_like(P)
    Pv[:, ids] = P[:, ids]
    Pv /= Pv.sum(1, keepdims=True)
    # Samples do land on tokens outside V′, which have probability 0 under Pv.
    assert np.isin(toks, np.setdiff1d(np.arange(V), ids)).any()
    Pv_smooth = 0.999 * Pv + 0.001 / V  # keep the chi-square defined; still far from P
    assert transitions_chi2_pvalue(toks[:, :-1], toks[:, 1:], Pv_smooth) < 1e-12


@pytest.mark.slow
def test_topk_at_least_vocab_equals_untruncated_bit_for_bit(chain):
    target, _, ids, _ = chain
    base = DrafterConfig.for_target(target.cfg, num_feature_layers=1, block_size=3, num_layers=1, markov_rank=4,
                                    draft_vocab_size=len(ids))
    outs = []
    for k in (0, len(ids), len(ids) + 3):
        d = Drafter.random(base.replace(draft_topk=k), seed=1, draft_ids=ids)
        sp = [ds.SamplingParams(temperature=1.0, seed=i, max_new_tokens=6, ignore_eos=True) for i in range(64)]
        outs.append(ds.generate(target, [[X0]] * 64, drafter=d, sampling=sp, num_draft=3).token_ids)
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.slow
def test_round_trip_and_bad_ids(tmp_path, chain):
    target, _, ids, _ = chain
    cfg = DrafterConfig.for_target(target.cfg, num_feature_layers=1, block_size=3, num_layers=1, markov_rank=4,
                                   draft_vocab_size=len(ids), draft_topk=2)
    d = Drafter.random(cfg, seed=2, draft_ids=ids)
    ds.save_drafter(d, str(tmp_path / "d"))
    e = ds.load_drafter(str(tmp_path / "d"), target)
    assert e.cfg == d.cfg
    from flax import nnx

    a = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(d.state) if "draft_lm_head" not in p}
    b = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(e.state) if "draft_lm_head" not in p}
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    np.testing.assert_array_equal(np.asarray(e.state["draft_ids"].get_value()), ids)
    sp = ds.SamplingParams(temperature=1.0, seed=3, max_new_tokens=6, ignore_eos=True)
    assert ds.generate(target, [[X0]], drafter=d, sampling=sp).token_ids == \
        ds.generate(target, [[X0]], drafter=e, sampling=sp).token_ids
    with pytest.raises(ValueError, match="must lie in"):
        Drafter.random(cfg, draft_ids=np.array([0, 1, 2, V + 3, 4]))
    with pytest.raises(ValueError, match="distinct"):
        Drafter.random(cfg, draft_ids=np.array([0, 1, 1, 2, 4]))
    # A checkpoint whose stored ids fall outside the target's vocabulary is refused at load.
    from safetensors.numpy import load_file, save_file

    f = str(tmp_path / "d" / "model.safetensors")
    t = load_file(f)
    t["draft_ids"] = np.asarray([0, 1, 2, 3, 99], np.int32)
    save_file(t, f)
    with pytest.raises(ValueError, match="must lie in"):
        ds.load_drafter(str(tmp_path / "d"), target)
    assert os.path.exists(f)
