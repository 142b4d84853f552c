"""Errors are part of the interface: each bad input gets a specific message that names
what was wrong. Every check here fails before anything is compiled."""

import json

import numpy as np
import pytest

import dspark_jax as ds

SP = ds.SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return ds.Target.random(ds.ModelConfig.tiny())


# --------------------------------------------------------------------------- loading


def test_missing_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no model at .*no-such-model"):
        ds.load_target(missing)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        ds.load_target(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a .gguf checkpoint"):
        ds.load_target(str(f))
    g = tmp_path / "model.gguf"
    g.write_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(ValueError, match="not a readable GGUF file.*bad magic"):
        ds.load_target(str(g))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 128,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
    }))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        ds.load_target(str(tmp_path))


def test_unsupported_rope_scaling():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ds.ModelConfig.from_hf_dict(hf)


def test_rope_parameters_layouts():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128}
    cfg = ds.ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    cfg = ds.ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear",
                                                                   "factor": 2.0}})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == (("factor", 2.0), ("rope_type", "linear"))
    nested = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    with pytest.raises(ValueError, match="per-layer-type rope_parameters"):
        ds.ModelConfig.from_hf_dict({**base, "rope_parameters": nested})
    with pytest.raises(ValueError, match=r"rope_theta must be a positive number, got '1e6'"):
        ds.ModelConfig.from_hf_dict({**base, "rope_theta": "1e6"})


def _tiny_hf_checkpoint(path):
    torch = pytest.importorskip("torch")  # the `parity` extra writes the HF checkpoint
    transformers = pytest.importorskip("transformers")
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_checkpoint_missing_or_extra_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _tiny_hf_checkpoint(tmp_path / "ckpt")
    f = path / "model.safetensors"
    tensors = load_file(f)
    gone = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        ds.load_target(str(path))
    tensors["model.layers.1.mlp.up_proj.weight"] = gone
    tensors["model.layers.1.mlp.extra_proj.weight"] = gone
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"does not use.*model\.layers\.1\.mlp\.extra_proj\.weight"):
        ds.load_target(str(path))


def test_checkpoint_tensor_with_wrong_shape(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _tiny_hf_checkpoint(tmp_path / "ckpt")
    f = path / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"k_proj\.weight' has shape \(64, 64\), expected"):
        ds.load_target(str(path))


