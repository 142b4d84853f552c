"""GGUF (llama.cpp) checkpoints: config, tokenizer metadata and dequantised tensors under HF names."""

from __future__ import annotations

import os
import re
import struct

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


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
              6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class _Header:
    """A small GGUF (v2/v3) header parser. gguf.GGUFReader builds a numpy view per vocab
    string, which takes ~12 s for a 49k-token vocabulary; this takes well under a second."""

    def __init__(self, path: str):
        self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        self.mv = memoryview(self.buf)
        self.off = 0
        if bytes(self.mv[:4]) != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file (bad magic)")
        self.off = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"{path!r}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.fields = {}
        for _ in range(n_kv):
            key = self._str()
            self.fields[key] = self._value(self._read("<I"))
        self.tensors = []  # (name, shape (ggml order), type id, offset)
        for _ in range(n_tensors):
            name = self._str()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            self.tensors.append((name, dims, self._read("<I"), self._read("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        self.data_start = (self.off + align - 1) // align * align

    def data_end(self) -> int:
        """Where the last tensor's data ends: a complete file is at least this long."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        end = self.data_start
        for _, dims, type_id, offset in self.tensors:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError):
                continue  # a type we cannot read is reported when the tensor is read
            n = int(np.prod(dims)) if dims else 1
            end = max(end, self.data_start + offset + n // block * type_size)
        return end

    def _read(self, fmt):
        v = struct.unpack_from(fmt, self.mv, self.off)[0]
        self.off += struct.calcsize(fmt)
        return v

    def _str(self):
        n = self._read("<Q")
        s = bytes(self.mv[self.off : self.off + n]).decode("utf-8", errors="replace")
        self.off += n
        return s

    def _value(self, t):
        if t == 8:
            return self._str()
        if t == 9:
            et, n = self._read("<I"), self._read("<Q")
            if et in _NP_SCALAR:  # numeric arrays in one go
                dt = np.dtype(_NP_SCALAR[et])
                a = np.frombuffer(self.mv, dt, n, self.off)
                self.off += n * dt.itemsize
                return a.tolist()
            return [self._value(et) for _ in range(n)]
        if t in _SCALAR:
            return self._read(_SCALAR[t])
        raise ValueError(f"unknown GGUF value type {t}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of Q/K rows (its RoPE layout → HF rotate-half layout)."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


class GGUFSource:
    def __init__(self, path: str):
        size = os.path.getsize(path)
        try:
            self.header = _Header(path)
        except struct.error as e:  # the header itself runs past the end of the file
            raise ValueError(f"{path!r} is not a readable GGUF file: the file is truncated inside its header "
                             f"(got {size} bytes); download it again") from e
        except ValueError as e:
            raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e
        expected = self.header.data_end()
        if expected > size:
            raise ValueError(f"{path!r} is not a readable GGUF file: the file is truncated: expected {expected} "
                             f"bytes, got {size}; download it again")
        self.path = path
        self.fields = self.header.fields
        self.arch = self.fields.get("general.architecture")
        if self.arch not in _ARCH_FAMILY:
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported; supported: {sorted(_ARCH_FAMILY)}"
            )
        self._tensors = {self._hf_name(t[0]): t for t in self.header.tensors}

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
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        tname, dims, type_id, offset = self._tensors[name]
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            qtype = None
        if qtype is None or qtype.name not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {tname!r} has type {qtype.name if qtype else type_id}, which dspark_jax "
                f"cannot read; supported types: {sorted(SUPPORTED_TYPES)}"
            )
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = [int(d) for d in reversed(dims)]  # ggml lists dims fastest-first
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = shape[-1] // block * type_size
        start = self.header.data_start + offset
        raw = self.header.buf[start : start + rows * row_bytes].reshape(rows, row_bytes)
        # Dequantise to fp32; arrays come back as (out, in), i.e. HF layout.
        w = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(shape)
        a = self.arch
        if a == "llama":
            n_head = self.fields[f"{a}.attention.head_count"]
            if ".self_attn.q_proj." in name:
                w = _unpermute(w, n_head)
            elif ".self_attn.k_proj." in name:
                w = _unpermute(w, self.fields.get(f"{a}.attention.head_count_kv", n_head))
        return w
