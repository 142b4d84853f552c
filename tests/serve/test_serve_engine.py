"""The continuous-batching engine (`serve/engine.py`), exact checks on a tiny target.

- 52 requests arriving over time (39 greedy, 13 sampled with top-k / top-p / min-p /
  temperature), streamed, with different prompt lengths and budgets: every greedy output
  equals autoregressive greedy decoding of its prompt, the streamed pieces add up to the
  output, and a second wave of 52 with another mix of sampling parameters compiles nothing.
- Prompts longer than the admission buffer are prefilled in chunks over several steps.
- Profiled by the engine: the greedy cycle's table while every running request is at T = 0,
  also once a sampled request has left (its settings do not stay on its free slot).
- A cancelled request frees its slot for the next queued one, keeps what it had streamed
  (a prefix of its greedy output), and the others are unaffected.
Runtime: ~40 s on a shared 2-core CPU (admission + decode-loop compiles).
"""

import jax
import numpy as np
import pytest
from spec_helpers import sharpen, window_tables

import dspark_jax as ds
from dspark_jax.decoding import compile_stats
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import Drafter
from serve.engine import Engine

MAX_NEW = 16
N_GREEDY = 39  # + one sampled request after every third: 52 requests per wave


@pytest.fixture(scope="module")
def tiny():
    cfg = ds.ModelConfig.tiny(num_layers=1, tie_word_embeddings=False)
    target = sharpen(ds.Target.random(cfg, seed=0), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 20, N_GREEDY)]
    budgets = [int(m) for m in rng.integers(1, MAX_NEW + 1, N_GREEDY)]
    dcfg = DrafterConfig.for_target(cfg, num_feature_layers=1, block_size=4, num_layers=1, markov_rank=8)
    drafter = Drafter.random(dcfg, seed=1)
    ar = ds.generate(target, prompts, sampling=[greedy(m) for m in budgets]).token_ids
    return dict(target=target, prompts=prompts, budgets=budgets, drafter=drafter, ar=ar)


def greedy(m=MAX_NEW):
    return ds.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=m)


def sampled(i, m=MAX_NEW):
    kinds = [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1), dict(temperature=0.7)]
    return ds.SamplingParams(seed=i, ignore_eos=True, max_new_tokens=m, **kinds[i % 4])


def engine(tiny, **kw):
    kw.setdefault("policy", "dspark")
    # 16 prompt tokens per step: prompts of up to 19 tokens arrive, so some are prefilled in
    # two chunks, and several prefilling slots share one step's admission buffer.
    return Engine(tiny["target"], tiny["drafter"], slots=4, max_len=128, max_new_tokens=MAX_NEW, prefill_tokens=16,
                  num_draft=3, cycles_per_step=2, step_rates={4: 1.0, 8: 0.9, 12: 0.8, 16: 0.7}, **kw)


@pytest.mark.slow
def test_arrivals_over_time_match_autoregressive(tiny):
    eng = engine(tiny)
    streamed = {}

    def on_token(req, toks):
        streamed.setdefault(req.id, []).extend(toks)

    def wave(offset):
        """The greedy requests arriving in groups of three, with a sampled request after each group."""
        reqs = []
        for i, (p, m) in enumerate(zip(tiny["prompts"], tiny["budgets"])):
            reqs.append(eng.submit(p, greedy(m), on_token=on_token))
            if i % 3 == 2:
                eng.submit(tiny["prompts"][i], sampled(offset + i), on_token=on_token)
                eng.step()  # the next group arrives while these decode
        eng.run()
        return reqs

    assert max(map(len, tiny["prompts"])) > 16  # some prompts need two admission chunks
    reqs = wave(0)
    assert [r.tokens for r in reqs] == tiny["ar"]
    assert all(streamed[r.id] == r.tokens for r in eng.finished)
    assert all(r.finish_reason == "length" for r in eng.finished)
    sampled_reqs = [r for r in eng.finished if r not in reqs]
    n_sampled = N_GREEDY // 3
    assert len(sampled_reqs) == n_sampled and all(len(r.tokens) == MAX_NEW for r in sampled_reqs)
    st = eng.stats()
    assert st["requests_finished"] == N_GREEDY + n_sampled == 52
    assert st["tokens_out"] == sum(map(len, tiny["ar"])) + n_sampled * MAX_NEW
    # Warm: another wave, another mix of sampling parameters — nothing compiles.
    c0, _ = compile_stats.snapshot()
    assert [r.tokens for r in wave(1)] == tiny["ar"]
    assert compile_stats.snapshot()[0] == c0


