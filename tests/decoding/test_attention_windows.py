"""Attention windows (cache-length buckets): attention reads only the part of the cache that
holds context, and the window doubles as contexts grow. The tokens must not change — greedy
and sampled, autoregressive and speculative — each window compiles once, and a warm call
compiles nothing."""

import pytest
from spec_helpers import random_prompts as prompts

import dspark_jax as ds
from dspark_jax.decoding.generate import attention_windows, pick_window


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target("llama", seed=7, num_layers=2, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def drafter(target):
    cfg = ds.DrafterConfig.for_target(target.cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8)
    return ds.Drafter.random(cfg, seed=4)


def test_window_ladder():
    assert attention_windows(128) == [] and attention_windows(256) == []
    assert attention_windows(1024) == [256, 512]
    assert attention_windows(384) == [256]  # a cache capped at the context: its own size last
    assert pick_window([256, 512], 256) == 256 and pick_window([256, 512], 257) == 512
    assert pick_window([256, 512], 513) is None  # the whole cache
    # fine: a 1.5× step between doublings, below the cache
    assert attention_windows(2048, fine=True) == [256, 384, 512, 768, 1024, 1536]
    assert attention_windows(512, fine=True) == [256, 384] and attention_windows(384, fine=True) == [256]
    assert pick_window([256, 384], 300) == 384


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_windows_change_no_token(target, drafter, temperature, with_drafter):
    """Prompts of 180 and 40 tokens, 120 new tokens: the 512-token cache runs in a 256 window
    until the long request passes it, then in the whole cache; tokens equal whole-cache
    attention (and, greedy, autoregressive decoding)."""
    ps = prompts([180, 40], seed=1)
    sp = ds.SamplingParams(temperature=temperature, max_new_tokens=120, ignore_eos=True, seed=11)
    kw = dict(drafter=drafter, num_draft=4) if with_drafter else {}
    win = ds.generate(target, ps, sampling=sp, **kw)
    whole = ds.generate(target, ps, sampling=sp, windowed_attention=False, **kw)
    assert win.stats["buckets"]["cache_len"] == 512
    assert win.stats["buckets"]["attention_windows"] == [256, 512]
    assert whole.stats["buckets"]["attention_windows"] == [512]
    assert win.token_ids == whole.token_ids
    assert all(len(t) == 120 for t in win.token_ids)
    if with_drafter:
        assert win.stats["cycles"] == whole.stats["cycles"]
    if with_drafter and temperature == 0.0:
        assert win.token_ids == ds.generate(target, ps, sampling=sp).token_ids


@pytest.mark.slow
def test_each_window_compiles_once(target, drafter):
    """Three windows (256, 512, 1024) on the way to a 1024-token cache; a second call of the same
    shape compiles nothing."""
    ps = prompts([100], seed=3)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=700, ignore_eos=True)
    first = ds.generate(target, ps, drafter=drafter, sampling=sp, num_draft=4)
    assert first.stats["buckets"]["attention_windows"] == [256, 512, 1024]
    again = ds.generate(target, ps, drafter=drafter, sampling=sp, num_draft=4)
    assert again.stats["compiles"] == 0
    assert again.token_ids == first.token_ids


@pytest.mark.slow
def test_fine_windows_change_no_token(target, drafter):
    """`DecodeConfig(fine_windows=True)`: the 180-token prompt's 120 new tokens (~305
    positions) finish in the 384 window of the 512 cache, where the doubling windows move to
    the whole cache; greedy speculative tokens equal whole-cache attention and autoregressive
    decoding."""
    ps = prompts([180, 40], seed=1)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True)
    cfg = ds.DecodeConfig(policy="fixed", num_draft=4, fine_windows=True)
    fine = ds.generate(target, ps, drafter=drafter, sampling=sp, config=cfg)
    assert fine.stats["buckets"]["attention_windows"] == [256, 384]
    whole = ds.generate(target, ps, drafter=drafter, sampling=sp, num_draft=4, windowed_attention=False)
    assert fine.token_ids == whole.token_ids == ds.generate(target, ps, sampling=sp).token_ids
    assert fine.stats["cycles"] == whole.stats["cycles"]
