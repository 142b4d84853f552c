"""Numerical parity with HF transformers on tiny random Llama / Qwen2 / Qwen3 checkpoints.

Each test builds a small model with transformers, gives *every* parameter (norm scales and
biases included) a random value so that a mis-mapped tensor cannot hide behind an
identity-initialised weight, saves it with `save_pretrained`, loads the directory with
`ds.load_target`, and compares logits in fp32. Tolerance: 1e-4 max abs on logits of
standard deviation ~2-3 (fp32 summation-order noise is ~1e-6 here).
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax as ds
from dspark_jax.models.transformer import KVCache, packed_step

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

# Needs the `parity` extra (pip install -e ".[parity]" after the CPU build of torch; see README).
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ATOL = 1e-4

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _hf_config(family: str, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**{**TINY, **kw})
    if family == "qwen2":
        return Qwen2Config(**{**TINY, **kw})
    if family == "qwen3":
        # head_dim deliberately != hidden / heads (as in real Qwen3 checkpoints).
        return Qwen3Config(**{**TINY, "head_dim": 32, **kw})
    raise ValueError(family)


def make_hf_checkpoint(tmp_path, family: str, seed: int = 0, save_kw=None, **cfg_kw):
    """A random HF model saved to tmp_path; returns (eval-mode torch model, directory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(family, **cfg_kw), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 0.3)
            else:  # projections and biases
                p.normal_(0.0, 0.1)
    path = tmp_path / f"{family}-ckpt"
    model.save_pretrained(path, safe_serialization=True, **(save_kw or {}))
    return model, str(path)


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))[None]).logits[0].numpy()


def random_ids(n: int, seed: int, vocab: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def assert_parity(model, target, ids_BT):
    ours = np.asarray(ds.logits(target, ids_BT))
    for b, ids in enumerate(ids_BT):
        ref = hf_logits(model, ids)
        assert ref.std() > 0.5  # the comparison means something
        np.testing.assert_allclose(ours[b], ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "family,cfg_kw",
    [
        ("llama", dict(tie_word_embeddings=True)),
        ("llama", dict(tie_word_embeddings=False)),
        ("qwen2", dict(tie_word_embeddings=False)),
        ("qwen3", dict(tie_word_embeddings=False)),
    ],
    ids=["llama-tied", "llama-untied", "qwen2", "qwen3"],
)
def test_logits_match_hf(tmp_path, family, cfg_kw):
    model, path = make_hf_checkpoint(tmp_path, family, **cfg_kw)
    target = ds.load_target(path)
    assert target.cfg.family == family
    assert target.cfg.tie_word_embeddings == cfg_kw["tie_word_embeddings"]
    if family == "qwen2":
        assert target.cfg.qkv_bias
    if family == "qwen3":
        assert target.cfg.qk_norm and target.cfg.head_dim == 32
    ids = np.stack([random_ids(37, seed=1), random_ids(37, seed=2)])
    assert_parity(model, target, ids)


def test_llama3_rope_scaling_matches_hf(tmp_path):
    # original_max_position_embeddings=64 with head_dim 16 puts the 8 RoPE wavelengths
    # (6.3 ... 2e4) in all three llama3 bands: kept, smoothed and divided by `factor`.
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    model, path = make_hf_checkpoint(tmp_path, "llama", rope_scaling=scaling, rope_theta=10000.0)
    target = ds.load_target(path)
    assert target.cfg.rope_scaling_dict["rope_type"] == "llama3"
    assert_parity(model, target, random_ids(150, seed=3)[None])


def test_sharded_checkpoint(tmp_path):
    model, path = make_hf_checkpoint(tmp_path, "qwen2", save_kw=dict(max_shard_size="50KB"))
    files = os.listdir(path)
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    assert_parity(model, ds.load_target(path), random_ids(20, seed=4)[None])


def test_scan_layers_load_matches_hf(tmp_path):
    """load_target(scan_layers=True) stacks the per-layer HF tensors on a leading axis."""
    model, path = make_hf_checkpoint(tmp_path, "qwen3")
    target = ds.load_target(path, scan_layers=True)
    assert target.cfg.scan_layers
    assert_parity(model, target, random_ids(37, seed=5)[None])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_prefill_of_ragged_batch_matches_hf(tmp_path, family):
    """Prompts of different lengths packed into one step (starts 0, counts = lengths)."""
    model, path = make_hf_checkpoint(tmp_path, family, tie_word_embeddings=family == "llama")
    target = ds.load_target(path)
    lengths = [5, 23, 1, 12]
    prompts = [random_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    N, S, q_max = 48, len(lengths), 32  # N > sum(lengths): the tail is bucket padding
    tokens = np.zeros(N, np.int32)
    tokens[: sum(lengths)] = np.concatenate(prompts)
    cache = KVCache.zeros(target.cfg, S, 64)
    logits, _, _ = packed_step(
        target.graphdef, target.state, cache, jnp.asarray(tokens),
        jnp.zeros(S, jnp.int32), jnp.asarray(lengths, jnp.int32), q_max=q_max,
    )
    logits = np.asarray(logits)
    assert logits.shape == (N, 128)
    off = 0
    for ids in prompts:
        ref = hf_logits(model, ids)
        np.testing.assert_allclose(logits[off : off + len(ids)], ref, rtol=0, atol=ATOL)
        off += len(ids)