@pytest.mark.parametrize("fine", [False, True])
def test_warm_cache_moves_compile_nothing_later(tiny, fine):
    """The cache moves between windows (grown for a long context, cut when it is gone) and
    between slot buckets (grown for arrivals, compacted as requests leave) are programs of
    their own; the server's warm-up compiles them all, on the live state."""
    eng = Engine(tiny["target"], None, slots=2, max_len=512, max_new_tokens=MAX_NEW,
                 config=ds.DecodeConfig(policy="ar", fine_windows=fine))
    lengths = sorted({*eng.windows, eng.T})
    assert lengths == ([256, 384, 512] if fine else [256, 512]) and eng.st.cache.length == lengths[0]
    assert eng.slot_buckets == [1, 2] and eng.n_slots == 1
    eng.compile_cache_moves()
    assert eng.st.cache.length == lengths[0] and eng.n_slots == 1  # back where it started
    c0, _ = compile_stats.snapshot()
    for n in (2, 1):
        for a in lengths:
            eng.st = eng.st.replace(cache=eng.st.cache.resized(a))
            eng._resize_slots(3 - n)
            eng._resize_slots(n)
            for b in lengths:
                jax.block_until_ready(eng.st.cache.resized(a).resized(b))
    assert compile_stats.snapshot()[0] == c0


@pytest.mark.parametrize("policy", ["ar", "fixed"])
def test_a_step_ends_when_a_request_finishes(tiny, policy):
    """With `stop_on_finish` (the default) a step ends after the cycle in which a request
    finished, so its slot is refilled by the next step; without it the other slots run on for
    the step's remaining cycles. Outputs are the same either way."""
    p = [q for q in tiny["prompts"] if len(q) <= 16][:2]  # each prefilled in one chunk
    ar = ds.generate(tiny["target"], p, sampling=[greedy(2), greedy(MAX_NEW)]).token_ids
    for stop in (True, False):
        eng = Engine(tiny["target"], tiny["drafter"] if policy != "ar" else None, slots=4, max_len=128,
                     max_new_tokens=MAX_NEW, prefill_tokens=32, num_draft=3, cycles_per_step=8, policy=policy,
                     stop_on_finish=stop)
        short, other = eng.submit(p[0], greedy(2)), eng.submit(p[1], greedy(MAX_NEW))
        eng.step()  # prefill (the first token) and decode cycles
        assert short.status == "finished" and short.tokens == ar[0]
        if stop:  # the cycle that emitted short's 2nd token ended the step
            assert len(other.tokens) <= 1 + (1 if policy == "ar" else 4)
        else:
            assert len(other.tokens) >= 1 + 8
        eng.run()
        assert other.tokens == ar[1]


@pytest.mark.slow
def test_cancel_frees_the_slot(tiny):
    eng = engine(tiny, policy="fixed")
    p = tiny["prompts"]
    reqs = [eng.submit(p[i], greedy()) for i in range(5)]  # 4 slots: the 5th waits
    while not reqs[1].tokens:  # prefilled (16 prompt tokens per step) and decoding
        eng.step()
    assert reqs[4].status == "queued" and len(eng.running) == 4
    eng.cancel(reqs[1])
    slot = reqs[1].slot
    eng.step()
    assert reqs[4].status in ("prefilling", "running") and reqs[4].slot == slot
    eng.run()
    ar = ds.generate(tiny["target"], p[:5], sampling=greedy()).token_ids
    assert reqs[1].finish_reason == "cancelled" and reqs[1].tokens == ar[1][: len(reqs[1].tokens)]
    assert 0 < len(reqs[1].tokens) < MAX_NEW
    assert [r.tokens for i, r in enumerate(reqs) if i != 1] == [a for i, a in enumerate(ar) if i != 1]
    queued = eng.submit(p[5], greedy())
    eng.cancel(queued)
    assert queued.status == "cancelled" and eng.idle


