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


def test_interleaved_runs_round_robin_with_rotating_order():
    from benchmarks.common import interleaved, median, spread

    order = []
    times = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b"),
                         "c": lambda: order.append("c")}, repeats=3, warmup=1)
    assert order == list("abc") + list("abc") + list("bca") + list("cab")
    assert all(len(t) == 3 for t in times.values())
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert spread([0.001, 0.003, 0.002], 1e3) == "2.00 (1.00–3.00)"
