"""Prompt lookup drafting (`ds.NgramDrafter`): the lookup itself against a NumPy reference,
greedy outputs identical to autoregressive decoding under every policy, the serving engine
and slot compaction, and sampled outputs distributed as the target (chi-square on a bigram
target whose output distribution is known exactly)."""

import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import bigram_table, bigram_target, chi2_pvalue, counts, ref_probs, sharpen

import dspark_jax as ds
from dspark_jax.models.ngram import HybridDrafter, NgramDrafter

P_PASS = 1e-4


def ref_lookup(ctx, G, max_n, min_n):
    """(proposal, match length) for the context `ctx` (its last token is the anchor)."""
    p = len(ctx) - 1
    for n in range(min(max_n, p), min_n - 1, -1):
        suffix = ctx[p - n + 1:]
        for t in range(p - 1, n - 2, -1):  # most recent first; the occurrence ends at t < p
            if ctx[t - n + 1:t + 1] == suffix:
                cont = ctx[t + 1:t + 1 + G]
                return cont, n
    return [], 0


@pytest.mark.parametrize("max_n,min_n", [(4, 1), (3, 2)])
def test_lookup_matches_reference(max_n, min_n):
    rng = np.random.default_rng(0)
    S, T, G = 64, 48, 5
    d = NgramDrafter(block_size=G, max_ngram=max_n, min_ngram=min_n)
    buf = np.full((S, T), -1, np.int32)
    ctxs, anchors, pos = [], [], []
    for s in range(S):
        n = int(rng.integers(1, T - 1))
        ctx = rng.integers(0, 4 if s % 2 else 12, n + 1).tolist()  # small alphabets repeat
        buf[s, :n] = ctx[:n]
        buf[s, n:] = rng.integers(0, 12, T - n)  # stale tokens past the context are never read
        ctxs.append(ctx)
        anchors.append(ctx[-1])
        pos.append(n)
    tok, length, known = d.lookup(jnp.asarray(buf), jnp.asarray(anchors), jnp.asarray(pos))
    tok, length, known = np.asarray(tok), np.asarray(length), np.asarray(known)
    hits = 0
    for s in range(S):
        cont, n = ref_lookup(ctxs[s], G, max_n, min_n)
        assert length[s] == n, s
        assert known[s].sum() == len(cont) and known[s, :len(cont)].all(), s
        assert tok[s, :len(cont)].tolist() == cont, s
        hits += n > 0
    assert 0 < hits < S  # both outcomes occur


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="block_size"):
        NgramDrafter(block_size=0)
    with pytest.raises(ValueError, match="confidence"):
        NgramDrafter(confidence=(0.0, 1.5))
    with pytest.raises(ValueError, match="confidence"):
        NgramDrafter(confidence=((0.0,), (0.5, 1.2)))
    with pytest.raises(ValueError, match="confidence"):
        NgramDrafter(confidence=((0.0,), ()))


def test_the_prior_is_per_match_length_and_position():
    """A row per match length: one value for every position, or one per position (a short row
    repeats its last value); a block's confidences are its match length's row, cut where the
    context cannot continue."""
    ng = NgramDrafter(block_size=4, confidence=((0.0,), (0.2, 0.5), 0.9))
    assert ng.prior_table() == [[0.0] * 4, [0.2, 0.5, 0.5, 0.5], [0.9] * 4]
    n = jnp.asarray([0, 1, 2, 7], jnp.int32)  # 7: past the last row, which it takes
    known = jnp.asarray([[False] * 4, [True] * 4, [True, True, False, True], [True] * 4])
    conf = np.asarray(ng.block_confidence((None, n, known)))
    np.testing.assert_allclose(conf, [[0, 0, 0, 0], [0.2, 0.5, 0.5, 0.5], [0.9, 0.9, 0, 0], [0.9] * 4])
    # The shipped prior: the first draft of a short match is the weak one.
    table = NgramDrafter().prior_table()
    assert len(table) == 5 and all(len(r) == 7 for r in table) and table[2][0] < table[2][1] < table[2][6]