@pytest.mark.slow
def test_greedy_batches_schedule_with_the_greedy_table(tiny, tmp_path, monkeypatch):
    """Profiled by the engine: two tables (sampled cycle, greedy cycle); a step whose running
    requests are all at T = 0 schedules with the greedy one, a mixed step with the sampled one."""
    import serve.engine as engine_mod

    monkeypatch.setenv("DSPARK_SPS_CACHE", str(tmp_path))
    # All 4 slots always (min_slots): one slot bucket's two tables, measured for real.
    eng = Engine(tiny["target"], tiny["drafter"], slots=4, max_len=128, max_new_tokens=MAX_NEW, prefill_tokens=16,
                 num_draft=3, cycles_per_step=2, policy="dspark", min_slots=4)
    assert eng.greedy_step_rates.key["sampling"] == "greedy" and "sampling" not in eng.step_rates.key
    assert len(list(tmp_path.iterdir())) == 2
    used, loop = [], engine_mod.decode_loop

    def spy(*args, **kw):
        # The table's arrays (with pooled calibration the engine replaces the trust per step).
        used.append(any(args[7].rates is a.rates for a in eng.greedy_sched.arrays.values()))
        return loop(*args, **kw)

    monkeypatch.setattr(engine_mod, "decode_loop", spy)
    p = tiny["prompts"]
    reqs = [eng.submit(p[i], greedy()) for i in range(3)]
    eng.run()
    assert used and all(used)
    assert [r.tokens for r in reqs] == ds.generate(tiny["target"], p[:3], sampling=greedy()).token_ids
    used.clear()
    eng.submit(p[0], greedy())
    eng.submit(p[1], sampled(1))
    eng.run()
    # From the step the sampled request is admitted on, the sampled cycle's table.
    assert used and not used[-1]
    # Once it is gone, greedy traffic is back on the greedy table although no request has
    # taken its slot yet (this one goes to slot 0; the sampled request ran in slot 1).
    used.clear()
    eng.submit(p[2], greedy())
    eng.run()
    assert used and all(used)


