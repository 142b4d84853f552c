"""Seeds: any Python int is a valid, reproducible, batch-independent seed; None is fresh randomness."""

import jax
import numpy as np
import pytest

import dspark_jax as ds
from dspark_jax.decoding.seeds import request_keys

PROMPT = [5, 17, 3, 9]
NEW = 12


def sampled(seed):
    return ds.SamplingParams(temperature=1.0, max_new_tokens=NEW, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def target():
    # Init-scale weights: next-token distributions close to uniform over 128 tokens, so two
    # 12-token samples coincide with probability ~128^-12 unless the keys are equal.
    return ds.Target.random(ds.ModelConfig.tiny(num_layers=2), seed=0)


def test_small_seeds_are_jax_seeds_and_all_ints_give_distinct_keys():
    data = np.asarray(jax.random.key_data(request_keys([0, 7, 2**32 - 1])))
    for row, s in zip(data, [0, 7, 2**32 - 1]):
        np.testing.assert_array_equal(row, jax.random.key_data(jax.random.key(s)))
    seeds = [0, 1, -1, -2, 2**32, 2**40, 2**40 + 1, 2**64, -(2**64), 2**200]
    rows = {tuple(r) for r in np.asarray(jax.random.key_data(request_keys(seeds))).tolist()}
    assert len(rows) == len(seeds)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [-1, 2**40, 2**200])
def test_any_int_seed_is_reproducible_and_batch_independent(target, seed):
    alone = ds.generate(target, [PROMPT], sampling=sampled(seed)).token_ids[0]
    assert ds.generate(target, [PROMPT], sampling=sampled(seed)).token_ids[0] == alone
    batch = ds.generate(target, [[1, 2], PROMPT, [9] * 7], sampling=[sampled(3), sampled(seed), sampled(None)])
    assert batch.token_ids[1] == alone


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_no_seed_means_fresh_randomness_that_stats_can_replay(target):
    assert ds.SamplingParams().seed is None
    a = ds.generate(target, [PROMPT] * 2, sampling=sampled(None))
    b = ds.generate(target, [PROMPT] * 2, sampling=sampled(None))
    # 4 requests of 12 near-uniform tokens: any two equal would mean a repeated key.
    assert len({tuple(t) for t in a.token_ids + b.token_ids}) == 4
    replay = ds.generate(target, [PROMPT] * 2, sampling=[sampled(s) for s in a.stats["seeds"]])
    assert replay.token_ids == a.token_ids
