"""Drafter invariants on tiny configs (docs/method.md §2): scan ≡ loop, causality, W2 = 0 ≡ DFlash,
teacher forcing ≡ sampling path, incremental context ≡ all-at-once, parameter counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as ds
from dspark_jax.decoding.drafting import append_features, draft_block
from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams
from dspark_jax.models.drafter import abstract_drafter, forward_train, num_params, training_attention_mask
from dspark_jax.models.drafters import Drafter

TCFG = ds.ModelConfig.tiny(vocab_size=96)
HEADS = ["markov", "gated", "rnn"]


@pytest.fixture(scope="module")
def target():
    return ds.Target.random(TCFG, seed=0)


def make_drafter(head="markov", gamma=4, seed=1, **kw):
    cfg = ds.DrafterConfig.for_target(TCFG, num_feature_layers=2, block_size=gamma, num_layers=2,
                                      markov_rank=8, head_type=head, **kw)
    return Drafter.random(cfg, seed)


def sa_for(temperature, n, **kw):
    return SamplingArrays.from_params([SamplingParams(temperature=temperature, **kw)] * n)


def context(drafter, S, T, seed=0):
    """Random target features for T positions of S slots, appended to a fresh context cache."""
    F = len(drafter.cfg.target_layer_ids) * TCFG.hidden_size
    feats = jax.random.normal(jax.random.key(seed), (S, T, F))
    return feats


def fill_cache(drafter, target, feats, length=64, chunks=(None,)):
    S, T, F = feats.shape
    cache = drafter.init_cache(drafter.params, S, length)
    bounds = [0] + [c for c in chunks if c is not None] + [T]
    for a, b in zip(bounds, bounds[1:]):
        n = b - a
        slot = jnp.repeat(jnp.arange(S), n)
        pos = jnp.tile(jnp.arange(a, b), S)
        cache = append_features(drafter, drafter.params, target.graphdef, target.state, cache,
                                feats[:, a:b].reshape(S * n, F), slot, pos, jnp.ones(S * n, bool))
    return cache


def run_draft(drafter, target, cache, anchor, pos, sa, seed=0, use_scan=True):
    keys = jax.random.split(jax.random.key(seed), anchor.shape[0])
    return draft_block(drafter, drafter.params, target.graphdef, target.state, cache, anchor, pos, keys, sa,
                       use_scan=use_scan)


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scan_equals_python_loop(target, head, temperature):
    d = make_drafter(head)
    feats = context(d, 3, 10)
    cache = fill_cache(d, target, feats)
    anchor, pos = jnp.array([5, 17, 40]), jnp.array([10, 7, 3])
    sa = sa_for(temperature, 3)
    a = run_draft(d, target, cache, anchor, pos, sa, use_scan=True)
    b = run_draft(d, target, cache, anchor, pos, sa, use_scan=False)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a[2], b[2], rtol=1e-6, atol=1e-6)


def _train_logits(d, target, feats, tokens, anchors):
    m = d.module()
    emb = target.state["embed_tokens"].get_value()
    lm = target.module().lm_head_matrix()
    return jax.jit(forward_train)(m, emb, lm, feats, tokens, anchors)


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_teacher_forced_matches_sampling_path(target, head):
    """Teacher-forced logits == the logits the sampling path drew from, when the sampled
    tokens are the ground truth (the cached-context inference path ≡ the training path)."""
    d = make_drafter(head)
    G = d.cfg.block_size
    S, P = 2, 9
    feats = context(d, S, P + G)
    cache = fill_cache(d, target, feats[:, :P])
    anchor = jnp.array([7, 31])
    toks, logits, conf = run_draft(d, target, cache, anchor, jnp.full(S, P), sa_for(1.0, S), seed=3)
    seq = jnp.zeros((S, P + G), jnp.int32).at[:, P].set(anchor).at[:, P + 1:].set(toks[:, : G - 1])
    tf_logits, tf_conf = _train_logits(d, target, feats, seq, jnp.full((S, 1), P))
    np.testing.assert_allclose(tf_logits[:, 0], logits, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(jax.nn.sigmoid(tf_conf[:, 0]), conf, atol=1e-5)


@pytest.mark.parametrize("head", HEADS)
def test_causality_within_block(target, head):
    """p_k depends on x_0..x_{k-1} only: changing ground-truth tokens at block positions ≥ k
    leaves the logits of positions < k unchanged (and changes later ones)."""
    d = make_drafter(head, gamma=5)
    feats = context(d, 1, 20)
    rng = np.random.default_rng(0)
    seq = jnp.asarray(rng.integers(0, 96, (1, 20)), jnp.int32)
    anchors = jnp.array([[6]])
    base, _ = _train_logits(d, target, feats, seq, anchors)
    for k in range(1, 5):  # perturb tokens at anchor+k.. (block positions ≥ k)
        seq2 = seq.at[0, 6 + k:].set((seq[0, 6 + k:] + 1) % 96)
        out, _ = _train_logits(d, target, feats, seq2, anchors)
        np.testing.assert_allclose(out[0, 0, :k], base[0, 0, :k], atol=1e-6)
        assert np.abs(out[0, 0, k:] - base[0, 0, k:]).max() > 1e-4


def test_training_mask_blocks_are_isolated():
    anchors = jnp.array([[3, 8, 5]])
    G, T = 4, 12
    m = np.asarray(training_attention_mask(anchors, T, G))[0]
    for a, p in enumerate([3, 8, 5]):
        rows = m[a * G:(a + 1) * G]
        assert rows[:, :T].sum(1).tolist() == [p] * G  # context strictly before the anchor
        assert rows[:, :p].all()
        blk = rows[:, T:]
        assert blk[:, a * G:(a + 1) * G].all() and blk.sum() == G * G  # own block only


def test_training_blocks_do_not_see_other_blocks_or_future_context(target):
    d = make_drafter("rnn")
    feats = context(d, 1, 24)
    seq = jnp.asarray(np.random.default_rng(1).integers(0, 96, (1, 24)), jnp.int32)
    anchors = jnp.array([[5, 12]])
    base, bconf = _train_logits(d, target, feats, seq, anchors)
    # Features at/after block 0's anchor (5) must not move block 0; block 1 must move.
    f2 = feats.at[:, 5:].add(1.0)
    out, oconf = _train_logits(d, target, f2, seq, anchors)
    np.testing.assert_allclose(out[:, 0], base[:, 0], atol=1e-6)
    np.testing.assert_allclose(oconf[:, 0], bconf[:, 0], atol=1e-6)
    assert np.abs(out[:, 1] - base[:, 1]).max() > 1e-4
    # Another block's anchor token must not move block 0 either.
    seq2 = seq.at[0, 12].set((seq[0, 12] + 1) % 96)
    out, _ = _train_logits(d, target, feats, seq2, anchors)
    np.testing.assert_allclose(out[:, 0], base[:, 0], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_zero_w2_is_the_parallel_drafter(target, head):
    d = make_drafter(head)
    state = jax.tree.map(lambda x: x, d.state)
    state["head"]["w2"].set_value(jnp.zeros_like(state["head"]["w2"].get_value()))
    dz = Drafter(d.cfg, d.graphdef, state)
    # The same backbone with no head at all: copy every shared parameter.
    dn = make_drafter("none", seed=9, confidence_head=False)
    flat = dict(nnx.to_flat_state(dz.state))
    nstate = nnx.from_flat_state([(p, v.replace(flat[p].get_value())) for p, v in nnx.to_flat_state(dn.state)])
    dn = Drafter(dn.cfg, dn.graphdef, nstate)
    feats = context(d, 2, 12)
    seq = jnp.asarray(np.random.default_rng(2).integers(0, 96, (2, 12)), jnp.int32)
    anchors = jnp.array([[2, 6], [4, 5]])
    a, _ = _train_logits(dz, target, feats, seq, anchors)
    b, _ = _train_logits(dn, target, feats, seq, anchors)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Sampling path too.
    cz, cn = fill_cache(dz, target, feats), fill_cache(dn, target, feats)
    anchor, pos = jnp.array([3, 9]), jnp.array([12, 12])
    ra = run_draft(dz, target, cz, anchor, pos, sa_for(1.0, 2))
    rb = run_draft(dn, target, cn, anchor, pos, sa_for(1.0, 2))
    np.testing.assert_array_equal(ra[0], rb[0])
    np.testing.assert_array_equal(np.asarray(ra[1]), np.asarray(rb[1]))


@pytest.mark.slow
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_incremental_appends_equal_all_at_once(target, head):
    d = make_drafter(head)
    feats = context(d, 2, 15)
    c1 = fill_cache(d, target, feats)
    c2 = fill_cache(d, target, feats, chunks=(4, 5, 11))
    np.testing.assert_allclose(c1.k, c2.k, atol=1e-6)
    np.testing.assert_allclose(c1.v, c2.v, atol=1e-6)
    anchor, pos = jnp.array([1, 2]), jnp.array([15, 9])
    a = run_draft(d, target, c1, anchor, pos, sa_for(0.0, 2))
    b = run_draft(d, target, c2, anchor, pos, sa_for(0.0, 2))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)


def test_context_after_anchor_is_ignored_at_inference(target):
    """Stale features at positions ≥ the anchor (e.g. from rejected drafts) are never read."""
    d = make_drafter("markov")
    feats = context(d, 1, 12)
    c1 = fill_cache(d, target, feats)
    c2 = fill_cache(d, target, feats.at[:, 8:].add(3.0))
    a = run_draft(d, target, c1, jnp.array([4]), jnp.array([8]), sa_for(1.0, 1))
    b = run_draft(d, target, c2, jnp.array([4]), jnp.array([8]), sa_for(1.0, 1))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_sts_temperatures_are_applied(target):
    d = make_drafter("markov", sts_temperatures=(1.0, 2.0, 0.5, 1.0))
    d1 = Drafter(d.cfg.replace(sts_temperatures=()), d.graphdef, d.state)
    feats = context(d, 1, 6)
    cache = fill_cache(d, target, feats)
    _, _, c = run_draft(d, target, cache, jnp.array([3]), jnp.array([6]), sa_for(0.0, 1))
    _, _, c1 = run_draft(d1, target, cache, jnp.array([3]), jnp.array([6]), sa_for(0.0, 1))
    logit = np.log(c1) - np.log1p(-c1)
    np.testing.assert_allclose(c, 1 / (1 + np.exp(-logit / np.array([1.0, 2.0, 0.5, 1.0]))), atol=1e-5)


QWEN3_8B = ds.ModelConfig(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                          head_dim=128, intermediate_size=12288, family="qwen3", qk_norm=True,
                          rope_theta=1e6, tie_word_embeddings=False)


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_qwen3_8b_sized_parameter_count(head):
    cfg = ds.DrafterConfig.for_target(QWEN3_8B, num_layers=5, markov_rank=256 if head != "none" else 0,
                                      head_type=head, confidence_head=head != "none")
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    _, abstract = abstract_drafter(cfg)  # jax.eval_shape: nothing allocated
    D, V, r, F = 4096, 151936, 256, 12288
    attn = D * 32 * 128 + 2 * D * 8 * 128 + 32 * 128 * D + 2 * 128  # q,k,v,o + q_norm,k_norm
    layer = attn + 3 * D * F + 2 * D
    expected = 5 * D * D + D + 5 * layer + D + D  # fc, hidden_norm, layers, final norm, mask embedding
    if head != "none":
        expected += V * r + r * V + (D + r + 1)  # W1, W2, confidence head
    if head == "rnn":
        expected += (2 * r + D) * 3 * r + 3 * r
    assert num_params(abstract) == expected
    # No embedding / LM head in the drafter's trainable state.
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(abstract)}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(target_layer_ids=(0, 4)), "out of range"),
        (dict(target_layer_ids=(2, 1)), "strictly increasing"),
        (dict(target_layer_ids=(1, 1)), "strictly increasing"),
        (dict(block_size=0), "block_size"),
        (dict(head_type="lstm"), "head_type"),
        (dict(markov_rank=0, head_type="markov"), "markov_rank"),
        (dict(sts_temperatures=(1.0,)), "sts_temperatures"),
    ],
)
def test_bad_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ds.DrafterConfig.for_target(TCFG, num_feature_layers=2, **kw)


def test_drafter_target_mismatch():
    other = ds.ModelConfig.tiny(vocab_size=96, hidden_size=32)
    cfg = ds.DrafterConfig.for_target(TCFG, num_feature_layers=2, num_layers=1, markov_rank=4)
    with pytest.raises(ValueError, match="hidden size"):
        cfg.check_compatible(other)
    with pytest.raises(ValueError, match="vocab size"):
        cfg.check_compatible(ds.ModelConfig.tiny(vocab_size=100))
    d = Drafter.random(cfg)
    t = ds.Target.random(ds.ModelConfig.tiny(vocab_size=100))
    with pytest.raises(ValueError, match="vocab size"):
        ds.generate(t, [[1, 2, 3]], drafter=d, sampling=SamplingParams(max_new_tokens=2))
