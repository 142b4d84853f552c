"""Step-rate profiling and the scheduled policies through `ds.generate` (greedy, exact).

- `profile_step_rates`: one entry per bucket, monotone (a bigger bucket timed faster is
  re-timed), cached on disk under the key of device / model / dtype / buckets;
  `reprofile=True` measures again.
- `policy="dspark"` (async and sync) and `"threshold"`: greedy output equals
  autoregressive decoding; the step-rate table is an argument (a new table compiles
  nothing); the table decides which compiled bucket runs (cheap big buckets → the largest,
  expensive ones → small); async skips the drafter when not drafting is faster, and
  stops trusting a drafter whose confidences overclaim; the compiled bucket switch copies no
  cache (its branches only read the caches).
Runtime: ~40 s on a shared 2-core CPU, mostly compiles (five bucket variants per loop).
"""

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import sharpen, window_tables

import dspark_jax as ds
from dspark_jax.decoding.decode_loop import GenState, LoopSettings, SchedArrays, decode_loop
from dspark_jax.decoding.profiling import StepRates, cpu_model, default_buckets, measure_step_rates, profile_step_rates
from dspark_jax.decoding.sampling import SamplingArrays
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import Drafter, OracleDrafter

K = 3
MAX_NEW = 12
PROMPT_LENS = [1, 3, 5, 7, 9, 11, 2, 12]
S = 8  # slots for 8 prompts
BUCKETS = default_buckets(S, K)  # (8, 16, 24, 32)


@pytest.fixture(scope="module")
def tiny():
    cfg = ds.ModelConfig.tiny(num_layers=1, tie_word_embeddings=False)
    target = sharpen(ds.Target.random(cfg, seed=0), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    dcfg = DrafterConfig.for_target(cfg, num_feature_layers=1, block_size=4, num_layers=1, markov_rank=8)
    drafter = Drafter.random(dcfg, seed=1)
    ar = ds.generate(target, prompts, sampling=greedy()).token_ids
    oracle = OracleDrafter.from_lists(ar, PROMPT_LENS, cfg.vocab_size, block_size=K)
    return dict(target=target, prompts=prompts, drafter=drafter, ar=ar, oracle=oracle)


def greedy():
    return ds.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=MAX_NEW)


def test_default_buckets():
    assert default_buckets(8, 3) == (8, 16, 24, 32)
    assert default_buckets(1, 2) == (1, 2, 3)  # fewer when S·K is small
    assert default_buckets(4, 7) == (4, 14, 23, 32)


@pytest.mark.slow
def test_profile_table_is_monotone_and_cached(tiny, tmp_path, monkeypatch):
    kw = dict(slots=S, num_draft=K, cache_len=128, repeats=3, cache_dir=str(tmp_path))
    table = profile_step_rates(tiny["target"], tiny["drafter"], **kw)
    assert table.buckets == BUCKETS and len(table.verify_s) == len(BUCKETS)
    assert np.all(np.diff(table.rates) <= 0) and np.all(table.rates > 0)
    assert table.draft_s > 0 and 0 < table.skip_rate < np.inf
    files = os.listdir(tmp_path)
    assert len(files) == 1
    key = json.load(open(tmp_path / files[0]))["key"]
    assert {"device", "model", "config", "dtype", "buckets", "slots"} <= set(key) and key["buckets"] == list(BUCKETS)
    # From the cache: the same numbers, nothing measured (a measurement would be different).
    monkeypatch.setattr("dspark_jax.decoding.profiling.measure_step_rates", None)
    assert profile_step_rates(tiny["target"], tiny["drafter"], **kw) == table
    # A table priced on one CPU does not price another (JAX's device kind alone is "cpu"):
    # the key names the model and vector extensions, so another machine measures its own.
    assert jax.devices()[0].platform != "cpu" or cpu_model() in key["device"]
    monkeypatch.setattr("dspark_jax.decoding.profiling.cpu_model", lambda: "Another CPU (avx2)")
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(TypeError):  # no table for that machine: it would be measured (None here)
            profile_step_rates(tiny["target"], tiny["drafter"], **kw)
    monkeypatch.undo()
    again = profile_step_rates(tiny["target"], tiny["drafter"], reprofile=True, **kw)
    assert again.buckets == table.buckets and again != table
    other = profile_step_rates(tiny["target"], tiny["drafter"], buckets=(8, 32), **kw)
    assert other.buckets == (8, 32) and len(os.listdir(tmp_path)) == 2
    with pytest.raises(ValueError, match="strictly increasing"):
        profile_step_rates(tiny["target"], tiny["drafter"], buckets=(8, 40), **kw)
    # The greedy cycle (no draft distributions, argmax verification) is its own table.
    g = profile_step_rates(tiny["target"], tiny["drafter"], greedy=True, **kw)
    assert g.buckets == BUCKETS and g.key["sampling"] == "greedy" and "sampling" not in table.key
    assert len(os.listdir(tmp_path)) == 3


