"""Lossless speculative generation end to end, through `ds.generate` (docs/method.md §5).

Two tiny targets:
- a *bigram* target (`spec_helpers.bigram_target`): one layer with its attention output and
  MLP down projections zeroed, so P(next | prefix) depends on the last token only and every
  output distribution is known exactly. A random (poor) DSpark drafter proposes; the
  emitted tokens are checked against the exact chain by chi-square.
- a *sharpened* random target (logit std ~2-3, so greedy argmaxes are not fp32 coin flips)
  for token-exact greedy comparisons with autoregressive decoding.

False-failure rates: every chi-square asserts p > P_PASS = 1e-4. The bigram test computes
44 statistics, so a correct engine fails it with probability ≤ 4.4e-3 for a fresh seed; the
seeds are fixed, so the outcome is deterministic. Everything else here is exact.

Runtime on a shared 2-core CPU: ~70 s idle, ~2 min under load, mostly XLA compiles (~5-15 s
per new bucket or drafter object); the greedy tests share buckets (8 slots, 16 new tokens,
K = 3) to keep that down. The bigram sample (5 × 4096 requests × 8 tokens: 20 480
independent requests, 164k tokens) takes ~25 s idle including its compile; 100k independent
requests would take ~25 such calls (~70 s idle, several minutes under load), so the
per-position tests use 5120 requests per configuration and the pooled transition test
(~36k transitions per configuration) adds the power.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import (
    bigram_table,
    bigram_target,
    chi2_pvalue,
    counts,
    joint_counts,
    ref_probs,
    sharpen,
    transitions_chi2_pvalue,
)

import dspark_jax as ds
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import Drafter, OracleDrafter

P_PASS = 1e-4

# --------------------------------------------------------------------------- bigram target, sampling

BIGRAM_V = 8
X0 = 0  # the one-token prompt
SLOTS = 4096  # requests per generate() call
CALLS = 5  # → 1024 independent requests per configuration per call, 5120 in all
NEW = 8  # new tokens per request (7 in-cycle transitions each)
NUM_DRAFT = 2
# All four configurations share every batch (request i uses CONFIGS[i % 4]), so one
# compiled program serves them all and the batch mixes per-request sampling parameters.
CONFIGS = {
    "t1": dict(temperature=1.0),
    "t0.7": dict(temperature=0.7),
    "topk3": dict(temperature=1.0, top_k=3),
    "topp0.7": dict(temperature=1.0, top_p=0.7),
}


@pytest.fixture(scope="module")
def bigram():
    target = bigram_target(BIGRAM_V, lm_head_scale=20.0, seed=0)
    dcfg = DrafterConfig.for_target(target.cfg, num_feature_layers=1, block_size=3, num_layers=1,
                                    markov_rank=4)
    return target, bigram_table(target), Drafter.random(dcfg, seed=1)


@pytest.fixture(scope="module")
def bigram_samples(bigram):
    """{config: tokens [CALLS·SLOTS/4, NEW]} plus the acceptance statistics."""
    target, _, drafter = bigram
    names = list(CONFIGS)
    toks = {n: [] for n in names}
    stats = []
    for c in range(CALLS):
        params = [
            ds.SamplingParams(**CONFIGS[names[i % 4]], seed=c * SLOTS + i, max_new_tokens=NEW,
                              ignore_eos=True)
            for i in range(SLOTS)
        ]
        out = ds.generate(target, [[X0]] * SLOTS, drafter=drafter, sampling=params, num_draft=NUM_DRAFT)
        assert all(len(t) == NEW for t in out.token_ids)
        arr = np.asarray(out.token_ids)
        for j, n in enumerate(names):
            toks[n].append(arr[j::4])
        stats.append(out.stats)
    return {n: np.concatenate(v) for n, v in toks.items()}, stats


def test_bigram_target_is_a_bigram(bigram):
    """The construction: logits at every position equal the 1-token logits of that token."""
    target, table, _ = bigram
    seq = np.array([3, 1, 4, 1, 5, 0, 2, 6, 7, 7, 2])
    np.testing.assert_allclose(np.asarray(ds.logits(target, seq)), table[seq], atol=1e-5)
    # Far from uniform, and the thresholds used below are not borderline for any row.
    assert ref_probs(table).max() > 0.9
    for row in table:
        p = ref_probs(row)
        q = np.sort(p)[::-1]
        assert np.min(np.abs(np.cumsum(q) - q - CONFIGS["topp0.7"]["top_p"])) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_follows_the_target(bigram, bigram_samples, name):
    _, table, _ = bigram
    toks = bigram_samples[0][name]
    P = ref_probs(table, **CONFIGS[name])  # exact kernel of the (transformed) chain
    V = BIGRAM_V
    # Per-position marginals (independent across requests): π_1 = P[x0], π_{t+1} = π_t P.
    pi = P[X0]
    for t in range(NEW):
        assert chi2_pvalue(counts(toks[:, t], V), pi) > P_PASS, f"position {t + 1}"
        pi = pi @ P
    # Joints of consecutive tokens: (x1, x2) spans prefill → first cycle, (x2, x3) lies
    # inside the first cycle's block (draft 1, then draft 2 / correction / bonus).
    p1 = P[X0]
    p2 = p1 @ P
    assert chi2_pvalue(joint_counts(toks[:, 0], toks[:, 1], V), p1[:, None] * P) > P_PASS
    assert chi2_pvalue(joint_counts(toks[:, 1], toks[:, 2], V), p2[:, None] * P) > P_PASS
    # Every in-cycle transition x_t → x_{t+1}, pooled over positions (Anderson-Goodman).
    assert transitions_chi2_pvalue(toks[:, :-1], toks[:, 1:], P) > P_PASS


@pytest.mark.slow
def test_bigram_drafter_is_poor_but_not_useless(bigram_samples):
    """Both acceptances and rejections occur, so the statistics above exercise both paths."""
    for st in bigram_samples[1]:
        acc = st["acceptance_per_position"]
        assert len(acc) == NUM_DRAFT and all(0.05 < a < 0.95 for a in acc), acc
        assert 1.0 < st["tau"] < NUM_DRAFT + 1


# --------------------------------------------------------------------------- sharpened target, greedy

K = 3
MAX_NEW = 16  # every batch below has one request at 16 so the output bucket is shared
PROMPT_LENS = [1, 3, 5, 7, 9, 11, 2, 12]


@pytest.fixture(scope="module")
def tiny():
    cfg = ds.ModelConfig.tiny(num_layers=2, tie_word_embeddings=False)
    target = sharpen(ds.Target.random(cfg, seed=0), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    dcfg = DrafterConfig.for_target(cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8)
    drafter = Drafter.random(dcfg, seed=1)
    ar = ds.generate(target, prompts, sampling=greedy())
    assert all(len(t) == MAX_NEW for t in ar.token_ids)
    oracle = OracleDrafter.from_lists(ar.token_ids, PROMPT_LENS, cfg.vocab_size, block_size=K)
    return dict(target=target, prompts=prompts, drafter=drafter, ar=ar.token_ids, oracle=oracle)


def greedy(**kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return ds.SamplingParams(temperature=0.0, ignore_eos=True, **kw)


@dataclasses.dataclass(frozen=True)
class NaNDrafter(OracleDrafter):
    """The oracle's tokens with NaN logits: no valid draft distribution anywhere. (A distinct
    class, so it never compares equal to an oracle and never shares its compiled program.)"""

    def draft(self, params, cache, target, anchor_S, anchor_pos_S, keys_S, sa):
        tok, logits, conf = super().draft(params, cache, target, anchor_S, anchor_pos_S, keys_S, sa)
        return tok, jnp.full_like(logits, jnp.nan), conf


def test_greedy_random_drafter_matches_autoregressive(tiny):
    def run():
        return ds.generate(tiny["target"], tiny["prompts"], drafter=tiny["drafter"], sampling=greedy(),
                           num_draft=K)

    out = run()
    assert out.token_ids == tiny["ar"]
    assert 1.0 <= out.stats["tau"] < 2.0  # a random drafter is mostly rejected
    # Warm: the same buckets again compile nothing new.
    again = run()
    assert again.token_ids == tiny["ar"]
    assert again.stats["compiles"] == 0
    ar_again = ds.generate(tiny["target"], tiny["prompts"], sampling=greedy())
    assert ar_again.token_ids == tiny["ar"] and ar_again.stats["compiles"] == 0


def test_greedy_oracle_drafter_accepts_everything(tiny):
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=tiny["oracle"], sampling=greedy(), num_draft=K)
    assert out.token_ids == tiny["ar"]
    assert out.stats["acceptance_per_position"] == [1.0] * K
    # 15 tokens after the prefill's first: cycles emit 4, 4, 4, 3 → τ = 15 / 4.
    assert out.stats["tau"] == pytest.approx((MAX_NEW - 1) / 4)


def test_stop_token_inside_accepted_block(tiny):
    """A stop token accepted as a draft ends the output there: nothing after it is emitted,
    although the drafts after it were accepted too. Request 0 stops on its very first token."""
    ar = tiny["ar"]
    params, want = [], []
    for i, t in enumerate(ar):
        # First index j in 1..3 (an accepted draft of cycle 1) whose token is new at j.
        j = 0 if i == 0 else next(j for j in (1, 2, 3) if t[j] not in t[:j])
        params.append(greedy(stop_token_ids=(t[j],)))
        want.append(t[:j])
    params[-1] = greedy(stop_token_ids=())  # no stop token at all; keeps the 16-token bucket
    want[-1] = ar[-1]
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=tiny["oracle"], sampling=params, num_draft=K)
    assert out.token_ids == want
    ref = ds.generate(tiny["target"], tiny["prompts"], sampling=params)
    assert ref.token_ids == want


def test_max_new_tokens_reached_mid_block(tiny):
    ar = tiny["ar"]
    lens = [1, 2, 3, 4, 5, 6, 7, MAX_NEW]
    for drafter in (tiny["oracle"], tiny["drafter"]):
        out = ds.generate(tiny["target"], tiny["prompts"], drafter=drafter,
                          sampling=[greedy(max_new_tokens=m) for m in lens], num_draft=K)
        assert [len(t) for t in out.token_ids] == lens
        assert out.token_ids == [a[:m] for a, m in zip(ar, lens)]


@pytest.mark.slow
def test_nan_draft_logits(tiny):
    """Invalid draft distributions: greedy output is unchanged (greedy checks tokens only) and
    sampling never accepts a draft."""
    t = tiny["target"]
    bad = NaNDrafter(tiny["oracle"].continuations, tiny["oracle"].prompt_lens, K, t.cfg.vocab_size)
    out = ds.generate(t, tiny["prompts"], drafter=bad, sampling=greedy(), num_draft=K)
    assert out.token_ids == tiny["ar"]
    sampled = [ds.SamplingParams(temperature=1.0, seed=i, max_new_tokens=MAX_NEW, ignore_eos=True)
               for i in range(len(tiny["prompts"]))]
    out = ds.generate(t, tiny["prompts"], drafter=bad, sampling=sampled, num_draft=K)
    assert out.stats["acceptance_per_position"] == [0.0] * K
    assert out.stats["tau"] == 1.0
    assert all(len(x) == MAX_NEW and all(0 <= v < t.cfg.vocab_size for v in x) for x in out.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_request_output_does_not_depend_on_the_batch(tiny, temperature):
    """The same request (prompt, sampling parameters, seed) alone and inside a batch of
    different requests gives the same tokens."""
    t, prompts, drafter = tiny["target"], tiny["prompts"], tiny["drafter"]
    i = 3
    sp = ds.SamplingParams(temperature=temperature, seed=1234, max_new_tokens=MAX_NEW, ignore_eos=True)
    alone = ds.generate(t, [prompts[i]], drafter=drafter, sampling=sp, num_draft=K).token_ids[0]
    others = [ds.SamplingParams(temperature=1.0, seed=j, max_new_tokens=MAX_NEW, ignore_eos=True)
              for j in range(len(prompts))]
    for pos in (i, 6):  # in its own slot, and moved to another one among other prompts
        batch_prompts = list(reversed(prompts)) if pos != i else list(prompts)
        batch_prompts[pos] = prompts[i]
        params = list(others)
        params[pos] = sp
        out = ds.generate(t, batch_prompts, drafter=drafter, sampling=params, num_draft=K)
        assert out.token_ids[pos] == alone
    if temperature == 0.0:
        assert alone == tiny["ar"][i]
