"""Step-rate tables: how many decode steps per second each static bucket runs.

Shape letters (docs/architecture.md, "Shape letters"): S request slots, G drafts per slot (max), N packed
tokens, U buckets, T cache length, V vocab.

Cost model: step time = draft(S) + verify(S, N) — the drafter runs once per slot whatever
the budget, the packed target step costs by its bucket. A step that skips drafting (async,
budget 0) costs verify(S, S) with one query per slot. Each piece is the function the decode
loop runs (`decode_loop.verify_bucket` with its writes deferred past the bucket switch,
`drafter.draft`) run in a jitted loop with the caches donated, as the decode loop runs them:
each piece is timed at `STEPS_PER_CALL` steps per call and at 2 + that many, and the step's
cost is the difference ÷ 2 (the call's own cost — the host's dispatch of the whole state,
~25 ms at 16 slots — cancels), after a warm-up, medians of `repeats`, then made monotone (a
bigger bucket is never faster: timing noise must not make the scheduler prefer it).
All-greedy batches get their own table (the greedy cycle drafts without distributions and
verifies by argmax). Tables are cached as JSON under ~/.cache/dspark_jax/sps/ (or
$DSPARK_SPS_CACHE), keyed by the method, device kind (on a CPU also its model and vector extensions:
`cpu_model`), model, config hash, dtype, drafter, slots, K, cache length, bucket list and
sampling mode.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.decode_loop import verify_bucket
from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams
from dspark_jax.decoding.scheduler import check_widths
from dspark_jax.models.transformer import KVCache

DEFAULT_CACHE_DIR = os.path.expanduser("~/.cache/dspark_jax/sps")


def cpu_model() -> str:
    """The CPU's model name and the vector extensions that decide XLA:CPU's speed (bf16 matmuls
    run on AMX / AVX512-BF16 where present, converted to float32 on AVX2 otherwise): machines of
    this project's kind measured 2x apart in step time (a Xeon with AMX against an AVX2-only
    EPYC), so a step-rate table from one must not price steps on another — JAX's device kind
    says only "cpu"."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
                 platform.machine())
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{model} ({' '.join(isa) or 'no AVX2'})"


def device_kind() -> str:
    """The table key's device: JAX's device kind, and on a CPU its model (`cpu_model`)."""
    dev = jax.devices()[0]
    return f"{dev.device_kind}: {cpu_model()}" if dev.platform == "cpu" else dev.device_kind


