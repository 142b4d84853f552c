"""Long prompts: cache buckets never exceed the model's context, and chunked prefill (bounded
memory) gives the same tokens as prefilling each prompt in one step."""

import pytest
from spec_helpers import random_prompts as prompts

import dspark_jax as ds

GREEDY = ds.SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target("qwen3", seed=5, num_layers=2, max_position_embeddings=384)


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_cache_bucket_is_capped_at_the_context(target):
    out = ds.generate(target, prompts([300]), sampling=ds.SamplingParams(temperature=0.0, max_new_tokens=60))
    assert out.stats["buckets"]["cache_len"] == 384  # next power of two (512) would exceed the context


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 48, 64])
def test_chunked_prefill_equals_one_step(target, chunk):
    """Three prompts of different lengths, each prefilled on its own in chunks."""
    ps = prompts([300, 37, 129])
    whole = ds.generate(target, ps, sampling=GREEDY, prefill_chunk=4096)
    # Each prompt in one step: the chunk is the longest prompt's bucket (capped at the context).
    assert whole.stats["buckets"]["prefill_chunk"] == 384
    chunked = ds.generate(target, ps, sampling=GREEDY, prefill_chunk=chunk)
    assert chunked.stats["buckets"]["prefill_chunk"] == chunk
    assert chunked.token_ids == whole.token_ids


@pytest.mark.slow
def test_chunked_prefill_feeds_the_drafter(target):
    """The drafter's context cache is filled chunk by chunk too: greedy speculative output
    still equals autoregressive output, with the same acceptance as one-step prefill."""
    cfg = ds.DrafterConfig.for_target(target.cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8)
    drafter = ds.Drafter.random(cfg, seed=2)
    ps = prompts([200, 90], seed=1)
    ar = ds.generate(target, ps, sampling=GREEDY)
    whole = ds.generate(target, ps, drafter=drafter, sampling=GREEDY, prefill_chunk=4096)
    chunked = ds.generate(target, ps, drafter=drafter, sampling=GREEDY, prefill_chunk=32)
    assert chunked.token_ids == whole.token_ids == ar.token_ids
    assert chunked.stats["cycles"] == whole.stats["cycles"]


@pytest.mark.slow
def test_speculative_decoding_up_to_the_last_context_position(target):
    """prompt + max_new_tokens = the whole context, K = 4 drafts: the capped cache (384, not 512)
    has no room for drafts past the end, which are never verified; output equals AR."""
    cfg = ds.DrafterConfig.for_target(target.cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8)
    drafter = ds.Drafter.random(cfg, seed=3)
    ps = prompts([370], seed=2)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=384 - 370, ignore_eos=True)
    ar = ds.generate(target, ps, sampling=sp)
    spec = ds.generate(target, ps, drafter=drafter, sampling=sp, num_draft=4)
    assert spec.stats["buckets"]["cache_len"] == 384
    assert len(ar.token_ids[0]) == 14 and spec.token_ids == ar.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_per_request_prefill_equals_batched(target, temperature):
    """generate() prefills each prompt on its own (cost Σ over prompts); the batched program
    over all slots gives the same tokens, with and without a drafter (whose context cache
    both fill), greedy and sampled (same seeds)."""
    cfg = ds.DrafterConfig.for_target(target.cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8)
    drafter = ds.Drafter.random(cfg, seed=4)
    ps = prompts([3, 150, 41, 9, 77], seed=6)
    sp = ds.SamplingParams(temperature=temperature, max_new_tokens=12, ignore_eos=True, seed=11)
    for d in (None, drafter, ds.NgramDrafter(block_size=4)):
        per = ds.generate(target, ps, drafter=d, sampling=sp, prefill_chunk=64)
        bat = ds.generate(target, ps, drafter=d, sampling=sp, prefill_chunk=64, batched_prefill=True)
        assert per.token_ids == bat.token_ids
        assert per.stats["cycles"] == bat.stats["cycles"]


def test_prefill_pieces_cover_the_prompt_with_little_padding():
    """Every prompt length gets pieces that hold it: full `max_rows` pieces, then one piece from
    the 16, 32, 48, 64, 96, 128, 192, … ladder, padded by less than a third of its rows."""
    from dspark_jax.decoding.prefill import prefill_pieces, prefill_rows

    ladder = {16, 32, 48, 64, 96, 128, 192, 256, 384, 512}
    assert [prefill_rows(n, 512) for n in (1, 16, 17, 33, 48, 49, 65, 96, 97, 129, 200, 385)] == [
        16, 16, 32, 48, 48, 64, 96, 96, 128, 192, 256, 512]
    for n in range(1, 1300):
        pieces = prefill_pieces(n, 512)
        assert all(p == 512 for p in pieces[:-1]) and pieces[-1] in ladder
        pad = sum(pieces) - n
        assert 0 <= pad < max(16, pieces[-1] / 3 + 1)
    assert prefill_pieces(300, 48) == [48] * 6 + [16]  # a chunk cap the ladder does not hold
    assert prefill_pieces(5, 1) == [1] * 5
