"""Slot compaction: once at most half the slots are still decoding, the active requests move
into the next smaller slot bucket, so finished requests stop costing drafting, target and
verification work. Tokens must not change (greedy and sampled: every request keeps its own
keys), per-request statistics follow their requests, and each slot bucket compiles once."""

import pytest
from spec_helpers import random_prompts as prompts

import dspark_jax as ds
from dspark_jax.models.drafters import OracleDrafter


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target("qwen3", seed=9, num_layers=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def drafter(target):
    cfg = ds.DrafterConfig.for_target(target.cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8)
    return ds.Drafter.random(cfg, seed=6)


def sampling(temperature, lengths):
    return [ds.SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True, seed=100 + i)
            for i, n in enumerate(lengths)]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_compaction_changes_no_token(target, drafter, temperature, with_drafter):
    """Five requests (an 8-slot bucket), one long: as the short ones finish the slots halve
    (4, 2, then 1 — fewer steps if several finish in one cycle) and the long one ends alone,
    with the same tokens and cycles as without compaction."""
    ps = prompts([30, 12, 50, 7, 21], seed=2)
    sp = sampling(temperature, [90, 6, 9, 5, 12])
    kw = dict(drafter=drafter, num_draft=4) if with_drafter else {}
    packed = ds.generate(target, ps, sampling=sp, **kw)
    plain = ds.generate(target, ps, sampling=sp, compact_slots=False, **kw)
    used = packed.stats["buckets"]["slot_buckets"]
    assert used[0] == 8 and used[-1] == 1 and all(a > b for a, b in zip(used, used[1:]))
    assert plain.stats["buckets"]["slot_buckets"] == [8]
    assert packed.token_ids == plain.token_ids
    assert [len(t) for t in packed.token_ids] == [90, 6, 9, 5, 12]
    assert packed.stats["cycles"] == plain.stats["cycles"]
    if with_drafter:
        for key in ("tau", "acceptance_per_position", "verified_per_request"):
            assert packed.stats[key] == plain.stats[key]
    again = ds.generate(target, ps, sampling=sp, **kw)
    assert again.stats["compiles"] == 0 and again.token_ids == packed.token_ids


@pytest.mark.slow
def test_oracle_drafter_follows_its_slot(target):
    """The oracle's per-slot state (which continuation it drafts) moves with its request: after
    compaction the long request still has every draft accepted, as without compaction."""
    ps = prompts([20, 9, 33], seed=4)
    sp = [ds.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (80, 4, 4)]
    ar = ds.generate(target, ps, sampling=sp)
    oracle = OracleDrafter.from_lists(ar.token_ids, [len(p) for p in ps], target.cfg.vocab_size, block_size=4)
    spec = ds.generate(target, ps, drafter=oracle, sampling=sp)
    plain = ds.generate(target, ps, drafter=oracle, sampling=sp, compact_slots=False)
    assert spec.stats["buckets"]["slot_buckets"][-1] == 1
    assert spec.token_ids == plain.token_ids == ar.token_ids
    assert spec.stats["acceptance_per_position"] == plain.stats["acceptance_per_position"]
    assert spec.stats["acceptance_per_position"][0] == 1.0


def test_short_tails_do_not_compact(target):
    """A tail shorter than 32 tokens does not pay for another compiled bucket."""
    ps = prompts([10, 10], seed=5)
    out = ds.generate(target, ps, sampling=sampling(0.0, [30, 5]))  # 25 tokens left: no compaction
    assert out.stats["buckets"]["slot_buckets"] == [2]
