"""Tokenizers (HF `tokenizer.json` or GGUF metadata) and chat templates rendered with jinja2."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# GGUF `tokenizer.ggml.pre` values whose original tokenizers split digits one by one
# before the GPT-2 byte-level regex (SmolLM / SmolLM2's tokenizer.json does exactly this).
_DIGIT_SPLIT_PRE = {"smollm"}


@dataclasses.dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the bits generation needs: special ids and the chat template."""

    tok: Tokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError(
                "this checkpoint has no chat template; pass the prompt as a string or as token ids"
            )
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_str(tok: Tokenizer, tid):
    return None if tid is None else tok.id_to_token(tid)


def from_hf_dir(path: str, eos_token_ids: tuple[int, ...] = ()) -> TextTokenizer:
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tj):
        raise FileNotFoundError(f"no tokenizer.json in {path!r}")
    tok = Tokenizer.from_file(tj)
    cfg = {}
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(tc):
        with open(tc) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    jt = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jt):
        with open(jt) as f:
            template = f.read()

    def tok_id(key):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return (tok.token_to_id(v) if v else None), v

    bos_id, bos = tok_id("bos_token")
    eos_id, eos = tok_id("eos_token")
    eos_ids = tuple(eos_token_ids) or ((eos_id,) if eos_id is not None else ())
    return TextTokenizer(tok, bos_id, eos_ids, template, bos, eos)


def from_gguf_fields(fields: dict) -> TextTokenizer:
    """Builds a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata."""
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
            "load the model from an HF directory with tokenizer.json instead"
        )
    tokens = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if fields.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type") or []
    # Type 3 = CONTROL (e.g. <|im_start|>): must be matched whole in text, never split.
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    if specials:
        tok.add_special_tokens(specials)
    bos = fields.get("tokenizer.ggml.bos_token_id")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return TextTokenizer(
        tok,
        bos_token_id=bos,
        eos_token_ids=(eos,) if eos is not None else (),
        chat_template=fields.get("tokenizer.chat_template"),
        bos_token=_token_str(tok, bos),
        eos_token=_token_str(tok, eos),
    )
