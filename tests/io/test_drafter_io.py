"""Drafter checkpoints: our export round trip and the DeepSpec importer."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dspark_jax as ds

# A non-default RoPE θ (Qwen3's 1e6): an importer that falls back to 10000 drafts wrongly.
TCFG = ds.ModelConfig.tiny(vocab_size=96, tie_word_embeddings=False, rope_theta=1e6)
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


def deepspec_config(d, layout="transformers5"):
    """The config.json DeepSpec's trainer writes: the target's config, amended. transformers 5
    keeps RoPE only under `rope_parameters`; transformers 4 wrote a top-level `rope_theta`."""
    c = d.cfg
    rope = ({"rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"}} if layout == "transformers5"
            else {"rope_theta": c.rope_theta})
    return {**rope,
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
        "num_hidden_layers": c.num_layers,
        "num_target_layers": c.num_target_layers, "block_size": c.block_size,
        "mask_token_id": MASK_ID, "target_layer_ids": list(c.target_layer_ids), "num_anchors": 512,
        "enable_confidence_head": c.confidence_head, "confidence_head_with_markov": c.confidence_with_markov,
        "markov_rank": c.markov_rank, "markov_head_type": {"markov": "vanilla"}.get(c.head_type, c.head_type),
        "tie_word_embeddings": False, "attention_bias": False,
    }


def write_deepspec(path, d, sd, config=None):
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(deepspec_config(d) if config is None else config, f)


@pytest.mark.slow
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


@pytest.mark.slow
def test_loaded_drafter_is_deterministic_in_generate(tmp_path, target):
    d = drafter("rnn")
    ds.save_drafter(d, str(tmp_path))
    back = ds.load_drafter(str(tmp_path), target)
    sp = ds.SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=7)
    a = ds.generate(target, [[5, 6, 7, 8]], drafter=d, sampling=sp, num_draft=4)
    b = ds.generate(target, [[5, 6, 7, 8]], drafter=back, sampling=sp, num_draft=4)
    assert a.token_ids == b.token_ids
    jax.clear_caches()


# --------------------------------------------------------------------------- DeepSpec RoPE


def informative(d):
    """Redrawn at informative scales: at init scale attention is near uniform and RoPE hardly shows."""
    from conftest import randomize_state

    return ds.Drafter(d.cfg, d.graphdef, randomize_state(d.state, 3))


def drafts(drafter_, target, seed=0):
    """Draft logits of one block after 12 context positions of random target features."""
    from dspark_jax.decoding.drafting import append_features, draft_block
    from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams

    S, T = 2, 12
    F = len(drafter_.cfg.target_layer_ids) * TCFG.hidden_size
    feats = jax.random.normal(jax.random.key(seed), (S * T, F))
    cache = drafter_.init_cache(drafter_.params, S, 32)
    cache = append_features(drafter_, drafter_.params, target.graphdef, target.state, cache, feats,
                            jax.numpy.repeat(jax.numpy.arange(S), T), jax.numpy.tile(jax.numpy.arange(T), S),
                            jax.numpy.ones(S * T, bool))
    sa = SamplingArrays.from_params([SamplingParams(temperature=0.0)] * S)
    keys = jax.random.split(jax.random.key(seed), S)
    anchor, pos = jax.numpy.asarray([3, 7]), jax.numpy.asarray([T, T])
    _, logits, conf = draft_block(drafter_, drafter_.params, target.graphdef, target.state, cache, anchor, pos,
                                  keys, sa)
    return np.asarray(logits), np.asarray(conf)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["transformers5", "transformers4"])
def test_deepspec_rope_theta_is_read_in_both_layouts(tmp_path, target, layout):
    """A checkpoint in the layout DeepSpec's trainer writes drafts exactly like the drafter it was
    written from (same weights, θ = 1e6): the independent computation is our own drafter object."""
    d = informative(drafter("markov"))
    assert d.cfg.rope_theta == 1e6
    write_deepspec(str(tmp_path), d, deepspec_state_dict(d, target), deepspec_config(d, layout))
    back = ds.load_drafter(str(tmp_path), target)
    assert back.cfg.rope_theta == 1e6 and back.cfg.rope_scaling is None
    (la, ca), (lb, cb) = drafts(d, target), drafts(back, target)
    np.testing.assert_allclose(lb, la, atol=1e-5)
    np.testing.assert_allclose(cb, ca, atol=1e-6)
    # Negative control: the same weights with θ = 10000 draft differently, so the check has teeth.
    from dspark_jax.models.drafter import abstract_drafter

    wrong_cfg = d.cfg.replace(rope_theta=10000.0)
    wrong = ds.Drafter(wrong_cfg, abstract_drafter(wrong_cfg)[0], d.state)  # θ lives in the graphdef
    assert np.abs(drafts(wrong, target)[0] - la).max() > 1e-3


@pytest.mark.slow
def test_deepspec_scaled_rope_in_rope_parameters(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    tcfg = ds.ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "rope_parameters": {"rope_theta": 5e5, **scaling}})
    assert tcfg.rope_theta == 5e5 and dict(tcfg.rope_scaling) == scaling
    tgt = ds.Target.random(tcfg, seed=1)
    d = informative(ds.Drafter.random(ds.DrafterConfig.for_target(tcfg, num_feature_layers=2, block_size=4,
                                                                  num_layers=2, markov_rank=8), seed=2))
    conf = deepspec_config(d)
    conf["rope_parameters"] = {"rope_theta": 5e5, **scaling}
    write_deepspec(str(tmp_path), d, deepspec_state_dict(d, tgt), conf)
    back = ds.load_drafter(str(tmp_path), tgt)
    assert back.cfg.rope_theta == 5e5 and back.cfg.rope_scaling == tcfg.rope_scaling
    np.testing.assert_allclose(drafts(back, tgt)[0], drafts(d, tgt)[0], atol=1e-5)


def test_deepspec_rope_absent_is_taken_from_target_or_fails(tmp_path, target):
    d = drafter("markov")
    conf = deepspec_config(d)
    del conf["rope_parameters"]
    write_deepspec(str(tmp_path), d, deepspec_state_dict(d, target), conf)
    assert ds.load_drafter(str(tmp_path), target).cfg.rope_theta == 1e6
    with pytest.raises(ValueError, match=r"lacks the field 'rope_theta \(or rope_parameters\.rope_theta\)'"):
        ds.load_drafter(str(tmp_path))


def test_deepspec_rope_must_match_target(tmp_path, target):
    d = drafter("markov")
    conf = deepspec_config(d)
    conf["rope_parameters"]["rope_theta"] = 10000.0
    write_deepspec(str(tmp_path), d, deepspec_state_dict(d, target), conf)
    with pytest.raises(ValueError, match=r"drafter's RoPE \(rope_theta=10000.*differs from the target's "
                                         r"\(rope_theta=1e\+06"):
        ds.load_drafter(str(tmp_path), target)


def test_deepspec_numeric_fields_have_no_silent_defaults(tmp_path, target):
    d = drafter("markov")
    conf = deepspec_config(d)
    del conf["rms_norm_eps"], conf["head_dim"]
    write_deepspec(str(tmp_path), d, deepspec_state_dict(d, target), conf)
    back = ds.load_drafter(str(tmp_path), target)
    assert back.cfg.rms_norm_eps == TCFG.rms_norm_eps and back.cfg.head_dim == TCFG.head_dim
    with pytest.raises(ValueError, match="lacks the field 'head_dim'"):
        ds.load_drafter(str(tmp_path))


# --------------------------------------------------------------------------- bad config.json


def _write_config(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_config_that_is_not_json_names_the_file(tmp_path):
    path = _write_config(tmp_path, "{not json")
    with pytest.raises(ValueError, match=r"config\.json' is not valid JSON"):
        ds.load_drafter(path)


def test_config_that_is_a_json_list(tmp_path):
    path = _write_config(tmp_path, "[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json' holds a JSON array; expected the drafter config as a JSON"):
        ds.load_drafter(path)


@pytest.mark.parametrize("fmt", ["ours", "deepspec"])
@pytest.mark.parametrize(
    "edit,pattern",
    [
        (dict(block_size="seven"), r"field 'block_size' must be an integer, got \"seven\" \(a string\)"),
        (dict(target_layer_ids=[0, "1"]), r"field 'target_layer_ids' must be a list of integers"),
        (dict(block_size=None), r"required field 'block_size' is missing"),
        (dict(block_size=0), r"block_size \(γ\) must be >= 1"),
    ],
)
def test_config_fields_are_validated(tmp_path, target, fmt, edit, pattern):
    d = drafter("markov")
    if fmt == "ours":
        ds.save_drafter(d, str(tmp_path))
        conf = json.loads((tmp_path / "config.json").read_text())
    else:
        write_deepspec(str(tmp_path), d, deepspec_state_dict(d, target))
        conf = deepspec_config(d)
    for k, v in edit.items():
        if v is None:
            del conf[k]
        else:
            conf[k] = v
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=pattern):
        ds.load_drafter(str(tmp_path), target)


def test_our_config_wrong_type_of_float_and_bool(tmp_path, target):
    ds.save_drafter(drafter("markov"), str(tmp_path))
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["rope_theta"], conf["confidence_head"] = "1e6", 1
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"field 'rope_theta' must be a number"):
        ds.load_drafter(str(tmp_path), target)
    conf["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"field 'confidence_head' must be true or false"):
        ds.load_drafter(str(tmp_path), target)


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_deepspec_config_written_by_transformers_itself(tmp_path, target):
    """The config.json as transformers writes it (`Qwen3Config.to_dict()`, amended the way
    DeepSpec's build_draft_config amends it), not a hand-written layout. Needs the parity extra."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = informative(drafter("markov"))
    c = d.cfg
    hf = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
    ).to_dict()
    hf.update(architectures=["Qwen3DSparkModel"], num_target_layers=c.num_target_layers, block_size=c.block_size,
              tie_word_embeddings=False, layer_types=["full_attention"] * c.num_layers, mask_token_id=MASK_ID,
              target_layer_ids=list(c.target_layer_ids), num_anchors=512, enable_confidence_head=True,
              confidence_head_with_markov=True, markov_rank=c.markov_rank, markov_head_type="vanilla")
    write_deepspec(str(tmp_path), d, deepspec_state_dict(d, target), hf)
    back = ds.load_drafter(str(tmp_path), target)
    assert back.cfg.rope_theta == 1e6
    np.testing.assert_allclose(drafts(back, target)[0], drafts(d, target)[0], atol=1e-5)