@pytest.fixture(scope="module")
def tiny():
    cfg = ds.ModelConfig.tiny(num_layers=2, tie_word_embeddings=False)
    target = sharpen(ds.Target.random(cfg, seed=0), seed=0)
    rng = np.random.default_rng(0)
    # Prompts that repeat a phrase, so lookup has something to find.
    prompts = []
    for n in (3, 5, 2, 4):
        phrase = rng.integers(3, cfg.vocab_size, n).tolist()
        prompts.append(phrase * 3 + phrase[:1])
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    ar = ds.generate(target, prompts, sampling=sp).token_ids
    return dict(target=target, prompts=prompts, sp=sp, ar=ar)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "dspark"])
def test_greedy_matches_autoregressive(tiny, policy):
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=NgramDrafter(block_size=4), sampling=tiny["sp"],
                      policy=policy)
    assert out.token_ids == tiny["ar"]
    if policy == "fixed":
        # τ is exactly what prompt lookup gets when replayed on the greedy tokens.
        assert out.stats["tau"] == pytest.approx(simulated_tau(tiny["prompts"], tiny["ar"], 4, 24), abs=1e-9)
        assert out.stats["tau"] > 1.0


def simulated_tau(prompts, outputs, K, max_new, max_n=4, min_n=1):
    """Greedy prompt lookup replayed on known greedy outputs: Σ emitted / Σ cycles."""
    emitted = cycles = 0
    for prompt, out in zip(prompts, outputs):
        m = 1  # the prefill emits the first token
        while m < len(out):
            cont, _ = ref_lookup(list(prompt) + list(out[:m]), K, max_n, min_n)
            cap = min(K, max_new - m - 1)
            acc = 0
            while acc < min(cap, len(cont)) and cont[acc] == out[m + acc]:
                acc += 1
            n = min(acc + 1, len(out) - m)
            emitted, cycles, m = emitted + n, cycles + 1, m + n
    return emitted / cycles


def test_load_drafter_by_name(tiny):
    d = ds.load_drafter("ngram", tiny["target"])
    assert isinstance(d, NgramDrafter) and d.vocab_size == tiny["target"].cfg.vocab_size


@pytest.mark.slow
def test_serving_engine_and_compaction(tiny):
    from serve.engine import Engine

    eng = Engine(tiny["target"], NgramDrafter(block_size=4), slots=4, max_len=128, max_new_tokens=24,
                 policy="fixed")
    reqs = [eng.submit(p, tiny["sp"]) for p in tiny["prompts"]]
    eng.run()
    assert [r.tokens for r in reqs] == tiny["ar"]
    # Requests of very different lengths: the loop compacts the slots as the short ones finish.
    lens = [4, 4, 4, 40]
    sps = [ds.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lens]
    want = ds.generate(tiny["target"], tiny["prompts"], sampling=sps).token_ids
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=NgramDrafter(block_size=4), sampling=sps,
                      policy="fixed")
    assert out.token_ids == want


@pytest.mark.slow
def test_sampling_follows_the_target():
    """A bigram target (next-token law depends on the last token only): the emitted tokens of
    speculative sampling with prompt lookup follow the exact chain, position by position."""
    V, NEW, X0 = 8, 12, 0
    target = bigram_target(V, lm_head_scale=20.0, seed=0)
    P = ref_probs(bigram_table(target))
    n = 2048
    sps = [ds.SamplingParams(temperature=1.0, seed=i, max_new_tokens=NEW, ignore_eos=True) for i in range(n)]
    out = ds.generate(target, [[X0, 3, X0, 3, X0]] * n, drafter=NgramDrafter(block_size=3), sampling=sps,
                      policy="fixed")
    toks = np.asarray(out.token_ids)
    assert toks.shape == (n, NEW)
    acc = out.stats["acceptance_per_position"]
    assert 0.05 < acc[0] < 0.95, acc  # both acceptances and rejections are exercised
    pi = P[X0]
    for t in range(NEW):
        assert chi2_pvalue(counts(toks[:, t], V), pi) > P_PASS, f"position {t + 1}"
        pi = pi @ P


