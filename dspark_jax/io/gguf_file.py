"""GGUF (llama.cpp) checkpoints: config, tokenizer metadata and dequantised tensors under HF names."""

from __future__ import annotations

import re

import numpy as np

# Tensor types we dequantise (through gguf.quants); anything else gets a clear error.
SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}

_ARCH_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field_value(field):
    """Python value of a GGUFReader field (scalars, strings, arrays of either)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of Q/K rows (its RoPE layout → HF rotate-half layout)."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


class GGUFSource:
    def __init__(self, path: str):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # noqa: BLE001 - gguf raises many kinds on a bad file
            raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e
        self.fields = {k: _field_value(f) for k, f in self.reader.fields.items()}
        self.arch = self.fields.get("general.architecture")
        if self.arch not in _ARCH_FAMILY:
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported; supported: {sorted(_ARCH_FAMILY)}"
            )
        self._tensors = {}
        for t in self.reader.tensors:
            self._tensors[self._hf_name(t.name)] = t

    def _hf_name(self, name: str) -> str:
        if name in _TOP_MAP:
            return _TOP_MAP[name]
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        if m and m.group(2) in _LAYER_MAP:
            return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
        return "gguf:" + name  # unknown: reported as unused by the loader

    def config_dict(self) -> dict:
        """An HF-style config dict from the GGUF metadata."""
        a, f = self.arch, self.fields
        n_head = f[f"{a}.attention.head_count"]
        D = f[f"{a}.embedding_length"]
        head_dim = f.get(f"{a}.attention.key_length") or D // n_head
        vocab = f.get(f"{a}.vocab_size") or len(f["tokenizer.ggml.tokens"])
        arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[a]
        cfg = {
            "architectures": [arch_name],
            "vocab_size": vocab,
            "hidden_size": D,
            "num_hidden_layers": f[f"{a}.block_count"],
            "num_attention_heads": n_head,
            "num_key_value_heads": f.get(f"{a}.attention.head_count_kv", n_head),
            "head_dim": head_dim,
            "intermediate_size": f[f"{a}.feed_forward_length"],
            "rope_theta": f.get(f"{a}.rope.freq_base", 10000.0),
            "rms_norm_eps": f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "max_position_embeddings": f.get(f"{a}.context_length", 4096),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
        }
        scaling_type = f.get(f"{a}.rope.scaling.type")
        if scaling_type == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": f[f"{a}.rope.scaling.factor"]}
        elif scaling_type not in (None, "none"):
            raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported")
        return cfg

    def keys(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors[name]
        tname = t.tensor_type.name
        if tname not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {tname}, which dspark_jax cannot read; "
                f"supported types: {sorted(SUPPORTED_TYPES)}"
            )
        # Dequantise to fp32 (numpy arrays come back as (out, in), i.e. HF layout).
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        a = self.arch
        if self.arch == "llama":
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                w = _unpermute(w, self.fields[f"{a}.attention.head_count"])
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                w = _unpermute(w, self.fields.get(f"{a}.attention.head_count_kv",
                                                  self.fields[f"{a}.attention.head_count"]))
        return w
