"""Greedy speculative decoding of the real SmolLM2-135M-Instruct is token-identical to its
autoregressive greedy decoding (docs/method.md §5), with a random drafter (almost everything
rejected), with an oracle drafter (almost everything accepted), and with the shipped trained
drafter with its 8,192-token draft vocabulary and the top-k sequential bias on (k = 32).

One AR run of 8 chat prompts × up to 128 new tokens (all 8 answers run the full 128), the
oracle and trained drafters on all of them, the random drafter on the first 4 prompts × 64
tokens (one cycle a token: the costliest run per token).

The comparison is as exact as fp32 allows. The target's logits come out of three compute
paths (one-token decode steps, packed verification steps, the full forward) whose summation
orders differ, so two tokens whose logits lie within a few ulps of each other can swap places
between paths — on one machine and not another. These answers hold one such tie: prompt 2,
new token 68, top-2 gap 1.9e-5 by the full forward here (1.1e-5 on the CI machine, where
the speculative runs took the other token). Over the other 1,023
positions the smallest top-2 gap is 4.2e-4. So an answer that differs from autoregressive
decoding passes only if (1) it first differs where the target's top-2 gap is below TIE and
(2) every token it emitted, before and after that point, is the target's argmax given its
own prefix to within TIE (one teacher-forced forward over the whole answer). A verification
bug emits a token that is not the argmax, by far more than TIE, and fails (2).
"""

import dataclasses

import numpy as np
import pytest

import dspark_jax as ds
from dspark_jax.decoding.generate import encode_prompt
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import Drafter, OracleDrafter

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

MAX_NEW = 128
BLOCK = 4
GREEDY = ds.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
# First turns of MT-Bench writing / reasoning prompts: they elicit long answers.
PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
    "experiences and must-see attractions.",
    "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' "
    "you prepared. Keep the email short and to the point.",
    "Describe a vivid and unique character, using strong imagery and creative language.",
    "Write a descriptive paragraph about a bustling marketplace, incorporating sensory details such as "
    "smells, sounds, and visual elements.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "What are the main causes of climate change, and what can individuals do about it?",
    "Write a short story about a robot who learns to paint.",
    "Give me step-by-step instructions for baking bread at home.",
]
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]
# fp32 logit tie (|logits| ≤ ~45 here, ulp ~4e-6): between the one observed tie (1.9e-5) and
# the next-closest top-2 gap of these answers (4.2e-4).
TIE = 1e-4


@pytest.fixture(scope="module")
def target():
    return ds.load_target("smollm2-135m")


@pytest.fixture(scope="module")
def ar(target):
    return ds.generate(target, CHATS, sampling=GREEDY).token_ids


def answer_logits(target, i, new_ids) -> np.ndarray:
    """The target's logits [len(new_ids), V] for each emitted token, given the prompt and the
    answer before it: one teacher-forced forward, padded to a multiple of 256 tokens (causal,
    so the padding changes no earlier row; one compiled shape for every call)."""
    ids = encode_prompt(target, CHATS[i]) + list(new_ids)
    padded = ids + [0] * (-len(ids) % 256)
    return np.asarray(ds.logits(target, padded))[len(ids) - len(new_ids) - 1:len(ids) - 1]


def mismatch(target, i, want, got) -> str | None:
    """None when `got` differs from `want` only by an fp32 tie (see the module docstring),
    else the report of the first difference."""
    n = min(len(want), len(got))
    j = next(j for j in range(n + 1) if j == n or want[j] != got[j])
    lg = answer_logits(target, i, got + [0])  # one more row: the logits after all of `got`
    top = np.sort(lg[j])[::-1]  # got[:j] == want[:j]: the target's logits at the first difference
    gap = top[0] - top[1]
    emitted = lg[:len(got)]  # the rows that chose `got`
    worst = float((emitted.max(-1) - emitted[np.arange(len(got)), got]).max()) if got else 0.0
    if j < n and gap < TIE and worst < TIE:
        return None
    return (f"prompt {i}: first difference at new token {j} (AR {want[j:j + 3]}, spec {got[j:j + 3]}, "
            f"lengths {len(want)} / {len(got)}); target top-2 logit gap there: {gap:.3g}; "
            f"the speculative answer's largest distance below the argmax: {worst:.3g}")


