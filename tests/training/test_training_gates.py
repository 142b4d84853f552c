"""Gates on the drafter-training pipeline (tiny random target, fast):

- overfit: a drafter trained on a few greedy answers until it fits them gets nearly every
  draft accepted by real `generate()` at T = 0 on those answers' prompts (τ ≥ γ);
- teacher consistency: on greedy-regenerated data the label equals the target's argmax;
- train ↔ inference: the teacher-forced greedy τ on those sequences equals what
  `generate()` measures on the same prompts (to within the blocks cut by the answer's end);
- context ablation: zeroing or shuffling the tapped features makes the drafter fail;
- the trained drafter beats a count-based bigram at position 1;
- the KL term of the loss against a NumPy reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import sharpen

import dspark_jax as ds
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.training import gates
from dspark_jax.training import train_step as ts
from dspark_jax.training.batches import make_example
from dspark_jax.training.losses import LossConfig, dspark_loss

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

G = 7
NEW = 40


@pytest.fixture(scope="module")
def overfit():
    cfg = ds.ModelConfig.tiny(num_layers=2, tie_word_embeddings=False)
    target = sharpen(ds.Target.random(cfg, seed=0), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (6, 9)]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    answers = ds.generate(target, prompts, sampling=sp).token_ids
    seqs = [(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers)]
    dcfg = DrafterConfig.for_target(cfg, num_feature_layers=2, block_size=G, num_layers=1, markov_rank=16)
    from flax import nnx

    from dspark_jax.models.drafter import DSparkDrafter

    def build():
        m = DSparkDrafter(dcfg, rngs=nnx.Rngs(0))
        m.head.w2.set_value(jnp.zeros_like(m.head.w2[...]))
        return m

    steps = 300
    tx = ts.OptimConfig(learning_rate=3e-3, total_steps=steps, warmup_fraction=0.02).optimizer()
    dg, st, rest = ts.init_sharded(build, tx)
    loss = LossConfig(alpha_ce=1.0, alpha_tv=0.0, alpha_conf=1.0, alpha_kl=1.0, labels="target")
    T = 64
    first = last = None
    for s in range(steps):
        ex = [make_example(t, m, seq_len=T, num_anchors=48, block_size=G, rng=np.random.default_rng(s * 7 + i))
              for i, (t, m) in enumerate(seqs)]
        batch = {k: jnp.asarray(np.stack([e[k] for e in ex])) for k in ("tokens", "anchors", "block_mask")}
        st, m = ts.train_step_online(st, rest, target.state, batch, tx=tx, dgraph=dg, tgraph=target.graphdef,
                                     feature_layers=dcfg.target_layer_ids, loss=loss)
        first = first or {k: float(np.mean(v)) for k, v in m.items() if k in ("ce", "greedy_tau")}
        last = {k: float(np.mean(v)) for k, v in m.items() if k in ("ce", "greedy_tau")}
    _, state = nnx.split(nnx.merge(dg, st.params, rest))
    drafter = ds.Drafter(dcfg, dg, state)
    return dict(target=target, prompts=prompts, answers=answers, seqs=seqs, drafter=drafter, sp=sp, first=first,
                last=last)


def test_overfit_gate(overfit):
    # CE against the argmax labels cannot reach 0 beside the KL term (the target's own
    # distribution is not one-hot), but it falls by more than 10×, and every block fits.
    first, last = overfit["first"], overfit["last"]
    assert last["ce"] < 0.1 * first["ce"] and last["greedy_tau"] == G + 1, (first, last)
    out = ds.generate(overfit["target"], overfit["prompts"], drafter=overfit["drafter"], sampling=overfit["sp"],
                      policy="fixed")
    assert out.token_ids == overfit["answers"]  # lossless, whatever the drafter
    assert out.stats["tau"] >= G, out.stats  # nearly every draft accepted


def test_teacher_consistency_and_train_inference_agreement(overfit):
    d, t = overfit["drafter"], overfit["target"]
    real = gates.block_greedy_stats(t, d, overfit["seqs"], batch=2, width=64, max_anchors=48)
    # Greedy answers: the label is the target's argmax (exact up to fp32 ties, none here).
    assert real["teacher_consistency"] == 1.0
    assert real["tau"] > G and real["acceptance"][0] > 0.95, real
    # An untrained drafter measured the same way: τ ≈ 1, and generate() agrees.
    fresh = ds.Drafter.random(d.cfg, seed=3)
    f = gates.block_greedy_stats(t, fresh, overfit["seqs"], batch=2, width=64, max_anchors=48)
    g = ds.generate(t, overfit["prompts"], drafter=fresh, sampling=overfit["sp"], policy="fixed")
    assert f["tau"] < 1.5 and g.stats["tau"] < 1.5
    assert abs(f["tau"] - g.stats["tau"]) < 0.3


def test_context_ablation(overfit):
    d, t = overfit["drafter"], overfit["target"]
    real = gates.block_greedy_stats(t, d, overfit["seqs"], batch=2, width=64, max_anchors=48)
    for mode in ("zero", "shuffle"):
        abl = gates.block_greedy_stats(t, d, overfit["seqs"], features=mode, batch=2, width=64, max_anchors=48)
        assert abl["acceptance"][0] < real["acceptance"][0] - 0.2, (mode, abl, real)
        assert abl["tau"] < real["tau"] - 2, (mode, abl, real)
    with pytest.raises(ValueError, match="features"):
        gates.block_greedy_stats(t, d, overfit["seqs"], features="noise")


def test_beats_bigram(overfit):
    d, t = overfit["drafter"], overfit["target"]
    table = gates.bigram_table(overfit["seqs"], t.cfg.vocab_size)
    bigram = gates.bigram_accuracy(table, overfit["seqs"])
    real = gates.block_greedy_stats(t, d, overfit["seqs"], batch=2, width=64, max_anchors=48)
    assert real["first_accuracy"] > bigram + 0.05, (real["first_accuracy"], bigram)


def test_kl_term_matches_numpy():
    rng = np.random.default_rng(2)
    B, A, Gs, V = 2, 3, 4, 10
    ids = np.sort(rng.permutation(V)[:6])
    dl = rng.normal(size=(B, A, Gs, len(ids))) * 2
    tl = rng.normal(size=(B, A, Gs, V)) * 2
    bm = np.cumprod(rng.random((B, A, Gs)) < 0.85, -1).astype(np.float32)
    bm[0, 0] = 1
    pt = np.exp(tl - tl.max(-1, keepdims=True))
    pt /= pt.sum(-1, keepdims=True)
    logpd = dl - np.log(np.exp(dl - dl.max(-1, keepdims=True)).sum(-1, keepdims=True)) - dl.max(-1, keepdims=True)
    w = np.exp(-np.arange(Gs) / 4.0)[None, None] * bm
    want = (-(pt[..., ids] * logpd).sum(-1) * w).sum() / w.sum()
    logp_p = jax.nn.log_softmax(jnp.asarray(tl), -1)[..., ids]
    loss, m = dspark_loss(jnp.asarray(dl), jnp.zeros((B, A, Gs)), logp_p, jnp.exp(logp_p).sum(-1),
                          jnp.zeros((B, A, Gs), jnp.int32), jnp.ones((B, A, Gs)), jnp.asarray(bm), decay=4.0,
                          alpha=(0.0, 0.0, 0.0, 1.0))
    np.testing.assert_allclose(float(m["kl"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_loss_config_refuses_bad_values():
    with pytest.raises(ValueError, match="labels"):
        LossConfig(labels="argmax")
    with pytest.raises(ValueError, match="weights"):
        LossConfig(alpha_ce=0, alpha_tv=0, alpha_conf=0, alpha_kl=0)
    with pytest.raises(ValueError, match="decay"):
        LossConfig(decay=0)


@pytest.mark.parametrize("labels", ["data", "target"])
def test_target_over_proposal_equals_full_when_the_draft_vocabulary_is_everything(labels):
    """With V′ = V (a permutation of every id), the target restricted to V′ and renormalised
    is the target itself: the cheap path's loss equals the full one."""
    from flax import nnx

    from dspark_jax.models.drafter import DSparkDrafter

    cfg = ds.ModelConfig.tiny(num_layers=2)
    target = sharpen(ds.Target.random(cfg, seed=1), seed=1)
    V = cfg.vocab_size
    dcfg = DrafterConfig.for_target(cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8,
                                    draft_vocab_size=V)

    def build():
        m = DSparkDrafter(dcfg, rngs=nnx.Rngs(0))
        m.draft_ids.set_value(jnp.asarray(np.random.default_rng(0).permutation(V), jnp.int32))
        return m

    tx = ts.OptimConfig(total_steps=1).optimizer()
    dg, st, rest = ts.init_sharded(build, tx)
    rng = np.random.default_rng(1)
    ex = [make_example(rng.integers(3, V, 40), [0] * 8 + [1] * 32, seq_len=40, num_anchors=8, block_size=4,
                       rng=rng) for _ in range(2)]
    batch = {k: jnp.asarray(np.stack([e[k] for e in ex])) for k in ("tokens", "anchors", "block_mask")}
    out = {}
    for cheap in (False, True):
        loss = LossConfig(alpha_ce=1.0, alpha_tv=0.5, alpha_conf=1.0, alpha_kl=1.0, labels=labels,
                          target_over_proposal=cheap)
        out[cheap] = ts.eval_step(st.params, rest, target.state, batch, dgraph=dg, tgraph=target.graphdef,
                                  feature_layers=dcfg.target_layer_ids, loss=loss)
    for k in ("loss", "ce", "tv", "kl", "conf_bce", "greedy_tau"):
        np.testing.assert_allclose(float(out[True][k]), float(out[False][k]), rtol=2e-5, atol=1e-6, err_msg=k)