def test_a_bucket_timed_faster_than_a_smaller_one_is_re_timed(tiny, monkeypatch):
    """Noise that makes a bigger bucket look faster is measured again (twice the repeats),
    not papered over by raising it to the smaller one's time (which under-priced it)."""
    calls = []

    def fake_median_times(fns, repeats, warmup=2):
        calls.append((len(fns), repeats))
        if len(calls) == 1:  # draft, one-token step, buckets 8..32; short calls then long ones
            per_step = [0.01, 0.02, 0.03, 0.05, 0.04, 0.06]  # bucket 24 "faster" than 16
        else:  # the re-timed pair (16, 24)
            per_step = [0.05, 0.07]
        return [0.01] * len(per_step) + [0.01 + 2 * v for v in per_step]  # long call: 2 more steps

    monkeypatch.setattr("dspark_jax.decoding.profiling._median_times", fake_median_times)
    t = measure_step_rates(tiny["target"], tiny["drafter"], slots=S, num_draft=K, cache_len=128, buckets=BUCKETS,
                           repeats=3)
    assert calls == [(12, 3), (4, 6)]
    assert t.draft_s == pytest.approx(0.01) and t.ar_s == pytest.approx(0.02)
    assert np.allclose(t.verify_s, [0.03, 0.05, 0.07, 0.07])  # re-timed, then monotone


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(policy="dspark"), dict(policy="dspark", scheduler="sync"),
                                dict(policy="threshold", threshold=0.3)], ids=["async", "sync", "threshold"])
def test_greedy_scheduled_equals_autoregressive(tiny, kw, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SPS_CACHE", str(tmp_path))  # profiled on first use, cached here
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=tiny["drafter"], sampling=greedy(), num_draft=K,
                      **kw)
    assert out.token_ids == tiny["ar"]
    st = out.stats
    assert len(st["verified_per_request"]) == len(PROMPT_LENS) and len(st["mean_verified"]) == len(PROMPT_LENS)
    assert S <= st["budget_per_step"] <= st["bucket_per_step"] <= S * (K + 1)
    if kw["policy"] == "dspark":
        assert len(os.listdir(tmp_path)) == 1 and st["step_rates"]["buckets"] == list(BUCKETS)
        assert st["step_rates"]["key"]["sampling"] == "greedy"  # every request greedy: the greedy cycle's table


