"""Stop strings (vLLM's contract): text and token_ids both end before the stop string."""

import pytest

import dspark_jax as ds
from dspark_jax.decoding.stop_strings import stop_string_cut

# Every token decodes to two characters, so a stop string starting at an odd offset begins
# inside a token and one at an even offset on a token boundary.
VOCAB = [chr(65 + i // 26) + chr(97 + i % 26) for i in range(128)]


class TwoCharTokenizer:
    eos_token_ids = (2,)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids)


def test_cut_on_a_token_boundary():
    dec = TwoCharTokenizer().decode
    ids = [3, 4, 5, 6, 7]
    text = dec(ids)  # "AdAeAfAgAh"
    assert stop_string_cut(dec, ids, ["AfAg"]) == ([3, 4], "AdAe")
    assert stop_string_cut(dec, ids, ["zz"]) is None
    # The earliest of several stop strings wins, whatever their order in the list.
    assert stop_string_cut(dec, ids, ["Ah", "eA"]) == ([3], text[:3])


def test_cut_inside_a_token():
    dec = TwoCharTokenizer().decode
    ids = [3, 4, 5, 6, 7]
    kept, text = stop_string_cut(dec, ids, ["fAg"])  # starts inside token 5 ("Af")
    assert text == "AdAeA"  # vLLM's text: everything before the stop string
    assert kept == [3, 4]  # the token holding its start is not kept
    assert text.startswith(dec(kept)) and "fAg" not in dec(kept)
    # A stop string at the very start leaves nothing.
    assert stop_string_cut(dec, ids, ["Ad"]) == ([], "")


@pytest.mark.parametrize("offset", [10, 11])  # on a token boundary, inside a token
def test_generate_follows_the_contract(tiny_target, offset):
    target = tiny_target("llama", seed=4)
    target.tokenizer = TwoCharTokenizer()
    greedy = ds.SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    full = ds.generate(target, [[5, 9, 13]], sampling=greedy)
    full_ids, full_text = full.token_ids[0], full.texts[0]
    stop = full_text[offset : offset + 5]
    at = full_text.index(stop)
    out = ds.generate(target, [[5, 9, 13]], sampling=ds.SamplingParams(
        temperature=0.0, max_new_tokens=24, ignore_eos=True, stop=(stop,)))
    ids, text = out.token_ids[0], out.texts[0]
    assert text == full_text[:at]
    assert ids == full_ids[: at // 2]
    assert (target.tokenizer.decode(ids) == text) == (at % 2 == 0)
