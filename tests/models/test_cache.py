"""KV-cache invariants of the packed step on a tiny random target.

Every decoding path (prefill, decode, verification of draft blocks) is a packed step over
the slot cache, so each must reproduce the full causal forward. Tolerance 1e-5 max abs on
logits of std ~2-3: the paths differ only in float32 summation order (observed ~1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as ds
from dspark_jax.models.transformer import KVCache, packed_step

ATOL = 1e-5
V = 128  # ModelConfig.tiny vocab
T = 16  # every reference sequence has this length, so the full forward compiles once per config
# Two layers are enough for every invariant here (layer 1 reads what layer 0 wrote into the
# cache, and scan needs > 1 layer) and halve the compile time of the unrolled model.
LAYERS = 2


def ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, n).astype(np.int32)


def step(target, cache, slot_tokens: list, starts: list, *, n_bucket: int, q_max: int):
    """One packed step; `slot_tokens[s]` are slot s's tokens (possibly none). Returns per-slot logits."""
    counts = [len(t) for t in slot_tokens]
    flat = np.zeros(n_bucket, np.int32)
    flat[: sum(counts)] = np.concatenate([np.asarray(t, np.int32) for t in slot_tokens])
    args = (cache, jnp.asarray(flat), jnp.asarray(starts, jnp.int32), jnp.asarray(counts, jnp.int32))
    logits, _, cache = packed_step(target.graphdef, target.state, *args, q_max=q_max)
    logits = np.asarray(logits)
    offs = np.cumsum([0] + counts)
    return [logits[offs[s] : offs[s + 1]] for s in range(len(counts))], cache


def full(target, tokens) -> np.ndarray:
    return np.asarray(ds.logits(target, np.asarray(tokens, np.int32)))


def test_prefill_then_single_token_steps_equal_full_forward(tiny_target):
    target = tiny_target("qwen3", seed=1, num_layers=LAYERS)
    seq = ids(T, seed=0)
    ref = full(target, seq)
    assert ref.std() > 0.5
    cache = KVCache.zeros(target.cfg, 1, 32)
    (got,), cache = step(target, cache, [seq[:10]], [0], n_bucket=16, q_max=16)
    np.testing.assert_allclose(got, ref[:10], rtol=0, atol=ATOL)
    for pos in range(10, T):
        (got,), cache = step(target, cache, [seq[pos : pos + 1]], [pos], n_bucket=1, q_max=1)
        np.testing.assert_allclose(got, ref[pos : pos + 1], rtol=0, atol=ATOL)


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_one_step_mixing_slots_at_different_positions(tiny_target):
    """Prefill ragged prefixes; then one step holds 2, 1 and 4 tokens of three slots at
    three different positions while a fourth slot sits out (count 0); then that slot
    resumes. Every token's logits equal its sequence's full forward."""
    target = tiny_target("llama", seed=2, num_layers=LAYERS)
    seqs = [ids(T, 10 + s) for s in range(4)]
    prefix = [3, 13, 6, 8]
    cache = KVCache.zeros(target.cfg, 4, 32)
    pre, cache = step(target, cache, [s[:n] for s, n in zip(seqs, prefix)], [0] * 4,
                      n_bucket=32, q_max=16)
    new = [2, 1, 4, 0]
    got, cache = step(target, cache, [s[n : n + c] for s, n, c in zip(seqs, prefix, new)], prefix,
                      n_bucket=8, q_max=4)  # 7 tokens + 1 padding
    assert got[3].shape[0] == 0
    after = [n + c for n, c in zip(prefix, new)]
    last, cache = step(target, cache, [s[n : n + 1] for s, n in zip(seqs, after)], after,
                       n_bucket=4, q_max=1)
    for s, seq in enumerate(seqs):
        ref = full(target, seq)
        np.testing.assert_allclose(pre[s], ref[: prefix[s]], rtol=0, atol=ATOL)
        np.testing.assert_allclose(got[s], ref[prefix[s] : after[s]], rtol=0, atol=ATOL)
        np.testing.assert_allclose(last[s], ref[after[s] : after[s] + 1], rtol=0, atol=ATOL)


def test_rejected_drafts_are_overwritten_not_read(tiny_target):
    """Speculative decoding writes draft K/V past the committed length, then rejects some:
    the next step starts at the committed length and must not see the stale entries."""
    target = tiny_target("qwen3", seed=3, num_layers=LAYERS)
    seq = ids(T, 20)
    cache = KVCache.zeros(target.cfg, 1, 32)
    _, cache = step(target, cache, [seq[:8]], [0], n_bucket=16, q_max=16)
    # "Verify" 5 tokens of which only the first 2 are correct (i.e. equal seq[8:10]).
    drafts = np.concatenate([seq[8:10], (seq[10:13] + 1) % V])
    _, cache = step(target, cache, [drafts], [8], n_bucket=8, q_max=8)
    got, cache = step(target, cache, [seq[10:14]], [10], n_bucket=8, q_max=8)
    np.testing.assert_allclose(got[0], full(target, seq)[10:14], rtol=0, atol=ATOL)