@pytest.mark.slow
def test_the_table_is_an_argument_and_decides_the_bucket(tiny):
    t, prompts, oracle = tiny["target"], tiny["prompts"], tiny["oracle"]

    def run(rates):
        return ds.generate(t, prompts, drafter=oracle, sampling=greedy(), num_draft=K, policy="dspark",
                           scheduler="sync", step_rates=dict(zip(BUCKETS, rates)))

    cheap = run([1.0, 0.99, 0.98, 0.97])  # big buckets almost free: verify every draft
    assert cheap.token_ids == tiny["ar"]
    assert cheap.stats["acceptance_per_position"] == [1.0] * K
    assert cheap.stats["tau"] > 3.0
    dear = run([1.0, 0.3, 0.2, 0.1])  # one extra token per slot never pays
    assert dear.token_ids == tiny["ar"] and dear.stats["compiles"] == 0  # same program
    assert dear.stats["bucket_per_step"] == S and dear.stats["tau"] == 1.0
    mid = run([1.0, 0.7, 0.35, 0.2])  # (8 + 8)·0.7 > 8 but (8 + 16)·0.35 < 11.2: the 16 bucket
    assert mid.token_ids == tiny["ar"] and mid.stats["compiles"] == 0
    # 11 tokens after the prefill's: five cycles of 2 at bucket 16, the last (one token left,
    # nothing to verify) at bucket 8.
    assert mid.stats["bucket_per_step"] == pytest.approx((5 * 16 + 8) / 6) and mid.stats["tau"] == 11 / 6


@pytest.mark.slow  # compiles several programs (tests/conftest.py, test tiers)
def test_async_skips_a_drafter_that_does_not_pay(tiny):
    # The drafter costs 10x a target step: verifying anchors without drafting wins even if
    # every draft were accepted, so the drafter never runs.
    table = StepRates(S, BUCKETS, draft_s=1.0, verify_s=(0.1, 0.11, 0.12, 0.13), ar_s=0.1)
    out = ds.generate(tiny["target"], tiny["prompts"], drafter=tiny["drafter"], sampling=greedy(), num_draft=K,
                      policy="dspark", step_rates=table)
    assert out.token_ids == tiny["ar"]
    assert out.stats["drafted_steps"] == 0 and out.stats["verified_per_request"] == [0] * S
    assert out.stats["bucket_per_step"] == S


@pytest.mark.slow
def test_async_starts_from_the_drafters_measured_acceptance(tiny):
    """Without a prior, every request's scheduler starts optimistic (confidence 1) and the first
    cycle drafts; a drafter whose calibration measured low acceptance does not draft where that
    cannot pay. Verifying costs 3x an anchor-only step here: 8 slots x 4 tokens at confidence 1
    beat 8 anchors, 8 x (1 + 0.05 + ...) do not. Both outputs are the target's."""
    table = StepRates(S, BUCKETS, draft_s=0.01, verify_s=(0.1, 0.3, 0.3, 0.3), ar_s=0.1)
    d = tiny["drafter"]
    low = Drafter(d.cfg.replace(acceptance_prior=(0.05,) * 4, acceptance_prior_greedy=(0.05,) * 4), d.graphdef,
                  d.state)
    outs = {name: ds.generate(tiny["target"], tiny["prompts"], drafter=x, sampling=greedy(), num_draft=K,
                              policy="dspark", step_rates=table) for name, x in (("optimistic", d), ("prior", low))}
    for out in outs.values():
        assert out.token_ids == tiny["ar"]
    assert outs["optimistic"].stats["drafted_steps"] > 0
    assert outs["prior"].stats["drafted_steps"] == 0 and outs["prior"].stats["bucket_per_step"] == S


@dataclasses.dataclass(frozen=True)
class Overclaiming(OracleDrafter):
    """Fixed continuations with confidence 0.6 at every position (a distinct class: it never
    shares a compiled program with a plain oracle)."""

    def draft(self, params, cache, target, anchor_S, anchor_pos_S, keys_S, sa):
        tok, logits, conf = super().draft(params, cache, target, anchor_S, anchor_pos_S, keys_S, sa)
        return tok, logits, 0.6 * conf


