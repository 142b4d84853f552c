"""`python -m serve.generate`: argument handling, checked without loading a model (the
library calls are replaced by recorders, so these tests take milliseconds)."""

import json

import pytest

import dspark_jax as ds
from dspark_jax.decoding.generate import GenerationOutput
from serve import generate as cli

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"


@pytest.fixture
def recorded(monkeypatch):
    """Replaces load_target / load_drafter / generate with recorders."""
    calls = {}

    class FakeTarget:
        name = "fake"

    def load_target(*a, **kw):
        calls["load_target"] = kw
        return FakeTarget()

    def generate(target, prompts, **kw):
        # The first call is the requested run; a second one is the autoregressive rerun that
        # measures the speedup (with a drafter), recorded separately.
        calls["n_generate"] = calls.get("n_generate", 0) + 1
        if "drafter" not in kw:
            calls["rerun_kw"] = kw
        else:
            calls["prompts"], calls["kw"] = prompts, kw
        stats = {"new_tokens": 1, "tokens_per_s": 1.0, "compile_s": 0.0, "policy": "ar", "seeds": [1] * len(prompts)}
        return GenerationOutput(["x"] * len(prompts), [[1]] * len(prompts), stats)

    def load_drafter(path, target):
        calls["drafter"] = path
        return object()

    monkeypatch.setattr(ds, "load_target", load_target)
    monkeypatch.setattr(ds, "load_drafter", load_drafter)
    monkeypatch.setattr(ds, "generate", generate)
    return calls


def test_help_shows_every_option_with_meaning_and_default(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for action in cli.build_parser()._actions:
        if action.dest == "help":
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert name in out, name
        assert action.help and len(action.help) > 10, name
    for opt, default in [("--max-new-tokens", "128"), ("--temperature", "1.0"), ("--top-p", "1.0"),
                         ("--model", "smollm2-135m")]:
        assert f"(default: {default})" in " ".join(out.split()), opt


def test_words_form_one_prompt(recorded):
    assert cli.main(["Write", "a", "haiku", "--temperature", "0", "--no-compile-cache"]) == 0
    assert recorded["prompts"] == [[{"role": "user", "content": "Write a haiku"}]]
    assert recorded["kw"]["sampling"].temperature == 0.0


def test_prompts_file_plain_and_jsonl(recorded, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\nsecond prompt\n")
    assert cli.main(["--prompts-file", str(f), "--raw", "--no-compile-cache"]) == 0
    assert recorded["prompts"] == ["first prompt", "second prompt"]
    j = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    j.write_text("\n".join(json.dumps(v) for v in ["a", {"turns": ["b", "later"]}, {"prompt": "c"}, chat]))
    assert cli.main(["--prompts-file", str(j), "--no-compile-cache"]) == 0
    assert recorded["prompts"] == [[{"role": "user", "content": s}] for s in "abc"] + [chat]


def test_prompts_file_errors(recorded, tmp_path, capsys):
    j = tmp_path / "p.jsonl"
    j.write_text('"ok"\n{broken\n')
    assert cli.main(["--prompts-file", str(j)]) == 2
    assert "p.jsonl:2 is not valid JSON" in capsys.readouterr().err
    assert cli.main(["--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "no prompts file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--prompts-file", str(j), "also", "words"])
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([])
    assert "no prompt" in capsys.readouterr().err


def test_num_draft_without_drafter_is_an_error(recorded, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["hello", "--no-drafter", "--num-draft", "3"])
    assert e.value.code == 2
    assert "--num-draft needs a drafter" in capsys.readouterr().err
    assert "load_target" not in recorded


def test_runs_repeat_both_measurements_and_weight_dtype_reaches_the_loader(recorded, monkeypatch, capsys):
    from dspark_jax.io import drafter_io

    monkeypatch.setattr(drafter_io, "inspect_drafter", lambda path: ("ours", {}))
    assert cli.main(["hi", "--drafter", "/", "--runs", "3", "--no-compile-cache", "--weight-dtype", "bfloat16"]) == 0
    assert recorded["n_generate"] == 6  # three speculative runs, three autoregressive reruns
    assert recorded["load_target"]["weight_dtype"] == "bfloat16"
    assert "run 3 of 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["hi", "--runs", "0"])
    assert e.value.code == 2 and "--runs must be at least 1" in capsys.readouterr().err


def test_bad_drafter_fails_before_the_target_loads(recorded, tmp_path, capsys):
    assert cli.main(["hello", "--drafter", str(tmp_path / "nope")]) == 2
    assert "no drafter directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["hello", "--drafter", str(tmp_path)]) == 2
    assert "config.json' is not valid JSON" in capsys.readouterr().err
    assert "load_target" not in recorded


def test_bad_sampling_value_is_an_error_message(recorded, capsys):
    assert cli.main(["hello", "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert "load_target" not in recorded


def test_default_drafter_is_the_shipped_one_and_no_drafter_turns_it_off(recorded, monkeypatch):
    from dspark_jax.io import drafter_io

    monkeypatch.setattr(drafter_io, "shipped_drafter_path", lambda name: "/")  # as if installed
    monkeypatch.setattr(drafter_io, "inspect_drafter", lambda path: ("ours", {}))
    assert cli.main(["hi", "--no-compile-cache"]) == 0
    assert recorded["drafter"] == "smollm2-135m-dspark"
    recorded.clear()
    assert cli.main(["hi", "--no-drafter", "--no-compile-cache"]) == 0
    assert "drafter" not in recorded and recorded["kw"]["drafter"] is None
    recorded.clear()
    assert cli.main(["hi", "--model", "some.gguf", "--no-compile-cache"]) == 0  # nothing shipped for it
    assert "drafter" not in recorded