def _write_gguf(path, arch="llama", bad_type=None):
    """A complete tiny llama GGUF in F32, except `blk.0.ffn_down.weight` stored raw as
    `bad_type` (its 256-wide rows fit the 256-element blocks of the K-quants)."""
    import gguf

    D, F, L, V = 64, 256, 2, 16
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    tokens = ["a", "b", "ab"] + [f"t{i}" for i in range(V - 3)]
    w.add_token_list(tokens)
    w.add_token_types([1] * V)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def t(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w.add_tensor("token_embd.weight", t(V, D))
    w.add_tensor("output_norm.weight", t(D))
    for i in range(L):
        for name, shape in [("attn_q", (D, D)), ("attn_k", (32, D)), ("attn_v", (32, D)),
                            ("attn_output", (D, D)), ("ffn_gate", (F, D)), ("ffn_up", (F, D)),
                            ("attn_norm", (D,)), ("ffn_norm", (D,))]:
            w.add_tensor(f"blk.{i}.{name}.weight", t(*shape))
        if i == 0 and bad_type is not None:
            block, size = gguf.GGML_QUANT_SIZES[bad_type]
            raw = np.zeros((D, F // block * size), np.uint8)
            w.add_tensor(f"blk.{i}.ffn_down.weight", raw, raw_dtype=bad_type)
        else:
            w.add_tensor(f"blk.{i}.ffn_down.weight", t(D, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_roundtrip_loads(tmp_path):
    """The writer below produces a file we can load (so the next test fails for its reason)."""
    t = ds.load_target(_write_gguf(tmp_path / "ok.gguf"))
    assert t.cfg.num_layers == 2 and t.cfg.intermediate_size == 256 and t.cfg.tie_word_embeddings


@pytest.mark.parametrize("type_name", ["Q2_K", "IQ2_XXS"])
def test_gguf_tensor_type_we_cannot_read(tmp_path, type_name):
    from gguf import GGMLQuantizationType

    from dspark_jax.io.gguf_file import SUPPORTED_TYPES

    assert type_name not in SUPPORTED_TYPES
    path = _write_gguf(tmp_path / "bad.gguf", bad_type=GGMLQuantizationType[type_name])
    pattern = rf"'blk\.0\.ffn_down\.weight' has type {type_name}.*supported types"
    with pytest.raises(ValueError, match=pattern):
        ds.load_target(path)


@pytest.mark.parametrize("keep", [0.5, 40])  # half the file (in the tensor data), 40 bytes (in the header)
def test_gguf_truncated_file(tmp_path, keep):
    path = _write_gguf(tmp_path / "ok.gguf")
    data = open(path, "rb").read()
    cut = int(len(data) * keep) if keep < 1 else keep
    with open(path, "wb") as f:
        f.write(data[:cut])
    pattern = (rf"the file is truncated: expected \d+ bytes, got {cut}" if keep < 1
               else rf"the file is truncated inside its header \(got {cut} bytes\)")
    with pytest.raises(ValueError, match=pattern) as e:
        ds.load_target(path)
    if keep < 1:
        expected = int(str(e.value).split("expected ")[1].split()[0])
        assert cut < expected <= len(data)


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        ds.load_target(str(tmp_path / "m.gguf"))


# --------------------------------------------------------------------------- generation


def test_prompt_longer_than_context(tiny):
    n = tiny.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 0 has {n} tokens.*context of {n} tokens"):
        ds.generate(tiny, [[5] * n], sampling=SP(max_new_tokens=1))
    with pytest.raises(ValueError, match=rf"max_new_tokens=64 that exceeds the model's context of {n}"):
        ds.generate(tiny, [[5] * (n - 10)], sampling=SP(max_new_tokens=64))
    with pytest.raises(ValueError, match=rf"{n + 1} tokens is longer than the model's context \({n}\)"):
        ds.logits(tiny, np.zeros(n + 1, np.int32))


@pytest.mark.parametrize(
    "kw,pattern",
    [
        (dict(temperature=-0.5), r"temperature must be .*>= 0.*got -0\.5"),
        (dict(temperature=float("nan")), r"temperature must be a finite number"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\].*got 0\.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\].*got 1\.5"),
        (dict(top_k=-1), r"top_k must be an integer >= 0.*got -1"),
        (dict(top_k=2.5), r"top_k must be an integer"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\].*got 1\.5"),
        (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1.*got 0"),
        (dict(stop=("",)), r"stop must be a sequence of non-empty strings"),
        (dict(temperature="0.7"), r"temperature must be a number, got '0\.7' \(str\)"),
        (dict(top_p="0.9"), r"top_p must be a number, got '0\.9'"),
        (dict(min_p=None), r"min_p must be a number, got None"),
        (dict(max_new_tokens="64"), r"max_new_tokens must be an integer >= 1, got '64'"),
        (dict(seed=1.5), r"seed must be an integer \(any size\) or None"),
        (dict(seed="7"), r"seed must be an integer"),
        (dict(stop_token_ids=(2, "x")), r"stop_token_ids must be a sequence of integers"),
    ],
)
def test_bad_sampling_params(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        SP(**kw)


def test_bad_prompts(tiny):
    with pytest.raises(ValueError, match="empty prompt"):
        ds.generate(tiny, [[]])
    with pytest.raises(ValueError, match="empty prompt"):
        ds.generate(tiny, [[3, 4], []])
    with pytest.raises(ValueError, match="non-empty list"):
        ds.generate(tiny, [])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\); got min 3, max 128"):
        ds.generate(tiny, [[3, 128]])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\); got min -1"):
        ds.generate(tiny, [[-1, 5]])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\)"):
        ds.logits(tiny, [1, 200])
    with pytest.raises(ValueError, match="no tokenizer"):
        ds.generate(tiny, ["hello"])
    with pytest.raises(ValueError, match=r"got 1 SamplingParams for 2 prompts"):
        ds.generate(tiny, [[1], [2]], sampling=[SP()])


def test_bad_policy(tiny):
    with pytest.raises(ValueError, match="policy='fixed' needs a drafter"):
        ds.generate(tiny, [[1, 2]], policy="fixed")
    with pytest.raises(ValueError, match="policy must be one of"):
        ds.generate(tiny, [[1, 2]], policy="greedy")


def test_not_a_drafter(tiny):
    """Something that is not a drafter is named with what it lacks, before anything compiles."""

    class HalfDrafter:
        block_size = 4

        def draft(self, *a):
            return None

    with pytest.raises(TypeError, match="HalfDrafter is not a drafter: it lacks feature_layers.*append"):
        ds.generate(tiny, [[1, 2]], drafter=HalfDrafter(), policy="fixed")
    from serve.engine import Engine

    with pytest.raises(TypeError, match="not a drafter"):
        Engine(tiny, drafter=HalfDrafter(), slots=1, max_len=64)
