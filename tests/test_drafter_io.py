"""Drafter checkpoints: our export round trip and the DeepSpec importer."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dspark_jax as ds

TCFG = ds.ModelConfig.tiny(vocab_size=96, tie_word_embeddings=False)
MASK_ID = 95


@pytest.fixture(scope="module")
def target():
    return ds.Target.random(TCFG, seed=0)


def drafter(head="markov", **kw):
    cfg = ds.DrafterConfig.for_target(TCFG, num_feature_layers=2, block_size=4, num_layers=2,
                                      markov_rank=8 if head != "none" else 0, head_type=head, **kw)
    return ds.Drafter.random(cfg, seed=5)


def flat(state):
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
def test_save_load_round_trip_is_exact(tmp_path, target, head):
    d = drafter(head, sts_temperatures=(0.9, 1.1, 1.3, 2.0), confidence_head=head != "none")
    ds.save_drafter(d, str(tmp_path))
    back = ds.load_drafter(str(tmp_path), target)
    assert back.cfg == d.cfg
    a, b = flat(d.state), flat(back.state)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def deepspec_state_dict(d, target):
    """Our drafter written the way DeepSpec's Qwen3DSparkModel names and lays out tensors
    (torch Linear weights are (out, in)); written independently of the importer."""
    p = flat(d.state)
    sd = {"fc.weight": p["fc.kernel"].T, "hidden_norm.weight": p["hidden_norm.weight"],
          "norm.weight": p["norm.weight"]}
    for i in range(d.cfg.num_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"layers.{i}.self_attn.{proj}.weight"] = p[f"layers.{i}.self_attn.{proj}.kernel"].T
        for n in ("q_norm", "k_norm"):
            sd[f"layers.{i}.self_attn.{n}.weight"] = p[f"layers.{i}.self_attn.{n}.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sd[f"layers.{i}.mlp.{proj}.weight"] = p[f"layers.{i}.mlp.{proj}.kernel"].T
        for n in ("input_layernorm", "post_attention_layernorm"):
            sd[f"layers.{i}.{n}.weight"] = p[f"layers.{i}.{n}.weight"]
    if d.cfg.rank:
        sd["markov_head.markov_w1.weight"] = p["head.w1"]
        sd["markov_head.markov_w2.weight"] = p["head.w2"].T
        if d.cfg.head_type == "rnn":
            sd["markov_head.joint_proj.weight"] = p["head.joint_proj.kernel"].T
            sd["markov_head.joint_proj.bias"] = p["head.joint_proj.bias"]
    if d.cfg.confidence_head:
        sd["confidence_head.proj.weight"] = p["confidence.proj.kernel"].T
        sd["confidence_head.proj.bias"] = p["confidence.proj.bias"]
    emb = np.array(target.state["embed_tokens"][...])
    emb[MASK_ID] = p["mask_embedding"]  # DeepSpec's mask is a reserved row of the frozen embedding
    sd["embed_tokens.weight"] = emb
    sd["lm_head.weight"] = np.asarray(target.state["lm_head"][...]).T
    return sd


def deepspec_config(d):
    c = d.cfg
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "num_hidden_layers": c.num_layers,
        "num_target_layers": c.num_target_layers, "block_size": c.block_size,
        "mask_token_id": MASK_ID, "target_layer_ids": list(c.target_layer_ids), "num_anchors": 512,
        "enable_confidence_head": c.confidence_head, "confidence_head_with_markov": c.confidence_with_markov,
        "markov_rank": c.markov_rank, "markov_head_type": {"markov": "vanilla"}.get(c.head_type, c.head_type),
        "tie_word_embeddings": False, "attention_bias": False,
    }


def write_deepspec(path, d, sd):
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(deepspec_config(d), f)


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_deepspec_import_uses_every_tensor(tmp_path, target, head):
    d = drafter(head, confidence_head=head != "none")
    write_deepspec(str(tmp_path), d, deepspec_state_dict(d, target))
    back = ds.load_drafter(str(tmp_path), target)
    assert back.cfg.head_type == head and back.cfg.block_size == 4
    a, b = flat(d.state), flat(back.state)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # And it decodes (greedy spec == AR greedy).
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    ar = ds.generate(target, [[3, 4, 5]], sampling=sp)
    spec = ds.generate(target, [[3, 4, 5]], drafter=back, sampling=sp, num_draft=3)
    assert spec.token_ids == ar.token_ids


def test_deepspec_missing_tensor_is_listed(tmp_path, target):
    d = drafter("markov")
    sd = deepspec_state_dict(d, target)
    del sd["layers.1.mlp.up_proj.weight"]
    write_deepspec(str(tmp_path), d, sd)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        ds.load_drafter(str(tmp_path), target)


def test_deepspec_extra_tensor_is_listed(tmp_path, target):
    d = drafter("markov")
    sd = deepspec_state_dict(d, target)
    sd["markov_head.surprise.weight"] = np.zeros((2, 2), np.float32)
    write_deepspec(str(tmp_path), d, sd)
    with pytest.raises(ValueError, match=r"markov_head\.surprise\.weight"):
        ds.load_drafter(str(tmp_path), target)


def test_deepspec_embedding_must_match_target(tmp_path, target):
    d = drafter("markov")
    sd = deepspec_state_dict(d, target)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    write_deepspec(str(tmp_path), d, sd)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        ds.load_drafter(str(tmp_path), target)


def test_our_format_missing_and_extra_tensors(tmp_path, target):
    from safetensors.numpy import load_file

    d = drafter("rnn")
    ds.save_drafter(d, str(tmp_path))
    f = os.path.join(str(tmp_path), "model.safetensors")
    t = load_file(f)
    t.pop("head.joint_proj.bias")
    t["bogus"] = np.zeros(3, np.float32)
    save_file(t, f)
    with pytest.raises(ValueError, match=r"missing tensors \['head.joint_proj.bias'\].*unexpected tensors \['bogus'\]"):
        ds.load_drafter(str(tmp_path), target)


def test_load_errors(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="no drafter directory"):
        ds.load_drafter(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        ds.load_drafter(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="neither a dspark_jax drafter export nor a DeepSpec"):
        ds.load_drafter(str(tmp_path))


def test_mismatched_target_is_rejected(tmp_path):
    d = drafter("markov")
    ds.save_drafter(d, str(tmp_path))
    other = ds.Target.random(ds.ModelConfig.tiny(vocab_size=96, hidden_size=32, head_dim=8))
    with pytest.raises(ValueError, match="hidden size 64 != target's 32"):
        ds.load_drafter(str(tmp_path), other)


def test_loaded_drafter_is_deterministic_in_generate(tmp_path, target):
    d = drafter("rnn")
    ds.save_drafter(d, str(tmp_path))
    back = ds.load_drafter(str(tmp_path), target)
    sp = ds.SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=7)
    a = ds.generate(target, [[5, 6, 7, 8]], drafter=d, sampling=sp, num_draft=4)
    b = ds.generate(target, [[5, 6, 7, 8]], drafter=back, sampling=sp, num_draft=4)
    assert a.token_ids == b.token_ids
    jax.clear_caches()
