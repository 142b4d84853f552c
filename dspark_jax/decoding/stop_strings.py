"""Stop strings: where a request's output ends when its text contains one of them.

The contract (vLLM's default, `include_stop_str_in_output=False`): the output ends just
before the earliest occurrence of any stop string.
- `text` is the decoded output up to, and excluding, the stop string.
- `token_ids` are the generated tokens whose text lies entirely before the stop string,
  so `decode(token_ids) == text` whenever the stop string starts on a token boundary.
  When it starts inside a token (stop `"\\n\\n"` completed by a token `".\\n\\n"`), that token
  is not in `token_ids`; `text` still holds its characters before the stop string, and
  `decode(token_ids)` is then a proper prefix of `text`.
Stop *tokens* (EOS, `stop_token_ids`) follow the same rule: excluded from both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# A byte-level BPE prefix can end inside a UTF-8 character and decode to up to 3 replacement
# characters more than the finished text; past this slack no longer prefix can fit.
_PARTIAL_UTF8_SLACK = 4


def stop_string_cut(decode: Callable[[list[int]], str], ids: list[int], stops: Sequence[str]
                    ) -> tuple[list[int], str] | None:
    """(token_ids, text) cut at the earliest stop string, or None if the text holds none."""
    text = decode(ids)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return None
    before = text[: min(hits)]
    keep = 0
    for n in range(1, len(ids) + 1):
        prefix = decode(ids[:n])
        if before.startswith(prefix):
            keep = n
        elif len(prefix) > len(before) + _PARTIAL_UTF8_SLACK:
            break
    return ids[:keep], before