def _random_dspark(target, block_size):
    from dspark_jax.models.drafter_config import DrafterConfig

    dcfg = DrafterConfig.for_target(target.cfg, num_feature_layers=1, block_size=block_size, num_layers=1,
                                    markov_rank=4)
    return ds.Drafter.random(dcfg, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("min_match", [1, 3])
def test_hybrid_greedy_matches_autoregressive(tiny, min_match):
    hyb = HybridDrafter(_random_dspark(tiny["target"], 4), min_match=min_match)
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=hyb, sampling=tiny["sp"], policy="fixed")
    assert out.token_ids == tiny["ar"]
    # The scheduled policies write the hybrid's two caches after their bucket switch (split append).
    sched = ds.generate(tiny["target"], tiny["prompts"], drafter=hyb, sampling=tiny["sp"], policy="threshold")
    assert sched.token_ids == tiny["ar"]
    # The async scheduler budgets the lookup's rows by this cycle's match (`foresight`).
    sched = ds.generate(tiny["target"], tiny["prompts"], drafter=hyb, sampling=tiny["sp"], policy="dspark")
    assert sched.token_ids == tiny["ar"]
    # A random DSpark drafter is almost never accepted: what is accepted came from lookup,
    # which the hybrid uses only on long matches.
    alone = ds.generate(tiny["target"], tiny["prompts"], drafter=_random_dspark(tiny["target"], 4),
                        sampling=tiny["sp"], policy="fixed")
    assert out.stats["tau"] > alone.stats["tau"]


@pytest.mark.slow
def test_an_overconfident_lookup_prior_is_corrected_online(tiny):
    """Foresight's prior is scaled by the request's own record (accepted drafts against the
    confidence foresight gave them): a lookup that claims every draft survives, on text whose
    matches the target rarely continues, is drafted less. Without the correction the
    scheduler drafted in 49% of these steps (it trusted the prior on every match); scaling
    every position's confidence, 18%; scaling the first (every survival probability, what
    ships: the other compounds along the block and lost 18% at batch 1 on HumanEval), 32%."""
    from dspark_jax.decoding.profiling import StepRates

    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    ar = ds.generate(tiny["target"], tiny["prompts"], sampling=sp).token_ids
    # Skipping: 1 step/s; the full bucket (4 slots × 5 tokens): 1/3 — drafting pays only when
    # more than two of a slot's drafts are expected to survive.
    table = StepRates(4, (4, 12, 20), 0.0, (1.5, 2.0, 3.0), 1.0)
    claims = NgramDrafter(block_size=4, confidence=(0.0, 1.0, 1.0, 1.0, 1.0))
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=claims, sampling=sp, policy="dspark", step_rates=table)
    assert out.token_ids == ar
    fixed = ds.generate(tiny["target"], tiny["prompts"], drafter=claims, sampling=sp, policy="fixed")
    assert fixed.stats["tau"] < 1.5  # what the claims are worth: < 0.5 accepted drafts per cycle
    assert out.stats["drafted_steps"] < 0.4  # uncorrected: 0.49