def default_buckets(slots: int, num_draft: int, count: int = 4) -> tuple[int, ...]:
    """`count` packed-token buckets from S (anchors only) to S·(K+1) (every draft), evenly
    spaced in drafts; fewer when S·K is small."""
    extra = sorted({-(-slots * num_draft * i // (count - 1)) for i in range(count)})
    return tuple(slots + e for e in extra)


def narrow_widths(slots: int, num_draft: int, buckets: Sequence[int]) -> tuple[int, ...]:
    """Query widths (tokens a slot) for `buckets`: the even share of a bucket's drafts plus
    one more a slot, K + 1 for the largest. The attention of a step runs over the [S, width]
    grid whatever the bucket's packed tokens, so a narrow grid makes a small bucket cheaper
    (SmolLM2, one term, 8 slots, K = 7, 256 positions: the 27-token bucket 69-77 ms at widths
    4-5 against 91 ms at 8; BENCHMARKS.md, "Stop 51"); the scheduler then admits at most
    width − 1 drafts a slot in it."""
    K = num_draft
    w = [min(K + 1, -(-max(n - slots, 0) // slots) + 2) for n in buckets]
    w[-1] = K + 1
    return tuple(int(x) for x in np.maximum.accumulate(w))


@dataclasses.dataclass(frozen=True)
class StepRates:
    """A profiled (or given) step-rate table for one slot count S.

    `rates[u]` = 1 / (draft_s + verify_s[u]) steps/s at bucket `buckets[u]` packed tokens;
    `skip_rate` = 1 / ar_s for a step without drafting (0 = unknown: never skip). `widths`:
    each bucket's query grid, tokens a slot (`LoopSettings.bucket_widths`), as measured;
    None: K + 1 for every bucket."""

    slots: int
    buckets: tuple[int, ...]
    draft_s: float
    verify_s: tuple[float, ...]
    ar_s: float = float("inf")
    key: dict | None = None
    widths: tuple[int, ...] | None = None

    @classmethod
    def from_mapping(cls, sps: Mapping[int, float], slots: int) -> StepRates:
        items = sorted((int(n), float(r)) for n, r in sps.items())
        if not items or any(r <= 0 for _, r in items):
            raise ValueError(f"step rates must be a non-empty mapping {{packed tokens: steps/s > 0}}, got {sps}")
        return cls(slots, tuple(n for n, _ in items), 0.0, tuple(1.0 / r for _, r in items))

    @property
    def rates(self) -> np.ndarray:
        return 1.0 / (self.draft_s + np.asarray(self.verify_s, np.float64))

    @property
    def skip_rate(self) -> float:
        return 0.0 if not np.isfinite(self.ar_s) else 1.0 / self.ar_s

    def to_dict(self) -> dict:
        return {"slots": self.slots, "buckets": list(self.buckets), "draft_s": self.draft_s,
                "verify_s": list(self.verify_s), "ar_s": self.ar_s if np.isfinite(self.ar_s) else None,
                "key": self.key, "widths": None if self.widths is None else list(self.widths)}

    @classmethod
    def between(cls, lo: StepRates, hi: StepRates, lo_len: int, hi_len: int, length: int) -> StepRates:
        """The table at cache length `length`, linear between tables measured at `lo_len` and
        `hi_len` (a step's attention reads the window; the rest of it does not depend on it)."""
        if lo.slots != hi.slots or lo.buckets != hi.buckets or lo.widths != hi.widths or not lo_len < hi_len:
            raise ValueError("interpolate between two tables of one slot count and bucket list, "
                             f"at two cache lengths (got {lo_len} and {hi_len})")
        f = (length - lo_len) / (hi_len - lo_len)

        def mix(a, b):
            return float(a + f * (b - a))

        key = None if hi.key is None else {**hi.key, "cache_len": length, "interpolated": [lo_len, hi_len]}
        return cls(lo.slots, lo.buckets, mix(lo.draft_s, hi.draft_s),
                   tuple(mix(a, b) for a, b in zip(lo.verify_s, hi.verify_s)),
                   mix(lo.ar_s, hi.ar_s) if np.isfinite(lo.ar_s) and np.isfinite(hi.ar_s) else float("inf"), key,
                   lo.widths)

    @classmethod
    def from_dict(cls, d: dict) -> StepRates:
        return cls(int(d["slots"]), tuple(d["buckets"]), float(d["draft_s"]), tuple(d["verify_s"]),
                   float("inf") if d.get("ar_s") is None else float(d["ar_s"]), d.get("key"),
                   None if d.get("widths") is None else tuple(d["widths"]))


def _model_key(target, drafter, slots, num_draft, cache_len, buckets, greedy=False, widths=None) -> dict:
    dcfg = getattr(drafter, "cfg", None)
    key = {
        # bump to invalidate old tables
        "method": "draft(S) + verify(S, N), round-robin medians, 2 vs 4 steps a call, caches donated, "
                  "non-monotone pairs re-timed, traced step count, v6",
        "device": device_kind(),
        "model": target.name,
        "config": hashlib.sha1(repr(target.cfg).encode()).hexdigest()[:16],
        "dtype": jnp.dtype(target.cfg.jnp_dtype).name,
        "drafter": type(drafter).__name__ + ":" + hashlib.sha1(repr(dcfg).encode()).hexdigest()[:16],
        "slots": slots,
        "num_draft": num_draft,
        "cache_len": cache_len,
        "buckets": list(buckets),
    }
    if greedy:
        key["sampling"] = "greedy"
    if widths is not None:
        key["widths"] = list(widths)
    return key


def _cache_path(key: dict, cache_dir: str | None) -> str:
    d = cache_dir or os.environ.get("DSPARK_SPS_CACHE", DEFAULT_CACHE_DIR)
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(d, f"{h}.json")


# Steps per timed call (and 2 more): the decode loop runs its steps in one jitted loop, and a
# call per step would add the host's dispatch of the whole state to every step (at 16 slots a
# skipped step read 20% dearer than in the loop, which biased the scheduler towards drafting).
STEPS_PER_CALL = 2


# `steps` is traced (a while loop's trip count), not static: the short and the long call of a
# piece are one compiled program, which halves what a table compiles.
@functools.partial(jax.jit, static_argnames=("tgraph", "drafter"))
def _draft_step(tgraph, tstate, drafter, dparams, dcache, anchor_S, pos_S, keys_S, sa, steps):
    target = nnx.merge(tgraph, tstate)

    def body(_, carry):
        anchor, acc = carry
        tok, logits, conf = drafter.draft(dparams, dcache, target, anchor, pos_S, keys_S, sa)
        # As the decode loop does: greedy verification never reads the draft distributions, so
        # their scatter into the full vocabulary is dead code there and must not be timed here.
        acc = acc + jnp.sum(conf) + (0.0 if sa.all_greedy else jnp.sum(jnp.where(logits > 0, 1.0, 0.0)))
        return tok[:, 0], acc  # the next draft starts from this one's first token

    return jax.lax.fori_loop(0, steps, body, (anchor_S, jnp.float32(0.0)))


@functools.partial(jax.jit, static_argnames=("tgraph", "drafter", "num_tokens", "q_max", "defer_to"),
                   donate_argnames=("cache", "dcache"))
def _verify_step(tgraph, tstate, drafter, dparams, cache, dcache, seq_len_S, anchor_S, sa, verify_keys, d_tok,
                 d_logits, nv, active, steps, *, num_tokens, q_max, defer_to):
    """The step as the scheduled loop runs it under its bucket switch: the caches only read,
    the step's writes (padded to the largest bucket) applied after."""
    target = nnx.merge(tgraph, tstate)

    def body(_, carry):
        cache, dcache, anchor, acc = carry
        accepted, emitted, writes = verify_bucket(target, drafter, dparams, cache, dcache, seq_len_S, anchor, sa,
                                                  verify_keys, d_tok, d_logits, nv, active, num_tokens=num_tokens,
                                                  q_max=q_max, defer_to=defer_to)
        cache, dcache = writes.apply(target, drafter, dparams, cache, dcache)
        return cache, dcache, emitted[:, 0], acc + jnp.sum(accepted)

    return jax.lax.fori_loop(0, steps, body, (cache, dcache, anchor_S, jnp.int32(0)))


def _median_times(fns, repeats: int, warmup: int = 2) -> list[float]:
    """Median wall time of each fn() after warm-up, measured round-robin (one call of each
    per round) so that a burst of load from other processes hits every entry alike rather
    than inflating one bucket."""
    for fn in fns:
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def spread_drafts(total: int, slots: int, num_draft: int) -> np.ndarray:
    """Drafts per slot for `total` drafts over `slots` slots, as even as possible."""
    base, rem = divmod(total, slots)
    return np.minimum(base + (np.arange(slots) < rem), num_draft).astype(np.int32)


def step_inputs(target, drafter, *, slots: int, num_draft: int, cache_len: int, greedy: bool = False) -> dict:
    """The inputs a profiled step runs on: empty caches of `cache_len` positions, every slot
    active with its anchor mid-cache, zero drafts, and greedy (T = 0) or T = 1 sampling."""
    S, K, T = slots, num_draft, cache_len
    dparams = drafter.params
    return {
        "dparams": dparams,
        "cache": KVCache.zeros(target.cfg, S, T),
        "dcache": drafter.init_cache(dparams, S, T),
        "sa": SamplingArrays.from_params([SamplingParams(temperature=0.0 if greedy else 1.0)] * S),
        "keys": jax.vmap(jax.random.key)(jnp.arange(S, dtype=jnp.uint32)),
        # Anchors mid-cache: the masks are dense over T anyway, so the position only has to be valid.
        "pos": jnp.full((S,), T // 2, jnp.int32),
        "anchor": jnp.zeros((S,), jnp.int32),
        "d_tok": jnp.zeros((S, K), jnp.int32),
        # Greedy verification reads no draft distributions (an empty vocabulary axis).
        "d_logits": jnp.zeros((S, K, 0 if greedy else target.cfg.vocab_size), jnp.float32),
        "active": jnp.ones((S,), bool),
    }


def measure_step_rates(target, drafter, *, slots: int, num_draft: int, cache_len: int,
                       buckets: Sequence[int], repeats: int = 7, greedy: bool = False,
                       widths: Sequence[int] | None = None) -> StepRates:
    """Times draft(S), verify(S, N) for every bucket N, and the no-draft step (uncached).
    `greedy`: every request greedy (T = 0) — the loop then drafts without the draft
    distributions and verifies by argmax, both cheaper than the sampled path timed otherwise."""
    S, K, T = slots, num_draft, cache_len
    x = step_inputs(target, drafter, slots=S, num_draft=K, cache_len=T, greedy=greedy)
    dparams, sa, keys, pos, anchor = x["dparams"], x["sa"], x["keys"], x["pos"], x["anchor"]
    d_tok, d_logits, active = x["d_tok"], x["d_logits"], x["active"]
    tg, ts = target.graphdef, target.state

    # The caches are donated and threaded from call to call, as the decode loop updates them in
    # place: a step that returned a fresh copy would time a copy of the whole cache too (at
    # S = 16 a third of a one-token step), which no real step pays.
    caches = {"cache": x["cache"], "dcache": x["dcache"]}

    q_of = dict(zip(buckets, widths or (K + 1,) * len(buckets)))

    def verify_fn(n_tokens, q_max, steps):
        nv = jnp.asarray(np.minimum(spread_drafts(n_tokens - S, S, K), q_max - 1))

        def call():
            out = _verify_step(tg, ts, drafter, dparams, caches["cache"], caches["dcache"], pos, anchor, sa, keys,
                               d_tok, d_logits, nv, active, jnp.int32(steps), num_tokens=n_tokens, q_max=q_max,
                               defer_to=max(buckets))
            caches["cache"], caches["dcache"] = out[0], out[1]
            return out[2:]
        return call

    def draft_fn(steps):
        return lambda: _draft_step(tg, ts, drafter, dparams, caches["dcache"], anchor, pos, keys, sa, jnp.int32(steps))

    def pieces(steps):
        return [draft_fn(steps), verify_fn(S, 1, steps)] + [verify_fn(n, q_of[n], steps) for n in buckets]

    n = STEPS_PER_CALL

    def per_step(short, long):
        # Per step: the difference of the two call lengths; never below a tenth of the short
        # call's share (noise must not make a piece look free).
        return [max((b - a) / 2, a / n / 10) for a, b in zip(short, long)]

    times = _median_times(pieces(n) + pieces(n + 2), repeats)
    m = len(times) // 2
    draft_s, ar_s, *verify_s = per_step(times[:m], times[m:])
    # A bigger bucket timed faster than a smaller one is noise: re-time both, twice as often.
    # (Raising it to the smaller one's time alone under-priced it — SmolLM2, 8 slots, 512
    # window: bucket 46 priced as bucket 27, 155 ms, ran at 172 in the loop; BENCHMARKS.md,
    # "Stop 46".)
    redo = sorted({v for u in range(1, len(verify_s)) if verify_s[u] < verify_s[u - 1] for v in (u - 1, u)})
    if redo:
        fns = [verify_fn(buckets[u], q_of[buckets[u]], steps) for steps in (n, n + 2) for u in redo]
        t = _median_times(fns, 2 * repeats, warmup=1)
        for u, v in zip(redo, per_step(t[: len(redo)], t[len(redo):])):
            verify_s[u] = v
    # Monotone: a bigger bucket never runs faster (noise would otherwise attract the scheduler).
    verify_s = np.maximum.accumulate(np.asarray(verify_s)).tolist()
    return StepRates(S, tuple(int(b) for b in buckets), float(draft_s), tuple(verify_s), float(ar_s),
                     widths=None if widths is None else tuple(int(w) for w in widths))


def profile_step_rates(target, drafter, *, slots: int, num_draft: int, cache_len: int,
                       buckets: Sequence[int] | None = None, repeats: int = 7, cache_dir: str | None = None,
                       reprofile: bool = False, greedy: bool = False,
                       widths: Sequence[int] | str | None = None) -> StepRates:
    """The step-rate table of (target, drafter) at S = `slots`, from the disk cache when it
    holds one for this device, model, dtype, bucket list and sampling mode (`greedy`: every
    request at T = 0, see `measure_step_rates`), else measured and stored. `widths`: each
    bucket's query grid (tokens a slot, `LoopSettings.bucket_widths`), "narrow"
    (`narrow_widths`), or None (K + 1 for every bucket)."""
    buckets = tuple(buckets) if buckets is not None else default_buckets(slots, num_draft)
    if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] > slots * (num_draft + 1):
        raise ValueError(f"buckets must be strictly increasing within [1, {slots * (num_draft + 1)}] "
                         f"(S·(K+1) for S={slots}, K={num_draft}), got {buckets}")
    if widths == "narrow":
        widths = narrow_widths(slots, num_draft, buckets)
    if widths is not None:
        widths = tuple(int(w) for w in widths)
        check_widths(widths, buckets, num_draft)
    key = _model_key(target, drafter, slots, num_draft, cache_len, buckets, greedy, widths)
    path = _cache_path(key, cache_dir)
    if not reprofile and os.path.exists(path):
        with open(path) as f:
            table = StepRates.from_dict(json.load(f))
        if table.key == key:
            return table
    table = dataclasses.replace(measure_step_rates(target, drafter, slots=slots, num_draft=num_draft,
                                                   cache_len=cache_len, buckets=buckets, repeats=repeats,
                                                   greedy=greedy, widths=widths),
                                key=key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table.to_dict(), f, indent=1)
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return table


def profile_window_rates(target, drafter, *, slots: int, num_draft: int, lengths: Sequence[int],
                         reprofile: bool = False, greedy: bool = False, **kw) -> dict[int, StepRates]:
    """A step-rate table per cache length in `lengths` (the attention windows a decode loop
    runs in, and its whole cache): measured at the shortest and the longest
    (`profile_step_rates`, cached on disk), linear in between. A step's attention reads its
    window, so the cost of verification against a step without drafts — where drafting
    pays — moves with the window: one table at the longest would misprice the short ones
    (SmolLM2, 8 slots: a 2,048 table says drafting never pays, the 256 one that it pays from
    12 accepted drafts of 19; BENCHMARKS.md, "Stop 38")."""
    lengths = sorted(set(int(t) for t in lengths))
    if not lengths:
        raise ValueError("need at least one cache length")
    lo, hi = lengths[0], lengths[-1]
    measured = {t: profile_step_rates(target, drafter, slots=slots, num_draft=num_draft, cache_len=t,
                                      reprofile=reprofile, greedy=greedy, **kw) for t in {lo, hi}}
    return {t: measured[t] if t in measured else StepRates.between(measured[lo], measured[hi], lo, hi, t)
            for t in lengths}