@pytest.mark.slow
def test_each_cache_length_schedules_with_its_own_table(tiny, tmp_path, monkeypatch):
    """Profiled by the engine per cache length it decodes at (the 256 window and the 512
    cache) and per slot bucket (1 and 2): each step schedules with the table of the cache's
    current length and the state's slot count."""
    import serve.engine as engine_mod
    measured = window_tables(monkeypatch, tmp_path)
    eng = Engine(tiny["target"], tiny["drafter"], slots=2, max_len=512, max_new_tokens=48, prefill_tokens=256,
                 num_draft=3, cycles_per_step=4, policy="dspark")
    # Greedy and sampled cycles, at both ends, for 1 and 2 slots.
    assert eng.slot_buckets == [1, 2] and sorted(measured) == [256] * 4 + [512] * 4
    assert [eng.loops[b].sched.table(512).slots for b in (1, 2)] == [1, 2]
    seen, loop = [], engine_mod.decode_loop

    def spy(*args, **kw):
        st, sched = args[4], args[7]
        n = st.seq_len.shape[0]
        assert any(sched.rates is a.rates for a in eng.loops[n].greedy_sched.arrays.values())  # its slots' table
        seen.append((st.cache.length, float(sched.skip_rate)))
        return loop(*args, **kw)

    monkeypatch.setattr(engine_mod, "decode_loop", spy)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, tiny["target"].cfg.vocab_size, n).tolist() for n in (230, 120)]
    k0 = eng.counters()
    reqs = [eng.submit(p, greedy(48)) for p in prompts]
    eng.run()
    assert {n for n, _ in seen} == {256, 512}
    assert all(skip == pytest.approx(256 / n) for n, skip in seen)  # 1 / ar_s of that length's table
    k = eng.counters()  # the loop's totals: every step paid for at least what it used
    assert k["steps"] > 0 and 0 <= k["drafted_steps"] <= k["steps"]
    assert 1 <= k["budget_tokens"] / k["steps"] <= k["bucket_tokens"] / k["steps"] <= 2 * 4
    # The drafts accepted, as the requests' own records count them (Σ (τ − 1) · cycles), against
    # the survival expected of them; a drafter without foresight has no foreseen rows.
    accepted = sum(round((r.stats["tau"] - 1) * r.stats["cycles"]) for r in reqs)
    assert k["accepted"][0] - k0["accepted"][0] == accepted
    assert k["budget_exp"][0] > k0["budget_exp"][0] and k["conf_exp"][0] > k0["conf_exp"][0]
    assert k["accepted"][1] == k["budget_exp"][1] == k["conf_exp"][1] == 0
    assert [r.tokens for r in reqs] == ds.generate(tiny["target"], prompts, sampling=greedy(48)).token_ids


def test_warm_up_runs_every_verification_bucket(tiny):
    """The bucket a scheduled step runs is a branch of the compiled loop that XLA:CPU first
    pays for when it executes; the server's warm-up forces each bucket in turn (greedy and
    sampled) so that no client pays. Each forced bucket pays more packed tokens per cycle than
    the one before, and the engine serves the target's tokens afterwards."""
    eng = engine(tiny)
    paid = eng.warm_buckets([1])
    # A caller's step-rate table is for all 4 slots: the state never shrinks below them.
    assert eng.slot_buckets == [4]
    assert set(paid) == {(4, t, b) for t in (0.0, 0.7) for b in (4, 8, 12, 16)}
    for t in (0.0, 0.7):
        per = [paid[(4, t, b)] for b in (4, 8, 12, 16)]
        # Strictly more each time: every forced bucket ran (a request's last cycles shrink, as
        # fewer drafts fit its remaining tokens, so the means stay below the buckets themselves).
        assert all(a < b for a, b in zip(per, per[1:])), per
        assert per[0] == 4  # the smallest bucket: the anchors only
    assert eng.idle and not eng.finished
    # The sampled pass ran last; its settings do not outlive its requests.
    assert eng.sa.all_greedy and all(sp.greedy for sp in eng.slot_params)
    p = tiny["prompts"]
    reqs = [eng.submit(p[i], greedy()) for i in range(4)]
    eng.run()
    assert [r.tokens for r in reqs] == ds.generate(tiny["target"], p[:4], sampling=greedy()).token_ids


