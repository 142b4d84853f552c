"""The OpenAI wire format: errors as OpenAI error bodies, request parsing and validation
(prompt, sampling parameters, stop, limits), and the response, chunk and usage bodies."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

MAX_STOP_STRINGS = 16


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Settings:
    model_name: str
    max_tokens_limit: int
    context: int  # prompt + completion tokens that fit one engine slot
    api_key: str | None
    stop_id_slots: int


@dataclasses.dataclass
class GenerationRequest:
    """A validated completion or chat request, before its prompt is tokenized."""

    prompt: Any  # a string, token ids, or chat messages
    stream: bool
    include_usage: bool
    stop: list[str]
    max_tokens: int | None  # None: decided once the prompt length is known (`fit_max_tokens`)
    sampling: dict  # ds.SamplingParams keywords, all but max_new_tokens


def field(body: dict, name: str, kinds, default=None, *, alias: str | None = None):
    """`body[name]` (or `body[alias]`) checked against `kinds`; `default` when absent or null."""
    v = body.get(name, None)
    if v is None and alias is not None:
        v, name = body.get(alias, None), alias
    if v is None:
        return default
    if kinds is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and kinds is not bool or not isinstance(v, kinds):
        want = {float: "a number", int: "an integer", bool: "a boolean", str: "a string", dict: "an object",
                list: "an array", (str, list): "a string or an array"}.get(kinds, str(kinds))
        raise bad_request(f"'{name}' must be {want}, got {json.dumps(v)[:80]}", name)
    return v


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def parse_request(body: dict, s: Settings, eos_token_ids, *, chat: bool) -> GenerationRequest:
    """Validates a /v1/completions (`chat=False`) or /v1/chat/completions body; raises APIError."""
    import dspark_jax as ds

    model = field(body, "model", str)
    if model is not None and model != s.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{s.model_name}'",
                       "invalid_request_error", "model", "model_not_found")
    n = field(body, "n", int, 1)
    if n != 1:
        raise bad_request(f"only n=1 is supported, got n={n}", "n")
    if chat:
        prompt = chat_messages(body)
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            raise bad_request("logprobs are not supported", "logprobs")
        if body.get("tools"):
            raise bad_request("tools are not supported", "tools")
    else:
        prompt = completion_prompt(body)
        if body.get("logprobs") is not None:
            raise bad_request("logprobs are not supported", "logprobs")
        if body.get("echo"):
            raise bad_request("echo is not supported", "echo")
        if body.get("suffix"):
            raise bad_request("suffix is not supported", "suffix")
        if field(body, "best_of", int, 1) != 1:
            raise bad_request("only best_of=1 is supported", "best_of")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = field(body, name, float)
        if v not in (None, 0.0) and not (name == "repetition_penalty" and v == 1.0):
            raise bad_request(f"'{name}' is not supported", name)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    stream = field(body, "stream", bool, False)
    opts = field(body, "stream_options", dict, {})
    if opts and not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    include_usage = bool(field(opts, "include_usage", bool, False))
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(x, str) and x for x in stop) or len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
                          "stop")
    stop_ids = field(body, "stop_token_ids", list)
    if stop_ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    ignore_eos = field(body, "ignore_eos", bool, False)
    n_ids = len(set(stop_ids or []) | (set() if ignore_eos else set(eos_token_ids)))
    if n_ids > s.stop_id_slots:
        raise bad_request(f"at most {s.stop_id_slots} stop token ids (EOS included) per request", "stop_token_ids")
    max_tokens = field(body, "max_tokens", int, alias="max_completion_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens is not None and max_tokens > s.max_tokens_limit:
        raise bad_request(f"'max_tokens' is {max_tokens}; this server allows at most {s.max_tokens_limit}",
                          "max_tokens")
    sampling_kw = dict(
        temperature=field(body, "temperature", float, 1.0),
        top_p=field(body, "top_p", float, 1.0),
        top_k=field(body, "top_k", int, 0),
        min_p=field(body, "min_p", float, 0.0),
        seed=field(body, "seed", int),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids) if stop_ids is not None else None,
        ignore_eos=ignore_eos,
    )
    if sampling_kw["top_k"] == -1:  # vLLM's "off"
        sampling_kw["top_k"] = 0
    # Validate the sampling values now, with the prompt still unread (SamplingParams' own checks).
    try:
        ds.SamplingParams(max_new_tokens=1, **sampling_kw)
    except ValueError as e:
        param = next((k for k in sorted(sampling_kw, key=len, reverse=True) if str(e).startswith(k)), None)
        raise bad_request(str(e), param) from None
    return GenerationRequest(prompt, stream, include_usage, stop, max_tokens, sampling_kw)


def fit_max_tokens(max_tokens: int | None, prompt_len: int, s: Settings, *, chat: bool) -> int:
    """The request's max_tokens (defaulted if absent), checked against the slot's context."""
    room = s.context - prompt_len
    if max_tokens is None:
        max_tokens = min(16 if not chat else s.max_tokens_limit, s.max_tokens_limit, max(room, 1))
    if prompt_len + max_tokens > s.context:
        raise bad_request(f"This model's maximum context length is {s.context} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the {'messages' if chat else 'prompt'}, "
                          f"{max_tokens} for the completion). Please reduce the length of the "
                          f"{'messages' if chat else 'prompt'} or the completion.",
                          "messages" if chat else "prompt", "context_length_exceeded")
    return max_tokens


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty array of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role' and 'content'", "messages")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"messages[{i}]: role {m['role']!r} is not supported (system, user, assistant)",
                              "messages")
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for p in c:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(p["text"])
            c = "".join(parts)
        if not isinstance(c, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    return out


def completion_prompt(body: dict):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p  # token ids
    if isinstance(p, list) and len(p) > 1:
        raise bad_request("only one prompt per request is supported", "prompt")
    raise bad_request("'prompt' must be a string or a list of token ids", "prompt")


# --------------------------------------------------------------------------- responses


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, *, chat: bool, text: str, finish_reason: str,
                    usage: dict) -> dict:
    """A whole (non-streamed) `chat.completion` or `text_completion`."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage, "system_fingerprint": None}


def chunk(rid: str, created: int, model: str, *, chat: bool, delta: str | None, finish: str | None,
          role: bool = False, include_usage: bool = False) -> dict:
    """One streamed `chat.completion.chunk` or `text_completion` (with `"usage": None` if asked for)."""
    if chat:
        d: dict = {}
        if role:
            d["role"] = "assistant"
        if delta is not None:
            d["content"] = delta
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
           "system_fingerprint": None}
    if include_usage:
        out["usage"] = None
    return out