@pytest.mark.slow
def test_async_calibrates_a_drafter_that_overclaims(tiny):
    """A drafter that claims 60% per draft and is always wrong: drafting would pay if it were
    right, so async tries, learns from the rejections and stops drafting."""
    t, V = tiny["target"], tiny["target"].cfg.vocab_size
    conts = [[(x + 1) % V for x in a] for a in tiny["ar"]]
    wrong = Overclaiming.from_lists(conts, PROMPT_LENS, V, block_size=K)
    table = StepRates(S, BUCKETS, draft_s=0.02, verify_s=(0.1, 0.105, 0.11, 0.115), ar_s=0.1)
    out = ds.generate(t, tiny["prompts"], drafter=wrong, sampling=greedy(), num_draft=K, policy="dspark",
                      step_rates=table)
    assert out.token_ids == tiny["ar"] and out.stats["tau"] == 1.0
    # Two failed tries (11 cycles): after them the calibrated first-position confidence is
    # 0.3 / 2.5 = 0.12, and 8 anchors alone at 10 steps/s beat (8 + 8·0.24)·7.4.
    assert out.stats["drafted_steps"] == 2 / 11
    # The calibration tally says so: nothing accepted of what the steps' confidences expected
    # (survival 0.6, 0.36, 0.216 for every slot's 3 drafts, twice) nor of the budget's (its
    # first try starts from confidence 1, a drafter without a measured prior: every draft).
    cal = out.stats["calibration"]
    assert cal["drafter"]["accepted"] == 0
    assert cal["drafter"]["conf_exp"] == pytest.approx(2 * S * (0.6 + 0.36 + 0.216))
    assert cal["drafter"]["budget_exp"] > S * K
    assert cal["foreseen"] == {"accepted": 0.0, "budget_exp": 0.0, "conf_exp": 0.0}  # no foresight
    right = Overclaiming.from_lists(tiny["ar"], PROMPT_LENS, V, block_size=K)
    out = ds.generate(t, tiny["prompts"], drafter=right, sampling=greedy(), num_draft=K, policy="dspark",
                      step_rates=table)
    assert out.token_ids == tiny["ar"] and out.stats["drafted_steps"] == 1.0 and out.stats["tau"] > 2
    # Every verified draft is accepted; the step claims 60% a position, and the budget, which
    # learns each position's acceptance online, expects more than that and never more than all.
    cal = out.stats["calibration"]["drafter"]
    assert cal["accepted"] == sum(out.stats["verified_per_request"]) > 0
    assert cal["conf_exp"] < cal["budget_exp"] <= cal["accepted"]


def test_errors(tiny):
    t, prompts = tiny["target"], tiny["prompts"]
    with pytest.raises(ValueError, match="needs a drafter"):
        ds.generate(t, prompts, policy="dspark")
    with pytest.raises(ValueError, match="scheduler must be one of"):
        ds.generate(t, prompts, drafter=tiny["drafter"], policy="dspark", scheduler="greedy")
    with pytest.raises(ValueError, match="threshold must be"):
        ds.generate(t, prompts, drafter=tiny["drafter"], policy="threshold", threshold=2.0)
    with pytest.raises(ValueError, match="need one of at least 8"):
        ds.generate(t, prompts, drafter=tiny["drafter"], policy="dspark", step_rates={4: 1.0}, num_draft=K)