@pytest.mark.slow
def test_idle_slots_shrink_the_state(tiny):
    """The decode state holds the smallest slot bucket that fits the requests in flight: it
    grows as requests queue and shrinks as they finish, moving the running requests into the
    low slots. No token changes — greedy outputs equal autoregressive decoding, and sampled
    ones (fixed-length drafting, each request with its own keys) equal an engine that always
    decodes all 4 slots — and a request cancelled after its slot moved is the one stopped."""
    p, m = tiny["prompts"][:10], tiny["budgets"][:10]

    def serve(min_slots):
        eng = Engine(tiny["target"], tiny["drafter"], slots=4, max_len=128, max_new_tokens=MAX_NEW,
                     prefill_tokens=16, num_draft=3, cycles_per_step=2, policy="fixed", min_slots=min_slots)
        assert eng.n_slots == min_slots
        reqs, sizes = [], []
        for i in range(len(p)):
            reqs.append(eng.submit(p[i], greedy(m[i])))
            if i % 3 == 2:
                reqs.append(eng.submit(p[i], sampled(i)))
                eng.step()
                sizes.append(eng.n_slots)
        late = eng.submit(p[0], greedy())
        victim = eng.submit(p[1], sampled(99))  # admitted last, into the highest free slot
        slots = []
        while not eng.idle:
            if victim.status == "running":
                slots.append(victim.slot)
                if min_slots == 1 and len(victim.tokens) >= 3 and victim.slot < slots[0]:  # it moved
                    eng.cancel(victim)
            eng.step()
            sizes.append(eng.n_slots)
        return eng, reqs + [late], victim, sizes

    eng, reqs, victim, sizes = serve(1)
    assert eng.slot_buckets == [1, 2, 4] and eng.used_slot_buckets == {1, 2, 4}
    assert max(sizes) == 4 and sizes[-1] < 4  # grew to all 4, shrank in the tail
    full, full_reqs, full_victim, full_sizes = serve(4)
    assert set(full_sizes) == {4} and full.used_slot_buckets == {4}
    assert [r.tokens for r in reqs] == [r.tokens for r in full_reqs]
    ar = ds.generate(tiny["target"], p + [p[0]], sampling=[greedy(b) for b in m] + [greedy()]).token_ids
    assert [r.tokens for r in reqs if r.sampling.greedy] == ar
    assert victim.finish_reason == "cancelled" and 3 <= len(victim.tokens) < MAX_NEW
    assert victim.tokens == full_victim.tokens[: len(victim.tokens)] and len(full_victim.tokens) == MAX_NEW
    assert all(r.status == "finished" for r in reqs) and eng.stats()["requests_finished"] == len(reqs)


def test_slot_moves_after_warm_up_compile_nothing(tiny):
    """After the server's warm-up, the state's moves between slot buckets compile nothing,
    whatever sampling the moved requests use, and neither do cancellations at any bucket
    (a move that took the sampling rows along compiled once per mix of sampling flags)."""
    from serve.server import warmup

    eng = Engine(tiny["target"], None, slots=4, max_len=512, max_new_tokens=MAX_NEW, prefill_tokens=16, policy="ar")
    warmup(eng, tiny["target"])
    c0, _ = compile_stats.snapshot()
    p = tiny["prompts"]
    first = eng.submit(p[0], sampled(1))
    eng.step()
    assert eng.n_slots == 1
    others = [eng.submit(p[i], greedy(3)) for i in (1, 2, 3)]
    eng.step()  # grows to 4 with a sampled request running
    assert eng.n_slots == 4
    eng.run()  # shrinks as the greedy ones finish
    late = eng.submit(p[4], sampled(2))
    eng.submit(p[5], greedy())
    eng.step()  # 2 slots
    eng.cancel(late)
    eng.run()
    assert eng.used_slot_buckets == {1, 2, 4} and late.finish_reason == "cancelled"
    assert first.status == "finished" and all(r.status == "finished" for r in others)
    assert compile_stats.snapshot()[0] == c0