def test_last_only_logits_and_padding_slots(tiny_target):
    """`last_only` returns each slot's last-token logits; an empty slot (count 0) gives
    finite values and leaves the other slots' results unchanged."""
    target = tiny_target("llama", seed=4, num_layers=LAYERS)
    seqs = [ids(T, 30), ids(T, 31)]
    lens = [5, 11]
    flat = np.zeros(32, np.int32)
    flat[:16] = np.concatenate([s[:n] for s, n in zip(seqs, lens)])
    logits, _, _ = packed_step(
        target.graphdef, target.state, KVCache.zeros(target.cfg, 3, 16), jnp.asarray(flat),
        jnp.zeros(3, jnp.int32), jnp.asarray(lens + [0], jnp.int32), q_max=16, last_only=True,
    )
    logits = np.asarray(logits)
    assert logits.shape == (3, V) and np.isfinite(logits).all()
    for s, (seq, n) in enumerate(zip(seqs, lens)):
        np.testing.assert_allclose(logits[s], full(target, seq)[n - 1], rtol=0, atol=ATOL)


def _stack_into_scan(target_unrolled):
    """The same weights as a scan_layers=True target (layer params stacked on a new axis 0)."""
    cfg = target_unrolled.cfg.replace(scan_layers=True)
    graphdef, abstract = ds.Target.abstract(cfg)
    src = dict(nnx.to_flat_state(target_unrolled.state))
    out = []
    for path, var in nnx.to_flat_state(abstract):
        if path[0] == "layers":
            v = jnp.stack([src[("layers", i) + path[1:]][...] for i in range(cfg.num_layers)])
        else:
            v = src[path][...]
        assert v.shape == var.get_value().shape, path
        out.append((path, var.replace(v)))
    return ds.Target(cfg, graphdef, nnx.from_flat_state(out))


def test_resized_cache_keeps_every_used_position(tiny_target):
    """The decode loops size the cache to the attention window (`KVCache.resized`): cutting
    it past the used positions and growing it back must leave decoding exact; the unrolled
    target's cache is per layer, the scanned one's stacked, with the same slot rows."""
    target = tiny_target("qwen3", seed=1, num_layers=LAYERS)
    seq = ids(T, seed=0)
    ref = full(target, seq)
    cache = KVCache.zeros(target.cfg, 2, 32)
    assert cache.per_layer and len(cache.k) == LAYERS and cache.length == 32 and cache.num_slots == 2
    (got, _), cache = step(target, cache, [seq[:10], seq[:3]], [0, 0], n_bucket=16, q_max=16)
    np.testing.assert_allclose(got, ref[:10], rtol=0, atol=ATOL)
    small = cache.resized(12)  # positions 0..9 used; 12 hold them
    assert small.length == 12 and small.k[0].shape == (2, target.cfg.num_kv_heads, target.cfg.head_dim, 12)
    np.testing.assert_array_equal(np.asarray(small.v[1]), np.asarray(cache.v[1])[:, :, :12])
    (got, _), small = step(target, small, [seq[10:11], []], [10, 3], n_bucket=1, q_max=1)
    np.testing.assert_allclose(got, ref[10:11], rtol=0, atol=ATOL)
    grown = small.resized(24)
    assert grown.length == 24 and not np.asarray(grown.k[0])[..., 12:].any()
    (got, _), grown = step(target, grown, [seq[11:T], []], [11, 3], n_bucket=8, q_max=8)
    np.testing.assert_allclose(got, ref[11:T], rtol=0, atol=ATOL)
    row = grown.slot_row(0)
    assert row.num_slots == 1
    back = grown.with_slot_row(row, 1)  # slot 0's row copied onto slot 1
    np.testing.assert_array_equal(np.asarray(back.k[1])[1], np.asarray(grown.k[1])[0])
    stacked = KVCache.zeros(target.cfg.replace(scan_layers=True), 2, 32)
    assert not stacked.per_layer and stacked.resized(8).length == 8 and stacked.slot_row(1).num_slots == 1
    with pytest.raises(ValueError, match="per-layer KV cache"):
        step(target, stacked, [seq[:2], []], [0, 0], n_bucket=2, q_max=2)


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_scan_layers_equals_unrolled(tiny_target):
    unrolled = tiny_target("qwen3", seed=5, num_layers=LAYERS)
    scanned = _stack_into_scan(unrolled)
    seq = ids(T, 40)
    ref = full(unrolled, seq)
    np.testing.assert_allclose(full(scanned, seq), ref, rtol=0, atol=ATOL)
    # ... and through the cache: prefill, then a 3-token step.
    cache = KVCache.zeros(scanned.cfg, 1, 32)
    (a,), cache = step(scanned, cache, [seq[:10]], [0], n_bucket=16, q_max=16)
    (b,), cache = step(scanned, cache, [seq[10:13]], [10], n_bucket=4, q_max=4)
    np.testing.assert_allclose(a, ref[:10], rtol=0, atol=ATOL)
    np.testing.assert_allclose(b, ref[10:13], rtol=0, atol=ATOL)


