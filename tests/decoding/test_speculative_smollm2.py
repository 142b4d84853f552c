"""Greedy speculative decoding of the real SmolLM2-135M-Instruct is token-identical to its
autoregressive greedy decoding (docs/method.md §5), with a random drafter (almost everything
rejected), with an oracle drafter (almost everything accepted), and with the shipped trained
drafter with its 8,192-token draft vocabulary and the top-k sequential bias on (k = 32).

One AR run and two speculative runs of 8 chat prompts × up to 128 new tokens (all 8 answers
run the full 128). Runtime on a shared 2-core CPU: ~5-6 min (AR ~90 s, oracle ~55 s,
random drafter ~160 s: 127 cycles each verifying 5 tokens per request; compiles ~25-35 s
per run).

The comparison is as exact as fp32 allows: a mismatch is reported with the target's top-2
logit gap at the first differing position, so a near-tie can be told apart from a bug.
Observed: with num_draft=1 instead of 4 (a different packed-step shape), prompt 2 differs
at new token 68, where the top-2 logits are 12.940128 vs 12.940126 (gap 1.9e-6) — a
summation-order tie, not a verification bug. With the settings below the outputs match.
"""

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


@pytest.fixture(scope="module")
def target():
    return ds.load_target("smollm2-135m")


@pytest.fixture(scope="module")
def ar(target):
    return ds.generate(target, CHATS, sampling=GREEDY).token_ids


def mismatch_report(target, i, want, got) -> str:
    n = min(len(want), len(got))
    j = next(j for j in range(n + 1) if j == n or want[j] != got[j])
    ids = encode_prompt(target, CHATS[i]) + want[:j]
    top = np.sort(np.asarray(ds.logits(target, ids))[-1])[::-1]
    return (f"prompt {i}: first difference at new token {j} (AR {want[j:j + 3]}, spec {got[j:j + 3]}, "
            f"lengths {len(want)} / {len(got)}); target top-2 logit gap there: {top[0] - top[1]:.3g}")


@pytest.mark.parametrize("kind", ["random", "oracle", "trained"])
def test_greedy_speculative_equals_autoregressive(target, ar, kind):
    if kind == "random":
        cfg = DrafterConfig.for_target(target.cfg, num_layers=1, block_size=BLOCK, markov_rank=32)
        drafter = Drafter.random(cfg, seed=0)
    elif kind == "trained":
        shipped = ds.load_drafter("smollm2-135m-dspark", target)
        assert shipped.cfg.draft_vocab_size == 8192
        drafter = Drafter(shipped.cfg.replace(draft_topk=32), shipped.graphdef, shipped.state)
    else:
        lens = [len(encode_prompt(target, c)) for c in CHATS]
        drafter = OracleDrafter.from_lists(ar, lens, target.cfg.vocab_size, block_size=BLOCK)
    out = ds.generate(target, CHATS, drafter=drafter, sampling=GREEDY, num_draft=BLOCK)
    bad = [mismatch_report(target, i, a, b) for i, (a, b) in enumerate(zip(ar, out.token_ids)) if a != b]
    assert not bad, "\n".join(bad)
    assert sum(len(a) for a in ar) > 4 * MAX_NEW  # long answers, not early EOS
    if kind == "oracle":
        # Every cycle accepts all γ drafts except where an answer ends at EOS (the oracle
        # has no token there): τ close to γ + 1.
        assert out.stats["tau"] > BLOCK + 0.5, out.stats
    elif kind == "random":
        assert out.stats["tau"] < 1.5, out.stats
    else:
        assert out.stats["acceptance_per_position"][0] > 0.05, out.stats  # it does get drafts accepted