def test_pooled_calibration_weighs_accepted_against_expected():
    """`PooledCalibration`: per kind of row, the drafts accepted against what the budget
    expected at trust 1 (each reading's expectation ÷ the trust it was made under), with a
    prior of `pseudo` expected drafts at ratio 1, over a sliding window of evidence."""
    from serve.engine import PooledCalibration

    cal = PooledCalibration(window=100.0, pseudo=10.0, decay=1.0)
    assert list(cal.trust) == [1.0, 1.0]
    cal.update([30.0, 0.0], [60.0, 0.0])  # half of what the budget expected of the drafter's rows
    assert cal.trust[0] == pytest.approx(40 / 70) and cal.trust[1] == 1.0  # no foreseen rows: unchanged
    t = cal.trust[0]
    cal.update([40.0, 5.0], [60.0 + 20 * t, 5.0])  # 20 expected at trust 1, asked for under trust t
    assert cal.trust[0] == pytest.approx((40 + 10) / (80 + 10)) and cal.trust[1] == pytest.approx(1.0)
    t = cal.trust[0]
    cal.update([140.0, 5.0], [60.0 + 20 * (40 / 70) + 100 * t, 5.0])  # 180 expected in all: the window keeps 100
    assert cal.expected[0] == pytest.approx(100.0) and cal.accepted[0] == pytest.approx(140 * 100 / 180)
    assert cal.trust[0] == pytest.approx((140 * 100 / 180 + 10) / 110)
    cal.update([0.0, 0.0], [0.0, 0.0])  # a fresh decode state: its tallies restarted, nothing new
    assert cal.trust[0] == pytest.approx((140 * 100 / 180 + 10) / 110)
    low = PooledCalibration(pseudo=1.0, decay=0.9)
    low.update([0.0, 0.0], [1000.0, 0.0])
    assert low.trust[0] == low.lo  # clipped
    for _ in range(100):  # no new evidence (the budget stopped drafting): it fades, the drafter is tried again
        low.update([0.0, 0.0], [1000.0, 0.0])
    assert 0.9 < low.trust[0] <= 1.0


@pytest.mark.slow
def test_pooled_calibration_stops_drafting_that_never_pays(tiny):
    """A drafter whose drafts the target rejects, without a measured acceptance prior (so each
    request's budget starts at confidence 1): calibrated per request alone, every new request
    tries drafting again; pooled over the requests served, the engine learns that the drafter's
    rows deliver far less than expected and the next requests barely draft. The outputs are the
    target's either way (greedy ≡ autoregressive)."""
    p, m = tiny["prompts"][:24], [MAX_NEW] * 24
    # Drafting pays only if drafts survive: 4 anchors at 1 step/s against (4 + E) · 0.6 at 8
    # tokens, (4 + E) · 0.45 at 16 (E ≥ 2.7, ≥ 4.9 drafts expected to be accepted).
    from serve.engine import PooledCalibration

    rates = {4: 1.0, 8: 0.6, 12: 0.5, 16: 0.45}
    runs = {}
    for pooled in (False, True):
        eng = Engine(tiny["target"], tiny["drafter"], slots=4, max_len=128, max_new_tokens=MAX_NEW,
                     prefill_tokens=16, num_draft=3, cycles_per_step=2, policy="dspark", step_rates=rates,
                     # A prior worth 2 expected drafts: this short run's evidence decides.
                     pooled_calibration=PooledCalibration(pseudo=2.0) if pooled else False)
        assert eng.settings.policy == "async"
        first = [eng.submit(x, greedy(b)) for x, b in zip(p[:12], m[:12])]
        eng.run()
        second = [eng.submit(x, greedy(b)) for x, b in zip(p[12:], m[12:])]
        eng.run()
        k1 = eng.counters()
        runs[pooled] = dict(eng=eng, out=[r.tokens for r in first + second],
                            verified=[sum(r.stats["verified"] for r in wave) for wave in (first, second)],
                            accepted=k1["accepted"][0], expected=k1["budget_exp"][0])
    ar = ds.generate(tiny["target"], p, sampling=[greedy(b) for b in m]).token_ids
    assert runs[False]["out"] == runs[True]["out"] == ar
    own, pooled = runs[False], runs[True]
    assert own["eng"].budget_trust is None
    assert own["accepted"] < 0.3 * own["expected"]  # most drafts do not survive
    trust = pooled["eng"].budget_trust
    assert trust[0] < 0.41 and trust[1] == 1.0  # below where the 16-token bucket pays at confidence 1
    assert own["verified"][1] > 0 and pooled["verified"][1] < own["verified"][1] / 2
    # What the budget expected is nearer what the drafts delivered (23% → 39% here).
    assert pooled["accepted"] / pooled["expected"] > own["accepted"] / own["expected"]