def test_feature_taps_match_between_scan_and_unrolled(tiny_target):
    """The drafter reads hidden states of chosen target layers (-1 = embeddings)."""
    unrolled = tiny_target("llama", seed=6, num_layers=LAYERS)
    scanned = _stack_into_scan(unrolled)
    seq = jnp.asarray(ids(T, 50))[:8]
    outs = []
    for t in (unrolled, scanned):
        _, feats, _ = packed_step(t.graphdef, t.state, KVCache.zeros(t.cfg, 1, 8), seq,
                                  jnp.zeros(1, jnp.int32), jnp.full(1, 8, jnp.int32), q_max=8,
                                  feature_layers=(-1, 0, 1))
        outs.append(np.asarray(feats))
    assert outs[0].shape == (8, 3 * unrolled.cfg.hidden_size)
    np.testing.assert_allclose(outs[0][:, :64], np.asarray(unrolled.module().embed(seq)), rtol=0, atol=0)
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=ATOL)


def test_causality(tiny_target):
    """Changing token t changes no logits before t."""
    target = tiny_target("qwen2", seed=7, num_layers=LAYERS)
    a = ids(T, 60)
    b = a.copy()
    b[9] = (b[9] + 1) % V
    la, lb = full(target, a), full(target, b)
    np.testing.assert_array_equal(la[:9], lb[:9])
    assert np.abs(la[9:] - lb[9:]).max() > 1e-2


@pytest.mark.slow
def test_jit_equals_eager(tiny_target):
    """The jitted full forward equals an op-by-op run of the module (no jit anywhere)."""
    target = tiny_target("llama", seed=8, num_layers=LAYERS)
    seq = ids(T, 70)
    model = target.module()
    cache = KVCache.zeros(target.cfg, 1, T)
    eager, _, _ = model(cache, jnp.asarray(seq), jnp.zeros(1, jnp.int32), jnp.full(1, T, jnp.int32), q_max=T)
    np.testing.assert_allclose(np.asarray(eager), full(target, seq), rtol=0, atol=ATOL)


@pytest.mark.parametrize("scanned", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_deferred_write_equals_writing_first(tiny_target, scanned):
    """`defer_write` (the scheduled policies' bucket switch): the step reads the cache only —
    each query sees its slot's context before `starts` plus the step's own tokens — and its
    `StepKV`, padded to a larger bucket and written afterwards, leaves the same cache as the
    in-place step; the logits agree. Stale entries past a slot's start (rejected drafts) must
    not be read. Both cache forms (unrolled: per layer; scanned: stacked, in the slow tier)."""
    unrolled = tiny_target("qwen3", seed=8, num_layers=LAYERS)
    seq_a, seq_b = ids(T, 70), ids(T, 71)

    def run(target, defer: bool):
        model = target.module()
        cache = KVCache.zeros(target.cfg, 3, 32)
        _, cache = step(target, cache, [seq_a[:9], [], seq_b[:6]], [0, 0, 0], n_bucket=16, q_max=16)
        drafts = np.concatenate([seq_a[9:10], (seq_a[10:13] + 1) % V])
        _, cache = step(target, cache, [drafts, [], seq_b[6:9]], [9, 0, 6], n_bucket=8, q_max=4)
        # Slot 0 rejected its last 3 drafts (start 10); slot 2 continues at 9; slot 1 is idle.
        toks = np.zeros(8, np.int32)
        toks[:5] = np.concatenate([seq_a[10:13], seq_b[9:11]])
        args = (cache, jnp.asarray(toks), jnp.asarray([10, 0, 9], jnp.int32), jnp.asarray([3, 0, 2], jnp.int32))
        logits, _, out = nnx.jit(lambda m, *a: m(*a, q_max=4, defer_write=defer))(model, *args)
        return np.asarray(logits[:5]), out.padded(12).write(cache) if defer else out

    ref_a, ref_b = full(unrolled, seq_a), full(unrolled, seq_b)
    target = _stack_into_scan(unrolled) if scanned else unrolled
    want, want_cache = run(target, False)
    got, got_cache = run(target, True)
    np.testing.assert_allclose(want, np.concatenate([ref_a[10:13], ref_b[9:11]]), rtol=0, atol=ATOL)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    for x, y in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=ATOL)