def test_tie_check(target, ar):
    """The tie allowance accepts exactly what fp32 can flip, and cannot hide a verification
    bug. Taking the other token at prompt 2's tie and then following the target greedily from
    there passes; the AR answer's own continuation spliced after the other token is reported,
    and so is a non-argmax token anywhere else, and a truncated answer."""
    j = 68
    prompt = encode_prompt(target, CHATS[2])
    lg = answer_logits(target, 2, ar[2][:j + 1])[j]
    top2 = [int(t) for t in np.argsort(lg)[::-1][:2]]
    assert lg[top2[0]] - lg[top2[1]] < TIE and ar[2][j] in top2  # the tie this module is about
    other = top2[1] if top2[0] == ar[2][j] else top2[0]
    prefix = ar[2][:j] + [other]
    rest = ds.generate(target, [prompt + prefix], sampling=ds.SamplingParams(
        temperature=0.0, max_new_tokens=len(ar[2]) - len(prefix))).token_ids[0]
    assert mismatch(target, 2, ar[2], prefix + rest) is None
    spliced = prefix + ar[2][j + 1:]
    assert mismatch(target, 2, ar[2], spliced) is not None
    wrong = list(ar[0])
    wrong[40] = (wrong[40] + 1) % target.cfg.vocab_size
    assert mismatch(target, 0, ar[0], wrong) is not None
    assert mismatch(target, 0, ar[0], ar[0][:-1]) is not None


@pytest.mark.parametrize("kind", ["random", "oracle", "trained"])
def test_greedy_speculative_equals_autoregressive(target, ar, kind):
    chats, sampling, want = CHATS, GREEDY, ar
    if kind == "random":
        cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=BLOCK, markov_rank=32)
        drafter = Drafter.random(cfg, seed=0)
        # Nearly every draft rejected: one cycle a token. Half the prompts and half the
        # tokens exercise that as well as all of them (greedy answers are prefixes of the
        # 128-token ones), at a quarter of the cost.
        chats, sampling = CHATS[:4], dataclasses.replace(GREEDY, max_new_tokens=MAX_NEW // 2)
        want = [a[:MAX_NEW // 2] for a in ar[:4]]
    elif kind == "trained":
        shipped = ds.load_drafter("smollm2-135m-dspark", target)
        assert shipped.cfg.draft_vocab_size == 8192
        drafter = Drafter(shipped.cfg.replace(draft_topk=32), shipped.graphdef, shipped.state)
    else:
        lens = [len(encode_prompt(target, c)) for c in CHATS]
        drafter = OracleDrafter.from_lists(ar, lens, target.cfg.vocab_size, block_size=BLOCK)
    out = ds.generate(target, chats, drafter=drafter, sampling=sampling, num_draft=BLOCK)
    bad = [mismatch(target, i, a, b) for i, (a, b) in enumerate(zip(want, out.token_ids)) if a != b]
    assert not [b for b in bad if b], "\n".join(b for b in bad if b)
    assert len(bad) <= 1, f"{len(bad)} answers differ at fp32 ties; these answers hold one such tie"
    assert sum(len(a) for a in want) > len(want) * sampling.max_new_tokens // 2  # long answers, not early EOS
    if kind == "oracle":
        # Every cycle accepts all γ drafts except where an answer ends at EOS (the oracle
        # has no token there): τ close to γ + 1 for every answer the oracle knows. An answer
        # that took the other side of the fp32 tie leaves the oracle's list there, and its
        # drafts are rejected from then on (τ of the whole batch ~4.0 instead of ~4.9).
        same = [i for i, (a, b) in enumerate(zip(ar, out.token_ids)) if a == b]
        tau = [(len(out.token_ids[i]) - 1) / out.stats["cycles"][i] for i in same]
        assert len(same) >= len(CHATS) - 1 and min(tau) > BLOCK + 0.5, (tau, out.stats)
    elif kind == "random":
        assert out.stats["tau"] < 1.5, out.stats
    else:
        assert out.stats["acceptance_per_position"][0] > 0.05, out.stats  # it does get drafts accepted


def test_rounded_activations_decode_speculatively_bitwise_as_autoregressively():
    """With the activations rounded to bf16 (`weight_terms=1`), a 1-ulp difference between a
    verification step's numbers and a one-token step's flips a rounding and moves whole logits
    (BENCHMARKS.md, "Stop 40": 1% of argmaxes on random tokens). Batch-invariant decode steps
    (`ModelConfig.batch_invariant`, on with 1 term) compute the same bits either way, so here
    greedy speculative output must equal autoregressive output exactly, with no tie allowance:
    the shipped drafter with prompt lookup, 4 prompts × 40 tokens decoded together, the fixed
    policy (a verification of every request's block each cycle). (The scheduled policies, whose loops
    mix one-token and verification buckets, are checked the same way on the tiny model in
    tests/models/test_narrow_weights.py; on SmolLM2 their step-rate profiling took minutes.)"""
    t1 = ds.load_target("smollm2-135m", weight_dtype="bfloat16", weight_terms=1)
    assert t1.cfg.fixed_order_decode
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=40)  # bf16-rounded steps: the slowest of this module on CPU
    chats = CHATS[4:]
    ar = ds.generate(t1, chats, sampling=sp).token_ids
    drafter = ds.load_drafter("smollm2-135m-dspark+ngram", t1)
    out = ds.generate(t1, chats, drafter=drafter, sampling=sp, policy="fixed")
    assert out.token_ids == ar
    assert out.stats["tau"] > 1.5  # drafts were verified and accepted