def test_a_static_batch_drafts_only_for_its_slowest_requests(tiny):
    """generate() returns when its last request is done (`DecodeConfig.makespan`): a request
    with fewer tokens to go than the longest one minus γ never drafts, however sure its lookup
    is, while the tokens/s objective (the serving engine's) drafts for it too."""
    from dspark_jax.decoding.profiling import StepRates

    budgets = (40, 8, 40, 8)
    sp = [ds.SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True) for m in budgets]
    ar = ds.generate(tiny["target"], tiny["prompts"], sampling=sp).token_ids
    table = StepRates(4, (4, 12, 20), 0.0, (1.5, 2.0, 3.0), 1.0)
    sure = NgramDrafter(block_size=4, confidence=(0.0, 1.0, 1.0, 1.0, 1.0))
    verified = {}
    for makespan in (True, False):
        out = ds.generate(tiny["target"], tiny["prompts"], drafter=sure, sampling=sp, step_rates=table,
                          config=ds.DecodeConfig(policy="dspark", makespan=makespan))
        assert out.token_ids == ar
        verified[makespan] = out.stats["mean_verified"]
    short = [i for i, m in enumerate(budgets) if m == 8]
    assert all(verified[True][i] == 0 for i in short)
    assert sum(verified[False][i] for i in short) > 0
    assert sum(verified[True]) > 0  # the long requests still draft


def test_foresight_is_the_blocks_own_confidence(tiny):
    """What the async scheduler reads before drafting is the confidence the block then has:
    the lookup's prior by match length (0 where nothing matches), known for every row; for
    the hybrid, known exactly on the rows whose block will be the lookup's."""
    target = tiny["target"]
    ng = NgramDrafter(block_size=4).bind(target)
    rng = np.random.default_rng(3)
    buf = jnp.asarray(rng.integers(0, 4, (4, 24)), jnp.int32)  # a small alphabet: matches of every length
    anchor, pos = jnp.asarray(rng.integers(0, 4, 4), jnp.int32), jnp.asarray([0, 5, 12, 20], jnp.int32)
    conf, known = ng.foresight(buf, anchor, pos)
    _, _, drafted = ng.draft(None, buf, target, anchor, pos, None, None)
    assert bool(known.all()) and np.array_equal(np.asarray(conf), np.asarray(drafted))
    assert float(conf[0].max()) == 0.0 and float(conf[1:].min(initial=1.0)) >= 0.0 and float(conf.max()) > 0.5
    hyb = HybridDrafter(_random_dspark(target, 4), min_match=2).bind(target)
    n = np.asarray(ng.lookup(buf, anchor, pos)[1])
    h_conf, h_known = hyb.foresight((None, buf), anchor, pos)
    assert np.array_equal(np.asarray(h_known), n >= 2) and (n >= 2).any() and not (n >= 2).all()
    np.testing.assert_array_equal(np.asarray(h_conf)[n >= 2], np.asarray(conf)[n >= 2])


def test_hybrid_refuses_mismatched_blocks(tiny):
    with pytest.raises(ValueError, match="block size"):
        HybridDrafter(_random_dspark(tiny["target"], 4), NgramDrafter(block_size=3))
    with pytest.raises(ValueError, match="min_match"):
        HybridDrafter(_random_dspark(tiny["target"], 4), min_match=9)


@pytest.mark.slow
def test_hybrid_sampling_follows_the_target():
    """Per request and cycle the proposal switches between the two drafters on the context
    alone; sampled outputs still follow the exact chain."""
    V, NEW, X0 = 8, 12, 0
    target = bigram_target(V, lm_head_scale=20.0, seed=0)
    P = ref_probs(bigram_table(target))
    n = 2048
    sps = [ds.SamplingParams(temperature=1.0, seed=10_000 + i, max_new_tokens=NEW, ignore_eos=True)
           for i in range(n)]
    hyb = HybridDrafter(_random_dspark(target, 3), min_match=2)
    out = ds.generate(target, [[X0, 3, X0, 3, X0]] * n, drafter=hyb, sampling=sps, policy="fixed")
    toks = np.asarray(out.token_ids)
    acc = out.stats["acceptance_per_position"]
    assert 0.05 < acc[0] < 0.95, acc
    pi = P[X0]
    for t in range(NEW):
        assert chi2_pvalue(counts(toks[:, t], V), pi) > P_PASS, f"position {t + 1}"
        pi = pi @ P