def _copied_shapes(hlo: str) -> set[str]:
    """Shapes of the whole-buffer copies in an optimized HLO module's text."""
    return set(re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(", hlo))


def _hlo_shape(x) -> str:
    return f"{jnp.dtype(x.dtype).name.replace('float', 'f')}[{','.join(map(str, x.shape))}]"


def test_the_bucket_switch_never_copies_the_caches(tiny):
    """XLA copies a buffer whole when a `lax.switch` branch updates it — every step, for the
    KV caches of the scheduled policies' bucket switch (measured on SmolLM2: two copies of the
    whole target cache per step). The branches therefore only read the caches and the step's
    writes land after the switch: the compiled loop holds no copy of any cache buffer. The
    control (a switch whose branches write a buffer) shows the probe sees such copies."""
    target, drafter = tiny["target"], tiny["drafter"]
    st = GenState.create(target.cfg, drafter, drafter.params, slots=S, cache_len=64, out_len=32, num_draft=K,
                         active=np.ones(S, bool), max_new=np.full(S, MAX_NEW))
    sa = SamplingArrays.from_params([greedy()] * S)
    sched = SchedArrays.make(np.linspace(4.0, 1.0, len(BUCKETS)), 5.0)
    settings = LoopSettings(num_draft=K, policy="async", buckets=BUCKETS)  # sync / threshold: the same switch
    hlo = decode_loop.lower(target.graphdef, target.state, drafter, drafter.params, st, sa, jnp.int32(4), sched,
                            settings=settings).compile().as_text()
    caches = {_hlo_shape(x) for x in jax.tree.leaves((st.cache, st.dcache))}
    assert caches and not caches & _copied_shapes(hlo), caches & _copied_shapes(hlo)

    buf = jnp.zeros((8, 2, 16, 64))

    @functools.partial(jax.jit, donate_argnums=0)
    def control(x, i):
        return jax.lax.switch(i, [lambda: x.at[0, 0, 0, i].set(1.0), lambda: x.at[1, 0, 0, i].set(2.0)])

    assert _hlo_shape(buf) in _copied_shapes(control.lower(buf, jnp.int32(0)).compile().as_text())


def test_a_table_between_two_cache_lengths_is_linear():
    lo = StepRates(2, (2, 4), 0.010, (0.020, 0.030), ar_s=0.015, key={"cache_len": 256})
    hi = StepRates(2, (2, 4), 0.014, (0.040, 0.050), ar_s=0.035, key={"cache_len": 1024})
    mid = StepRates.between(lo, hi, 256, 1024, 512)  # a third of the way
    assert mid.draft_s == pytest.approx(0.010 + 0.004 / 3) and mid.ar_s == pytest.approx(0.015 + 0.020 / 3)
    assert mid.verify_s == pytest.approx((0.020 + 0.020 / 3, 0.030 + 0.020 / 3))
    assert mid.key == {"cache_len": 512, "interpolated": [256, 1024]}
    assert StepRates.between(lo, hi, 256, 1024, 1024).verify_s == pytest.approx(hi.verify_s)
    with pytest.raises(ValueError, match="one slot count and bucket list"):
        StepRates.between(lo, dataclasses.replace(hi, buckets=(2, 3)), 256, 1024, 512)


def test_window_tables_are_measured_at_the_ends_only(tiny, tmp_path, monkeypatch):
    from dspark_jax.decoding.profiling import profile_window_rates

    measured = window_tables(monkeypatch, tmp_path, cheap_at=2048)
    tables = profile_window_rates(tiny["target"], tiny["drafter"], slots=2, num_draft=K,
                                  lengths=[512, 256, 1024, 2048])
    assert sorted(measured) == [256, 2048] and sorted(tables) == [256, 512, 1024, 2048]
    assert [tables[t].ar_s for t in sorted(tables)] == pytest.approx([1, 2, 4, 8])  # linear in the length
    assert tables[1024].key["interpolated"] == [256, 2048]
    profile_window_rates(tiny["target"], tiny["drafter"], slots=2, num_draft=K, lengths=[256, 2048])
    assert len(measured) == 2  # cached on disk


@pytest.mark.slow
def test_each_window_schedules_with_its_own_table(tiny, tmp_path, monkeypatch):
    """A request whose context crosses from the 256-position window into the 512 cache: the
    loop schedules each window with that window's table (here: no draft pays below 512,
    every draft pays from it), and the output stays autoregressive greedy decoding."""
    import dspark_jax.decoding.generate as gen

    measured = window_tables(monkeypatch, tmp_path)
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, tiny["target"].cfg.vocab_size, 230).tolist()
    sp = dataclasses.replace(greedy(), max_new_tokens=48)
    ar = ds.generate(tiny["target"], [prompt], sampling=sp).token_ids
    oracle = OracleDrafter.from_lists(ar, [len(prompt)], tiny["target"].cfg.vocab_size, block_size=K)
    calls, loop = [], gen.decode_loop

    def spy(*args, settings):
        paid0, steps0 = int(args[4].bucket_sum), int(args[4].steps)  # before the loop donates the state
        st = loop(*args, settings=settings)
        calls.append((settings.kv_window, float(args[7].skip_rate), int(st.bucket_sum) - paid0,
                      int(st.steps) - steps0))
        return st

    monkeypatch.setattr(gen, "decode_loop", spy)
    out = ds.generate(tiny["target"], [prompt], drafter=oracle, sampling=sp, num_draft=K, policy="dspark",
                      scheduler="sync")
    assert out.token_ids == ar
    assert sorted(measured) == [256, 512] and sorted(out.stats["window_step_rates"]) == [256, 512]
    assert [c[0] for c in calls] == [256, None]  # one call per window
    (_, skip_256, paid_256, steps_256), (_, skip_512, paid_512, steps_512) = calls
    assert skip_256 == pytest.approx(1.0) and skip_512 == pytest.approx(0.5)  # 1 / ar_s of each length
    assert paid_256 == steps_256 > 0  # the anchor only: bucket 1 every step
    assert paid_512 > steps_512 > 0  # drafts verified


def test_narrow_widths():
    from dspark_jax.decoding.profiling import narrow_widths

    assert narrow_widths(8, 3, BUCKETS) == (2, 3, 4, 4)  # (8, 16, 24, 32): 0 / 1 / 2 drafts a slot evenly
    assert narrow_widths(8, 7, (8, 27, 46, 64)) == (2, 5, 7, 8)
    assert narrow_widths(1, 7, (1, 4, 6, 8)) == (2, 5, 7, 8)
    with pytest.raises(ValueError, match="non-decreasing query width"):
        LoopSettings(num_draft=K, policy="async", buckets=BUCKETS, bucket_widths=(2, 3, 4, 3))
    with pytest.raises(ValueError, match="the largest 4"):
        LoopSettings(num_draft=K, policy="async", buckets=BUCKETS, bucket_widths=(2, 3, 3, 3))
    with pytest.raises(ValueError, match="bucket_widths must be 'narrow' or 'full'"):
        ds.DecodeConfig(bucket_widths="wide")
    t = StepRates(S, BUCKETS, 0.01, (0.1, 0.2, 0.3, 0.4), 0.09, widths=(2, 3, 4, 4))
    assert StepRates.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert StepRates.between(t, t, 128, 256, 192).widths == t.widths


@pytest.mark.slow
def test_narrow_bucket_grids_verify_fewer_drafts_a_slot_and_stay_lossless(tiny):
    # The oracle's drafts are all accepted. Rates of the buckets 8 / 16 / 24 / 32: with full
    # grids the budget's best is bucket 24 (two drafts a slot: (8 + 16) · 0.85 = 20.4); with
    # widths 2 / 2 / 2 / 4 it admits one draft a slot below bucket 32, and bucket 16 wins.
    table = StepRates(S, BUCKETS, 0.0, (1 / 1.0, 1 / 0.9, 1 / 0.85, 1 / 0.3), 1.0, widths=(2, 2, 2, 4))
    config = ds.DecodeConfig(policy="dspark", num_draft=K, makespan=False)

    def run(t):
        out = ds.generate(tiny["target"], tiny["prompts"], drafter=tiny["oracle"], sampling=greedy(), config=config,
                          step_rates=t)
        assert out.token_ids == tiny["ar"]
        return out.stats

    narrow, full = run(table), run(dataclasses.replace(table, widths=None))
    assert 0 < max(narrow["mean_verified"]) <= 1.0 and narrow["bucket_per_step"] <= 16
    assert max(full["mean_verified"]) > 1.5 and full["bucket_per_step"] > 16
