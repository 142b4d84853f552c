"""bf16 weights under float32 activations (`load_target(weight_dtype="bfloat16")`).

The narrowed target must compute as the float32 target whose matmul weights were rounded to
bf16 — float32 arithmetic on the activations, only the summation order differs — so every
decoding path keeps greedy identity with autoregressive decoding, as in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax as ds
from dspark_jax.models.layers import narrow_weight_dot

ATOL = 1e-5  # as tests/models/test_cache.py: float32 summation order only


def rounded_f32(target: ds.Target) -> ds.Target:
    """The float32 target with every matmul weight (not the norms) rounded to bf16."""
    out = []
    for path, var in nnx.to_flat_state(target.state):
        v = var[...]
        if path[-1] in ("kernel", "embed_tokens", "lm_head"):
            v = v.astype(jnp.bfloat16).astype(jnp.float32)
        out.append((path, var.replace(v)))
    return ds.Target(target.cfg, target.graphdef, nnx.from_flat_state(out), target.tokenizer)


def test_narrow_weight_dot_is_float32_exact_in_the_activations():
    rng = np.random.default_rng(0)
    # Activations over many magnitudes (as residual streams have), weights at bf16.
    x = (rng.standard_normal((5, 3, 96)) * np.exp(rng.uniform(-6, 6, (5, 3, 96)))).astype(np.float32)
    w_OI = jnp.asarray(rng.standard_normal((40, 96)) * 0.1, jnp.bfloat16)
    exact = np.einsum("mqi,oi->mqo", x.astype(np.float64), np.asarray(w_OI.astype(jnp.float32), np.float64))
    got = np.asarray(narrow_weight_dot(jnp.asarray(x), w_OI))
    assert got.shape == (5, 3, 40) and got.dtype == np.float32
    scale = np.abs(x).max() * 0.1 * np.sqrt(96)
    err = np.abs(got - exact).max() / scale
    # Rounding the activations to bf16 (the TPU convention) is ~1e-3 off; the split is float32-exact.
    naive = np.einsum("mqi,oi->mqo", np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32),
                                                 np.float64), np.asarray(w_OI.astype(jnp.float32), np.float64))
    assert err < 1e-6 < np.abs(naive - exact).max() / scale / 100
    # One row (a batch-1 decode step) goes through the same kernel.
    np.testing.assert_allclose(np.asarray(narrow_weight_dot(jnp.asarray(x[:1, :1]), w_OI)), got[:1, :1],
                               rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied embedding / untied LM head + biases
def test_narrowed_target_is_the_float32_target_with_rounded_weights(tiny_target, family):
    f32 = tiny_target(family, seed=3, num_layers=2)
    narrow = f32.with_weight_dtype("bfloat16")
    assert narrow.cfg.weight_dtype == "bfloat16" and f32.cfg.weight_dtype is None
    dtypes = {"/".join(map(str, p)): v[...].dtype for p, v in nnx.to_flat_state(narrow.state)}
    assert all(d == jnp.bfloat16 for k, d in dtypes.items() if k.endswith(("kernel", "lm_head")))
    # The lookup table stays float32, bf16-rounded (one row read per token; narrowed, XLA:CPU
    # copied the whole table into float32 every decode-loop call); a tied LM head is a bf16 copy.
    assert dtypes["embed_tokens"] == jnp.float32 and dtypes["lm_head"] == jnp.bfloat16
    assert all(d == jnp.float32 for k, d in dtypes.items() if "norm" in k or k.endswith("bias"))
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t.state))  # noqa: E731
    table = f32.state["embed_tokens"][...].nbytes
    assert nbytes(narrow) - table < 0.55 * nbytes(f32)  # every matmul weight at half the bytes
    seq = np.random.default_rng(1).integers(0, 128, 16)
    ref = np.asarray(ds.logits(rounded_f32(f32), seq))
    got = np.asarray(ds.logits(narrow, seq))
    assert np.abs(ref - np.asarray(ds.logits(f32, seq))).max() > 100 * ATOL  # the rounding shows ...
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)  # ... and nothing else does
    assert narrow.with_weight_dtype("bfloat16") is narrow and f32.with_weight_dtype(None) is f32


def test_narrowed_scanned_target_equals_unrolled(tiny_target):
    unrolled = tiny_target("qwen3", seed=2, num_layers=2)
    cfg = unrolled.cfg.replace(scan_layers=True)
    graphdef, abstract = ds.Target.abstract(cfg)
    src = dict(nnx.to_flat_state(unrolled.state))
    stacked = [(p, v.replace(jnp.stack([src[("layers", i) + p[1:]][...] for i in range(2)]) if p[0] == "layers"
                             else src[p][...])) for p, v in nnx.to_flat_state(abstract)]
    scanned = ds.Target(cfg, graphdef, nnx.from_flat_state(stacked)).with_weight_dtype("bfloat16")
    unrolled = unrolled.with_weight_dtype("bfloat16")
    seq = np.arange(12) % 128
    np.testing.assert_allclose(np.asarray(ds.logits(scanned, seq)), np.asarray(ds.logits(unrolled, seq)),
                               rtol=0, atol=ATOL)
    # A config that asks for bf16 weights gets them from Target.random too.
    assert ds.Target.random(cfg.replace(weight_dtype="bfloat16")).cfg.weight_dtype == "bfloat16"


@pytest.mark.parametrize("terms", [3, 1])
def test_narrowed_target_decodes_speculatively_as_autoregressively(tiny_target, terms):
    """Greedy identity on the narrowed target, every policy (the steps verify 1 … γ+1 rows
    per request: the narrowed matmul must not depend on the row count), also with the
    activations rounded to bf16 (1 term: identical only because a decode step's numbers do
    not depend on its shape at all)."""
    target = tiny_target("llama", seed=4, num_layers=2).with_weight_dtype("bfloat16", terms)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, n).tolist() for n in (3, 9, 5)]
    # A repetitive prompt, so prompt lookup drafts long accepted blocks.
    prompts.append([7, 8, 9, 10] * 4)
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    ar = ds.generate(target, prompts, sampling=sp).token_ids
    ngram = ds.NgramDrafter(block_size=4)
    for policy in ("fixed", "dspark", "threshold"):
        out = ds.generate(target, prompts, drafter=ngram, sampling=sp, policy=policy)
        assert out.token_ids == ar, policy
        if policy == "fixed":
            assert out.stats["tau"] > 1.3  # drafts of several tokens were verified and accepted


def test_weight_dtype_is_validated():
    with pytest.raises(ValueError, match="weight_dtype"):
        ds.ModelConfig.tiny(weight_dtype="float16")
    with pytest.raises(ValueError, match="weight_dtype"):
        ds.ModelConfig.tiny(dtype="bfloat16", weight_dtype="float32")
    assert ds.ModelConfig.tiny(dtype="bfloat16", weight_dtype="bfloat16").weight_dtype == "bfloat16"
    with pytest.raises(ValueError, match="weight_terms"):
        ds.ModelConfig.tiny(weight_dtype="bfloat16", weight_terms=4)


@pytest.mark.parametrize("terms", [1, 2])
def test_fewer_terms_round_the_activations(terms):
    """terms = 1: the product of the bf16-rounded activations (the accelerators' convention),
    terms = 2: of their leading 16 bits — up to float32 summation order, and further from the
    float32 product than the three exact terms; one row (padded to two) alike."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((7, 96)) * np.exp(rng.uniform(-4, 4, (7, 96)))).astype(np.float32)
    w_OI = jnp.asarray(rng.standard_normal((40, 96)) * 0.1, jnp.bfloat16)
    w64 = np.asarray(w_OI.astype(jnp.float32), np.float64)
    xj = jnp.asarray(x)
    lead = xj.astype(jnp.bfloat16).astype(jnp.float32)
    if terms == 2:
        lead = lead + (xj - lead).astype(jnp.bfloat16).astype(jnp.float32)
    want = np.asarray(lead, np.float64) @ w64.T
    exact = x.astype(np.float64) @ w64.T
    scale = np.abs(x).max() * 0.1 * np.sqrt(96)
    got = np.asarray(narrow_weight_dot(xj, w_OI, terms))
    assert np.abs(got - want).max() / scale < 1e-6
    three = np.abs(np.asarray(narrow_weight_dot(xj, w_OI)) - exact).max()
    assert np.abs(got - exact).max() > {1: 100, 2: 5}[terms] * three  # 2⁻⁹ and 2⁻¹⁷ against float32 sums
    np.testing.assert_allclose(np.asarray(narrow_weight_dot(xj[:1], w_OI, terms)), got[:1], rtol=0, atol=1e-6 * scale)


def test_one_term_target_computes_at_bf16_precision(tiny_target):
    """`weight_terms=1` reaches every narrowed matmul (projections and LM head): logits move
    from the exact narrowed model's by bf16 rounding, not more."""
    f32 = tiny_target("qwen2", seed=3, num_layers=2)
    exact = f32.with_weight_dtype("bfloat16")
    fast = f32.with_weight_dtype("bfloat16", 1)
    assert (fast.cfg.weight_dtype, fast.cfg.weight_terms, exact.cfg.weight_terms) == ("bfloat16", 1, 3)
    seq = np.random.default_rng(1).integers(0, 128, 16)
    a, b = np.asarray(ds.logits(exact, seq)), np.asarray(ds.logits(fast, seq))
    diff = np.abs(a - b).max() / np.abs(a).max()
    assert 1e-5 < diff < 3e-2
    with pytest.raises(ValueError, match="already"):
        exact.with_weight_dtype("bfloat16", 1)
    assert fast.with_weight_dtype("bfloat16", 1) is fast
    # A config that asks for it gets it from Target.random too.
    assert ds.Target.random(f32.cfg.replace(weight_dtype="bfloat16", weight_terms=1)).cfg.weight_terms == 1


@pytest.mark.parametrize("weights,invariant", [("float32", False), ("bf16 3 terms", False), ("bf16 1 term", True)])
def test_a_verification_step_computes_the_autoregressive_logits(tiny_target, weights, invariant):
    """`benchmarks.bench_batch_invariance.ar_vs_verify`: one verification step of 4 tokens a
    slot against the 4 one-token steps it replaces, from the same cache. Batch-invariant
    decoding (`ModelConfig.batch_invariant`; on by default with 1 term, where the activations
    are rounded to bf16 and a 1-ulp difference flips a rounding) gives bitwise the same
    logits (`layers.attend_in_fixed_order`, `layers.tree_sum` in RMSNorm; the bf16 matmul rows
    are invariant themselves — float32 ones are not). Without it they agree to float32
    summation order only, and not bitwise: the control that shows the invariant path is what
    makes them equal."""
    from benchmarks.bench_batch_invariance import ar_vs_verify

    terms = 1 if weights.endswith("1 term") else 3
    target = tiny_target("llama", seed=5, num_layers=2,
                         batch_invariant=None if terms == 1 else invariant)
    if weights != "float32":
        target = target.with_weight_dtype("bfloat16", terms)
    assert target.cfg.fixed_order_decode == invariant
    eq, rows, worst, agree = ar_vs_verify(target, slots=2, block=4, trials=2)
    if invariant:
        assert (eq, rows, worst, agree) == (16, 16, 0.0, 1.0)
    else:
        assert rows == 16 and eq < rows and 0 < worst < ATOL and agree == 1.0


def test_cache_wide_scores_are_the_same_at_every_window_and_block():
    """`layers._blocked_scores`, the cache-wide part of a batch-invariant decode step: one
    query's scores over the first 200 positions (the rest of the window zero) are bitwise the
    same at every slot count, query count and window — windows of 256-position blocks (256,
    512, 768, 1,024), 128-position ones (384) and windows 128 does not divide, padded to blocks
    of 128 (320, 576, 704, 960; as one flat block 576 – 960 differed). A transposed copy of the
    keys is skipped where the window is one block; this is what lets it."""
    from dspark_jax.models.layers import _blocked_scores, score_block

    assert [score_block(t) for t in (256, 384, 512, 768, 1024, 320, 704, 96)] == [256, 128, 256, 256, 256, 128, 128, 96]
    rng = np.random.default_rng(0)
    K, I, E, live = 3, 3, 64, 200
    q = rng.standard_normal((8, K, 5, I, E)).astype(np.float32)
    kt = rng.standard_normal((8, K, E, 1024)).astype(np.float32)
    kt[..., live:] = 0
    f = jax.jit(lambda a, b: _blocked_scores(a, b)[0, :, 0, :, :live])
    base = np.asarray(f(q[:1, :, :1], kt[:1, ..., :256]))
    for S, Q, T in [(8, 1, 256), (1, 5, 256), (8, 5, 384), (1, 1, 320), (8, 5, 512), (1, 1, 768), (8, 5, 1024),
                    (8, 5, 576), (1, 1, 704), (8, 1, 960)]:
        got = np.asarray(f(q[:S, :, :Q], kt[:S, ..., :T]))
        assert np.array_equal(got, base), (S, Q, T)


def test_a_bf16_row_is_the_same_at_every_row_count():
    """One term (activations rounded to bf16): a token's matmul row is bitwise the same whether
    its step multiplies 1, 2, 3 or 24 rows — XLA:CPU's kernels for 1, 2 and ≥ 3 rows sum in
    different orders on some CPUs (`layers.MIN_DOT_ROWS`), and a verification step's rows must
    be the autoregressive steps' bit for bit."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((192, 576)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((24, 576)), jnp.float32)
    f = jax.jit(lambda a: narrow_weight_dot(a, w, terms=1)[0])
    base = np.asarray(f(x[:1]))
    for m in (2, 3, 4, 5, 8, 24):
        assert np.array_equal(np.asarray(f(x[:m])), base), m