def _reference_attention(q_SQHE, k_STKE, v_STKE, mask_SQT):
    """Plain numpy grouped-query attention (float64); fully masked rows give zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q_SQHE, k_STKE, v_STKE))
    m = np.asarray(mask_SQT)
    S, Q, H, E = q.shape
    K = k.shape[2]
    out = np.zeros_like(q)
    for s in range(S):
        for h in range(H):
            sc = q[s, :, h] @ k[s, :, h // (H // K)].T / np.sqrt(E)  # [Q, T]
            sc = np.where(m[s], sc, -np.inf)
            mx = np.max(sc, -1, keepdims=True)
            p = np.where(m[s], np.exp(sc - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
            den = p.sum(-1, keepdims=True)
            out[s, :, h] = np.where(den > 0, (p / np.where(den > 0, den, 1.0)) @ v[s, :, h // (H // K)], 0.0)
    return out


@pytest.mark.parametrize("recent", [4, 32])
def test_cached_attention_masks_exactly_and_zeroes_empty_rows(recent):
    """`attend_cached` (the mask added to the scores) and `attend_in_fixed_order` (a decode
    step: the cache-wide part and each query's `recent` last positions; with the step's keys
    already in the cache, or beside it as a deferred write) against a float64 reference, with
    ragged masks and rows with no allowed key (empty grid cells: zeros, not a mean of the
    values). `recent` = 4 splits most queries' keys between the two parts; 32 puts them all in
    the recent part."""
    from dspark_jax.models.layers import attend_cached, attend_in_fixed_order

    rng = np.random.default_rng(0)
    S, Q, H, K, E, T = 3, 4, 6, 2, 8, 16
    q = rng.normal(size=(S, Q, H, E)).astype(np.float32)
    k = rng.normal(size=(S, T, K, E)).astype(np.float32) * 3  # large scores: a leaked masked key shows
    v = rng.normal(size=(S, T, K, E)).astype(np.float32)
    lens = np.array([5, 0, 11])  # slot 1 has no context
    counts = np.array([4, 2, 0])  # slot 2 has no query (an idle slot)
    qpos = lens[:, None] + np.arange(Q)[None]
    valid = np.arange(Q)[None] < counts[:, None]
    mask = (np.arange(T)[None, None] <= qpos[..., None]) & valid[..., None]  # [S, Q, T]
    kt, vh = jnp.asarray(k.transpose(0, 2, 3, 1)), jnp.asarray(v.transpose(0, 2, 1, 3))
    want = _reference_attention(q, k, v, mask)
    got = np.asarray(attend_cached(jnp.asarray(q), kt, vh, jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert not got[2].any() and not got[1, 2:].any()

    # A decode step in fixed order: the cache holding the step's keys, then not yet (they come
    # beside it; the cache past each slot's context holds stale values that must not be read).
    def fixed(kt_SKET, v_SKTE, new=None):
        return np.asarray(attend_in_fixed_order(jnp.asarray(q), kt_SKET, v_SKTE, jnp.asarray(qpos, jnp.int32),
                                                jnp.asarray(valid), new, recent=recent))

    got1 = fixed(kt, vh)
    np.testing.assert_allclose(got1, want, atol=2e-6)
    at = lens[:, None] + np.arange(Q)[None]  # each slot's step positions (all inside T)
    k_new, v_new = k[np.arange(S)[:, None], at], v[np.arange(S)[:, None], at]
    stale = np.arange(T)[None, :] >= lens[:, None]  # [S, T]
    kt_stale = np.where(stale[:, None, None, :], 50.0, k.transpose(0, 2, 3, 1)).astype(np.float32)
    vh_stale = np.where(stale[:, None, :, None], 50.0, v.transpose(0, 2, 1, 3)).astype(np.float32)
    got2 = fixed(jnp.asarray(kt_stale), jnp.asarray(vh_stale), (jnp.asarray(k_new), jnp.asarray(v_new)))
    np.testing.assert_array_equal(got2, got1)  # the same numbers wherever the step's keys are
    assert not got2[2].any() and not got2[1, 2:].any()
    with pytest.raises(ValueError, match="at most 2 queries"):
        attend_in_fixed_order(jnp.asarray(q), kt, vh, jnp.asarray(qpos, jnp.int32), jnp.asarray(valid), recent=2)
