"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) against HF transformers' own loading of
the same file: logits, tokenizer, chat template and greedy generation. Tests that compare with
HF skip without the `parity` extra (torch, transformers); the others always run.

Every generate() call here uses one set of static buckets (4 slots, cache 128, output 65),
so the decode loop compiles once for the whole module.
"""

import numpy as np
import pytest

import dspark_jax as ds

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

EOS = 2
MAX_NEW = 64
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "Give me three tips for staying healthy."}],
    [{"role": "user", "content": "Explain gravity to a child."}],
]
GREEDY = ds.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


def hf_chat_ids(hf_tok, chat) -> list[int]:
    out = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def greedy_run(smollm2):
    return ds.generate(smollm2, CHATS, sampling=GREEDY)


def test_logits_match_hf(smollm2, hf_smollm2):
    """Same dequantised weights on both sides, fp32; observed max abs difference ~1.4e-4."""
    chat = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List two prime numbers."},
        {"role": "assistant", "content": "2 and 3."},
        {"role": "user", "content": "And two more?"},
    ]
    ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(chat))
    ours = np.asarray(ds.logits(smollm2, ids))
    import torch

    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == ref.shape == (len(ids), 49152)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-3)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


TEXTS = [
    None,  # replaced by a rendered chat (special tokens inside the text)
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(30))  # 832040",
    "Ünïcödé: naïve café, 東京は日本の首都です, Привет мир, emoji 🤖👍🏽, math ∑∫√, ‘quotes’ — dash",
    "  leading spaces, trailing spaces   \n\n\n multiple\r\nnewlines and 1234567890 digits, 3.14159, 1e-5",
]


@pytest.mark.parametrize("i", range(len(TEXTS)), ids=["chat", "code", "unicode", "spaces-digits"])
def test_tokenizer_matches_hf(smollm2, hf_smollm2_tokenizer, i):
    text = TEXTS[i] or hf_smollm2_tokenizer.apply_chat_template(
        CHATS[1] + [{"role": "assistant", "content": "Sure:\n```python\ndef sq(x):\n    return x * x\n```"}],
        tokenize=False,
    )
    ours = smollm2.tokenizer.encode(text)
    assert ours == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "chat",
    [
        CHATS[0],  # no system message: the template inserts SmolLM2's default one
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}],
    ],
    ids=["default-system", "multi-turn"],
)
def test_chat_template_matches_hf(smollm2, hf_smollm2_tokenizer, chat):
    for gen_prompt in (True, False):
        ours = smollm2.tokenizer.apply_chat_template(chat, add_generation_prompt=gen_prompt)
        ref = hf_smollm2_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen_prompt)
        assert ours == ref


def test_greedy_generation_matches_hf(smollm2, hf_smollm2, hf_smollm2_tokenizer, greedy_run):
    """64 greedy tokens of 4 chats, token for token. HF runs one prompt at a time (no
    padding); both stop at EOS, which our token_ids exclude."""
    for chat, ours in zip(CHATS, greedy_run.token_ids):
        ids = hf_chat_ids(hf_smollm2_tokenizer, chat)
        assert ids == smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(chat))
        import torch

        with torch.no_grad():
            out = hf_smollm2.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=EOS,
            )
        ref = out[0, len(ids):].tolist()
        if EOS in ref:
            ref = ref[: ref.index(EOS)]
        assert ours == ref
    assert any(len(t) == MAX_NEW for t in greedy_run.token_ids)  # one runs to the limit
    assert any(len(t) < MAX_NEW for t in greedy_run.token_ids)  # one stops at EOS
    assert greedy_run.texts[0] == smollm2.tokenizer.decode(greedy_run.token_ids[0])


def test_warm_call_batch_composition_and_stop_strings(smollm2, greedy_run):
    """A second call with the same buckets but a different batch (reordered, one chat
    replaced, one request with stop strings) compiles nothing; each greedy request without
    stop strings produces what it did in the first batch; the request with a stop string that
    spans tokens mid-way through its output ends before it, in text and in token ids
    (dspark_jax/decoding/stop_strings.py)."""
    full_ids, full_text = greedy_run.token_ids[2], greedy_run.texts[2]
    stop = full_text[40:47]
    at = full_text.index(stop)
    assert at + len(stop) < len(full_text) - 20  # mid-way: generation has to stop early
    with_stop = ds.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop=("never-appears", stop))
    other = [{"role": "user", "content": "Name a famous painter."}]
    batch = [CHATS[3], CHATS[2], other, CHATS[0]]
    sampling = [GREEDY, with_stop, GREEDY, GREEDY]
    out = ds.generate(smollm2, batch, sampling=sampling)

    def shape_buckets(stats):  # the call's static buckets, without the slot buckets it compacted to
        return {k: v for k, v in stats["buckets"].items() if k != "slot_buckets"}

    assert shape_buckets(out.stats) == shape_buckets(greedy_run.stats)
    # Stop strings are checked on the host: the same programs. Requests finish at other times
    # than in the first batch, so the slots may compact into a bucket the first call never
    # ran; only such a bucket compiles, and once: the same call again compiles nothing.
    new_slots = set(out.stats["buckets"]["slot_buckets"]) - set(greedy_run.stats["buckets"]["slot_buckets"])
    assert out.stats["compiles"] == 0 or new_slots
    if out.stats["compiles"]:
        again = ds.generate(smollm2, batch, sampling=sampling)
        assert again.stats["compiles"] == 0 and again.token_ids == out.token_ids
    for j, i in [(0, 3), (3, 0)]:
        assert out.token_ids[j] == greedy_run.token_ids[i]
    assert out.token_ids[2] != greedy_run.token_ids[2]

    ids, text = out.token_ids[1], out.texts[1]
    assert text == full_text[:at]
    assert ids == full_ids[: len(ids)]
    tok = smollm2.tokenizer
    assert text.startswith(tok.decode(ids)) and stop not in tok.decode(ids)
    assert len(tok.decode(full_ids[: len(ids) + 1])) > at  # the next token reaches into the stop string
    assert out.stats["cycles"][1] < greedy_run.stats["cycles"][2]  # it really stopped early
