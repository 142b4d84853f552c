"""`DecodeConfig`: one place that validates the decoding options and resolves the policy;
`generate()` and the serving engine take it whole or as loose options, with the same result."""

import numpy as np
import pytest

import dspark_jax as ds
from dspark_jax.models.drafters import Drafter
from serve.engine import Engine


@pytest.fixture(scope="module")
def pair(tiny_target):
    target = tiny_target("llama", seed=3)
    cfg = ds.DrafterConfig.for_target(target.cfg, block_size=4, num_layers=1, markov_rank=8, num_feature_layers=2)
    return target, Drafter.random(cfg, seed=2)


@pytest.mark.parametrize("kw, pattern", [
    (dict(policy="greedy"), "policy must be one of"),
    (dict(policy="dspark", scheduler="fastest"), "scheduler must be one of"),
    (dict(policy="threshold", threshold=1.5), r"threshold must be a survival probability in \[0, 1\]"),
    (dict(num_draft=-1), "num_draft must be an integer >= 0"),
    (dict(num_draft=2.5), "num_draft must be an integer >= 0"),
    (dict(prefill_chunk=0), "prefill_chunk must be an integer >= 1"),
    (dict(chunk_cycles="4"), "chunk_cycles must be an integer >= 1"),
])
def test_invalid_options(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        ds.DecodeConfig(**kw)


def test_resolve(pair):
    target, drafter = pair
    assert ds.DecodeConfig().resolve(target, None) == ("ar", None, 0)
    policy, d, K = ds.DecodeConfig().resolve(target, drafter)
    assert (policy, d, K) == ("fixed", drafter, drafter.block_size)
    assert ds.DecodeConfig(policy="ar").resolve(target, drafter) == ("ar", None, 0)
    assert ds.DecodeConfig(num_draft=0).resolve(target, drafter) == ("ar", None, 0)
    assert ds.DecodeConfig(policy="dspark", num_draft=2).resolve(target, drafter)[::2] == ("dspark", 2)
    with pytest.raises(ValueError, match="needs a drafter"):
        ds.DecodeConfig(policy="fixed").resolve(target, None)
    with pytest.raises(ValueError, match=r"num_draft must be in \[0, 4\]"):
        ds.DecodeConfig(num_draft=5).resolve(target, drafter)
    assert ds.DecodeConfig(policy="dspark", scheduler="sync").loop_schedule("dspark") == "sync"
    assert ds.DecodeConfig(policy="threshold").loop_schedule("threshold") == "threshold"
    assert ds.DecodeConfig().loop_schedule("ar") == "fixed"


@pytest.mark.slow
def test_config_or_loose_options_same_output(pair):
    target, drafter = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, target.cfg.vocab_size, n).tolist() for n in (5, 9)]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    a = ds.generate(target, prompts, drafter=drafter, sampling=sp, policy="fixed", num_draft=3)
    b = ds.generate(target, prompts, drafter=drafter, sampling=sp,
                    config=ds.DecodeConfig(policy="fixed", num_draft=3))
    assert a.token_ids == b.token_ids and a.stats["num_draft"] == b.stats["num_draft"] == 3
    with pytest.raises(ValueError, match="either as config"):
        ds.generate(target, prompts, drafter=drafter, sampling=sp, num_draft=2, config=ds.DecodeConfig())
    with pytest.raises(TypeError, match="config must be a DecodeConfig"):
        ds.generate(target, prompts, config={"policy": "fixed"})
    eng = Engine(target, drafter, slots=2, max_len=128, config=ds.DecodeConfig(policy="fixed", num_draft=3))
    reqs = [eng.submit(p, sp) for p in prompts]
    eng.run()
    assert [r.tokens for r in reqs] == a.token_ids
    with pytest.raises(ValueError, match="either as config"):
        Engine(target, drafter, slots=2, max_len=128, policy="ar", config=ds.DecodeConfig())
