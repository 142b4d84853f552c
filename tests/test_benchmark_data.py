"""The benchmarks' prompt sets ship with the repository, so a clone reproduces BENCHMARKS.md."""

import pytest

from benchmarks.common import eval_prompts


@pytest.mark.parametrize("name,count", [("gsm8k", 1319), ("humaneval", 164), ("mt-bench", 80)])
def test_prompt_sets_are_in_the_repository(name, count):
    prompts = eval_prompts(name, 10_000)
    assert len(prompts) == count
    assert all(isinstance(p, str) and p.strip() for p in prompts)


def test_unknown_prompt_set_names_the_available_ones():
    with pytest.raises(FileNotFoundError, match=r"available: \['gsm8k', 'humaneval', 'mt-bench'\]"):
        eval_prompts("mbpp", 3)
