"""A continuous-batching engine: requests join free slots while others decode.

    eng = Engine(target, drafter, slots=8, policy="dspark")
    r = eng.submit("Hello", ds.SamplingParams(max_new_tokens=64), on_token=print)
    eng.run()            # or eng.step() from your own loop; eng.cancel(r) at any time

Each `step()` admits queued requests into free slots and prefills prompts in chunks (at most
P prompt tokens per step in all, each admitted slot's chunk prefilled on its own — its own
query rows, rounded up to a power of two, against its own context —
`decoding.prefill.prefill_one` — then one jitted `admit` starts the slots whose prompt is
complete; a long prompt takes several steps while the other slots keep decoding), runs
`cycles_per_step` cycles of the same on-device loop `generate()` uses (`decode_loop`, with
the chosen policy over all active slots; fewer when a request finishes, so that its slot is
refilled by the next step instead of idling), then streams the new tokens of every request
to its callback and retires finished or cancelled requests, freeing their slots.

Idle slots cost nothing: the decode state holds the smallest slot bucket (a power of two from
`min_slots` up to S) that fits the requests running and queued. It grows (one copy of the
state into a bigger one) when more requests arrive, and once the requests in flight fit half
of it, the running ones move into the slots of the smaller bucket (`take_state_slots`, as
`generate()` compacts), so a lone request on an 8-slot engine decodes at one slot's cost. Each
slot bucket has its own programs and, scheduled, its own step-rate tables (profiled up front).

Static shapes, so steady-state serving compiles nothing (beyond the programs of each
attention window and slot bucket, when first reached): S slots, output buffer O, prompt chunks of P tokens;
the target's cache is sized to the window that holds every running context (up to the
`max_len` bucket T; resized in one copy when a window is crossed, because attention over a
window cut from a longer cache copies it every step on CPU); every sampling filter is compiled
in, so any mix of temperature / top-k / top-p / min-p reuses the same programs.
Beyond one chip: `Engine(..., mesh=make_mesh(data=…, tensor=…))` places the target's and
the drafter's parameters by the serving rules (`dspark_jax.sharding.SERVING_RULES`: weights
split over the tensor axis, replicated over data) and the KV caches over their KV heads, and
the same jitted programs run sharded (XLA inserts the collectives).

Shape letters (docs/architecture.md, "Shape letters"): S slots, N admission tokens, T cache length,
O output buffer, M stop ids.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.decode_config import DecodeConfig
from dspark_jax.decoding.decode_loop import (
    GenState,
    LoopSettings,
    SchedArrays,
    acceptance_prior,
    decode_loop,
    request_stop_ids,
    take_state_slots,
)
from dspark_jax.decoding.generate import (
    WindowSched,
    attention_windows,
    encode_prompt,
    loop_settings,
    next_pow2,
    pick_window,
)
from dspark_jax.decoding.prefill import admit, prefill_one, prefill_rows
from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams
from dspark_jax.decoding.seeds import request_keys, resolve_seed
from dspark_jax.decoding.stop_strings import stop_string_cut
from dspark_jax.models.transformer import KVCache


@dataclasses.dataclass(eq=False)
class Request:
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    on_token: Callable[[Request, list[int]], None] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    status: str = "queued"  # queued → prefilling → running → finished | cancelled
    prefilled: int = 0  # prompt tokens in the cache
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    seed: int | None = None  # the seed it ran with (drawn fresh when sampling.seed is None)
    text: str | None = None
    slot: int | None = None
    submitted_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


def place_on_mesh(target, drafter, mesh):
    """(target, drafter) with parameters placed on `mesh` by the serving rules."""
    from dspark_jax.models.drafters import Drafter
    from dspark_jax.sharding import SERVING_RULES, shard_state

    target = dataclasses.replace(target, state=shard_state(target.state, mesh, SERVING_RULES))
    if isinstance(drafter, Drafter):
        drafter = Drafter(drafter.cfg, drafter.graphdef, shard_state(drafter.state, mesh, SERVING_RULES)).bind(target)
    return target, drafter


def _shard_cache(cache: KVCache, mesh) -> KVCache:
    """A KV cache with its KV heads over the tensor axis (when they divide), the rest replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    def put(x, _):
        spec = [None] * x.ndim
        ax = x.ndim + cache.heads_axis
        spec[ax] = "tensor" if x.shape[ax] % mesh.shape["tensor"] == 0 else None
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))

    return cache.map_arrays(put)


@jax.jit
def _set_done(done, mask):
    """`done` with the slots in `mask` marked done: one program per slot bucket, which the
    warm-up compiles (`compile_cache_moves`), for cancellations, stop strings and new slots."""
    return done | mask


@dataclasses.dataclass
class SlotLoop:
    """What the decode loop of one slot bucket runs with: the sampled cycle's settings and
    step-rate tables, and the greedy cycle's (the same where nothing is profiled)."""

    settings: LoopSettings
    sched: WindowSched | None
    greedy_settings: LoopSettings
    greedy_sched: WindowSched | None


class PooledCalibration:
    """The async budget's expectations calibrated over the requests an engine serves.

    Each request calibrates its own confidences online (`decode_loop.cycle`), but a request of a
    few dozen cycles ends before its evidence outweighs the prior it starts from — the drafter's
    measured acceptance, prompt lookup's per-match-length table — and where those are optimistic
    the budget drafts at steps that do not pay (measured at 8 slots: 13% fewer drafts accepted
    than the budget expected of the drafter's rows, 19% of lookup's). The engine therefore pools
    the evidence of every request: per kind of row [trained drafter, foreseen], the drafts
    accepted against what the budget expected before this correction, over a window of the last
    `window` expected drafts, with `pseudo` expected drafts of prior at a ratio of 1. The ratio,
    clipped to [`lo`, `hi`], is the `trust` the next steps' budget scales its expectations by
    (`SchedArrays.trust`; traced, so it compiles nothing). Schedules decide how many drafts are
    verified, never what is emitted: lossless whatever the trust. The evidence also fades by
    `decay` per engine step, so a trust that stopped the drafting (and with it the evidence)
    drifts back towards 1 and the drafter is tried again — traffic changes."""

    def __init__(self, window: float = 400.0, pseudo: float = 20.0, lo: float = 0.25, hi: float = 2.0,
                 decay: float = 0.998):
        self.window, self.pseudo, self.lo, self.hi, self.decay = float(window), float(pseudo), lo, hi, decay
        self.accepted = np.zeros(2)
        self.expected = np.zeros(2)  # what the budget expected at trust 1
        self.trust = np.ones(2)
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    def update(self, accepted_sum, budget_exp_sum) -> None:
        """Adds the decode state's running tallies since the last reading (made under the
        current trust) to the pooled evidence and recomputes the trust."""
        acc, exp = np.asarray(accepted_sum, np.float64), np.asarray(budget_exp_sum, np.float64)
        d_acc, d_exp = (acc, exp) if self._last is None else (acc - self._last[0], exp - self._last[1])
        self._last = (acc, exp)
        if np.any(d_exp < 0) or np.any(d_acc < 0):  # a fresh state: its tallies restarted
            d_acc, d_exp = acc, exp
        self.accepted = self.decay * self.accepted + d_acc
        self.expected = self.decay * self.expected + d_exp / self.trust
        over = self.expected > self.window
        if over.any():  # a sliding window of evidence: the oldest weighs less
            f = np.where(over, self.window / np.maximum(self.expected, 1e-9), 1.0)
            self.accepted *= f
            self.expected *= f
        ratio = (self.accepted + self.pseudo) / (self.expected + self.pseudo)
        self.trust = np.clip(ratio, self.lo, self.hi)


def slot_buckets(slots: int, min_slots: int = 1) -> list[int]:
    """The slot counts a decode state may hold: powers of two from `min_slots` (rounded up)
    below `slots`, then `slots` itself."""
    if not 1 <= min_slots <= slots:
        raise ValueError(f"min_slots must be between 1 and slots={slots}, got {min_slots}")
    b, out = next_pow2(min_slots, 1), []
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


class Engine:
    """Continuous batching over `slots` request slots with policy "ar", "fixed", "dspark"
    (async or sync scheduler) or "threshold", as in `generate()`. `min_slots` (default 1) is
    the smallest slot bucket the decode state shrinks to (= `slots`: always all slots); a
    given `step_rates` table is for `slots` slots, so a scheduled engine with one never shrinks.
    `pooled_calibration` (async): the budget's expectations are also corrected by the evidence
    of every request served (True: a default `PooledCalibration`, or one given); off by default
    — it makes the expectations match what the drafts deliver, but measured it did not make
    serving faster (BENCHMARKS.md, stop 50)."""

    def __init__(self, target, drafter=None, *, slots: int = 8, max_len: int = 1024, max_new_tokens: int = 256,
                 prefill_tokens: int = 256, policy: str | None = None, scheduler="async", threshold: float = 0.5,
                 num_draft: int | None = None, step_rates=None, cycles_per_step: int = 4,
                 windowed_attention: bool = True, mesh=None, config: DecodeConfig | None = None,
                 stop_on_finish: bool = True, min_slots: int = 1,
                 pooled_calibration: bool | PooledCalibration = False):
        config = DecodeConfig.pick(config, policy=policy, num_draft=num_draft, scheduler=scheduler,
                                   threshold=threshold, windowed_attention=windowed_attention)
        self.config = config
        policy, drafter, K = config.resolve(target, drafter)
        if mesh is not None:
            target, drafter = place_on_mesh(target, drafter, mesh)
        self.mesh = mesh
        self.target, self.drafter, self.K = target, drafter, K
        self.S = slots
        self.T = next_pow2(max_len, 128)
        if self.T > target.cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context of "
                             f"{target.cfg.max_position_embeddings} tokens")
        self.max_new_tokens = max_new_tokens
        self.P = next_pow2(prefill_tokens, 16)
        # Decode attention reads a window of the cache that covers every running slot's
        # context (as in generate(); each window compiles once, when first reached).
        self.windows = attention_windows(self.T, fine=config.fine_windows) if config.windowed_attention else []
        self.cycles_per_step = cycles_per_step
        # A step also ends after the cycle in which a request finished (`decode_loop`).
        self.stop_on_finish = stop_on_finish
        cfg = target.cfg
        # Two step-rate tables when profiled here: the sampled cycle's, and the cheaper greedy
        # cycle's (argmax verification, no draft distributions) used while every running
        # request is at T = 0 — the program the engine runs then (`SamplingArrays.all_greedy`).
        # Each table is profiled per cache length the engine decodes at (its windows and T):
        # `step` schedules with the one of the cache's current length.
        schedule = config.loop_schedule(policy)
        windows = [w for w in self.windows if w is not None]
        scheduled = drafter is not None and schedule != "fixed"
        # A caller's step-rate table prices steps of `slots` slots only.
        self.slot_buckets = [slots] if scheduled and step_rates is not None else slot_buckets(slots, min_slots)
        self.loops: dict[int, SlotLoop] = {}
        for b in self.slot_buckets:
            settings, sched = loop_settings(target, drafter, schedule, K, b, self.T, config.threshold, step_rates,
                                            False, windows=windows, widths=config.bucket_widths)
            greedy_settings, greedy_sched = (
                loop_settings(target, drafter, schedule, K, b, self.T, config.threshold, None, False, greedy=True,
                              windows=windows, widths=config.bucket_widths)
                if step_rates is None and sched is not None and schedule != "threshold" else (settings, sched))
            self.loops[b] = SlotLoop(settings, sched, greedy_settings, greedy_sched)
        O = next_pow2(max_new_tokens) + K + 1
        self.M = 8  # stop ids per request
        self.dparams = drafter.params if drafter is not None else None
        # Where each admitted request's scheduler starts (the drafter's measured acceptance).
        self.prior = jnp.asarray(acceptance_prior(drafter, K))
        # Only the async budget reads the trust: no calibration to keep for any other schedule.
        async_budget = scheduled and schedule == "async" and pooled_calibration is not False
        self.calibration = (None if not async_budget else pooled_calibration
                            if isinstance(pooled_calibration, PooledCalibration) else PooledCalibration())
        n = self.slot_buckets[0]
        st = GenState.create(cfg, drafter, self.dparams, slots=n, cache_len=self.T, out_len=O, num_draft=K,
                             stop_ids=np.full((n, self.M), -1, np.int32))
        # The target's cache starts at the first window and follows the contexts (`step`).
        st = st.replace(cache=st.cache.resized(min(self.windows, default=self.T)))
        self.st = self._place(st)
        self.used_slot_buckets = {n}
        self.slot_params = [SamplingParams(temperature=0.0)] * n
        self.sa = self._sampling_arrays()
        self.running: dict[int, Request] = {}  # slot → request
        self.queue: deque[Request] = deque()
        self._ids = itertools.count()
        self.finished: list[Request] = []
        self.tokens_out = 0
        self.busy_s = 0.0

    def _sampling_arrays(self) -> SamplingArrays:
        # Every filter compiled in (a row with top_k = 0 / top_p = 1 / min_p = 0 is unaffected),
        # so no mix of arriving sampling parameters ever compiles a new program.
        # `top_k_max` (a static bound on k when every sampled row uses top-k) would vary with the
        # requests' k, one program per power of two: pinned to 0 (the general path).
        return dataclasses.replace(SamplingArrays.from_params(self.slot_params), use_top_k=True, use_top_p=True,
                                   use_min_p=True, top_k_max=0)

    def _place(self, st: GenState) -> GenState:
        """The state with its caches over the mesh's tensor axis (no mesh: as it is)."""
        if self.mesh is None:
            return st
        return st.replace(cache=_shard_cache(st.cache, self.mesh),
                          dcache=_shard_cache(st.dcache, self.mesh) if isinstance(st.dcache, KVCache) else st.dcache)

    @property
    def n_slots(self) -> int:
        """Slots the decode state holds now (its slot bucket)."""
        return len(self.slot_params)

    # The loop of all S slots (what a caller's `step_rates` prices; the server logs its policy).
    @property
    def settings(self) -> LoopSettings:
        return self.loops[self.S].settings

    @property
    def sched(self) -> WindowSched | None:
        return self.loops[self.S].sched

    @property
    def greedy_settings(self) -> LoopSettings:
        return self.loops[self.S].greedy_settings

    @property
    def greedy_sched(self) -> WindowSched | None:
        return self.loops[self.S].greedy_sched

    @property
    def step_rates(self):
        """The sampled cycle's step-rate table at the whole cache (None: not scheduled)."""
        return self.sched.table(self.T) if self.sched is not None and self.sched.tables else None

    @property
    def greedy_step_rates(self):
        """The greedy cycle's step-rate table at the whole cache."""
        return self.greedy_sched.table(self.T) if self.greedy_sched is not None and self.greedy_sched.tables else None

    # ------------------------------------------------------------------ public API

    def submit(self, prompt, sampling: SamplingParams | None = None,
               on_token: Callable[[Request, list[int]], None] | None = None) -> Request:
        sp = sampling or SamplingParams()
        ids = encode_prompt(self.target, prompt)
        if sp.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={sp.max_new_tokens} exceeds the engine's {self.max_new_tokens}")
        if len(ids) + sp.max_new_tokens + self.K + 1 > self.T:
            raise ValueError(f"prompt of {len(ids)} tokens + {sp.max_new_tokens} new tokens does not fit the "
                             f"engine's cache of {self.T} tokens (raise max_len)")
        if sp.stop and self.target.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        req = Request(next(self._ids), ids, sp, on_token, submitted_at=time.perf_counter())
        self.queue.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stops a request now; its slot is free for the next `step()`."""
        if req.status == "queued":
            self.queue.remove(req)
            self._finish(req, "cancelled")
        elif req.status in ("prefilling", "running"):
            self.st = self.st.replace(done=_set_done(self.st.done, np.arange(self.n_slots) == req.slot))
            self._finish(req, "cancelled")

    @property
    def chunk_sizes(self) -> list[int]:
        """Every query-row count a prefill chunk can run in (`prefill_rows` up to the per-step
        budget P; what a warm-up compiles, each once per attention window)."""
        return sorted({prefill_rows(n, self.P) for n in range(1, self.P + 1)})

    def compile_cache_moves(self) -> None:
        """Compiles the state's moves before any request needs them, each a program of its own:
        the target cache's between every two of its lengths (the windows and T) at every slot
        bucket — `step` grows the cache when a context crosses into a larger window and cuts it
        when the long requests are gone — and the moves between every two slot buckets at
        every cache length (`_fit_slots`). Walks the live (idle) state through them."""
        if not self.idle:
            raise RuntimeError("compile_cache_moves runs on an idle engine")
        lengths = sorted({self._cache_len(w) for w in self.windows if w is not None} | {self.T})
        start_n, start_len = self.n_slots, self.st.cache.length

        def to_length(n):
            self.st = self.st.replace(cache=jax.block_until_ready(self.st.cache.resized(n)))

        for length in lengths:
            to_length(length)
            for a in self.slot_buckets:
                for b in self.slot_buckets:
                    if a != b:
                        self._resize_slots(a)
                        self._resize_slots(b)
        for n in self.slot_buckets:
            self._resize_slots(n)
            # Every slot of an idle state is free, so marking one done changes nothing.
            self.st = self.st.replace(done=_set_done(self.st.done, np.arange(n) == 0))
            for a in lengths:
                for b in lengths:
                    if a != b:
                        to_length(a)
                        to_length(b)
        self._resize_slots(start_n)
        to_length(start_len)

    def warm_buckets(self, unit: list[int]) -> dict[tuple[int, float, int], float]:
        """Runs every verification bucket of the async-scheduled loop at every slot bucket,
        greedy and sampled, at the first attention window (requests of the prompt `unit`, every
        slot busy); returns {(slots, temperature, forced bucket): packed tokens paid per cycle}.

        The buckets are branches of one compiled loop, but XLA:CPU pays ~0.7-1 s the first time
        a branch executes (measured at 8 slots, SmolLM2 bf16: a step that first ran the 27- or
        46-token bucket took 1.0-1.9 s instead of 0.2-0.3; no JAX compile logged; BENCHMARKS.md
        "Stop 35"). A warm-up of lone short requests only reaches the smallest bucket, so the
        first clients paid for the rest. The bucket a step runs is the async budget's argmax
        over the step-rate table, a traced input: a table with one bucket far ahead forces it.
        Outputs are untouched (a schedule decides only how many drafts are verified)."""
        if self.drafter is None or self.sched is None or self.settings.policy != "async":
            return {}
        new = min(4 * self.cycles_per_step, self.max_new_tokens)
        if len(unit) + new + self.K + 1 > min(self.windows or [self.T]):
            return {}
        paid = {}
        for slots in self.slot_buckets:
            loop = self.loops[slots]
            buckets = loop.settings.buckets
            for name, temp in (("greedy_sched", 0.0), ("sched", 0.7)):
                base = getattr(loop, name)
                try:
                    for u in range(len(buckets)):
                        rates = np.full(len(buckets), 1e-6, np.float32)
                        rates[u] = 1e6
                        setattr(loop, name, WindowSched.fixed(SchedArrays.make(rates, 0.0,
                                                                               base.at(self.T).threshold)))
                        b0, c0 = int(self.st.bucket_sum), int(self.st.steps)
                        for _ in range(slots):
                            self.submit(list(unit), SamplingParams(temperature=temp, seed=0, ignore_eos=True,
                                                                   max_new_tokens=new))
                        self.run()
                        paid[(slots, temp, buckets[u])] = ((int(self.st.bucket_sum) - b0)
                                                           / max(int(self.st.steps) - c0, 1))
                finally:
                    setattr(loop, name, base)
        self.finished.clear()
        return paid

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    def run(self) -> list[Request]:
        while not self.idle:
            self.step()
        return self.finished

    def step(self) -> None:
        t0 = time.perf_counter()
        self._admit()
        if any(r.status == "running" for r in self.running.values()):
            seq_len, done = np.asarray(self.st.seq_len), np.asarray(self.st.done)
            window = pick_window(self.windows, int(seq_len[~done].max(initial=0)) + self.K + 1)
            # The target's cache is sized to the window (attention over a window of a longer
            # cache copies it every step), never below a prompt still being prefilled.
            prefilling = max((r.prefilled for r in self.running.values() if r.status == "prefilling"), default=0)
            length = max(window or self.T, self._cache_len(prefilling))
            self.st = self.st.replace(cache=self.st.cache.resized(length))
            loop = self.loops[self.n_slots]
            settings, sched = ((loop.greedy_settings, loop.greedy_sched) if self.sa.all_greedy
                               else (loop.settings, loop.sched))
            arrays = None if sched is None else sched.at(length)
            if self.calibration is not None:
                arrays = arrays.replace(trust=jnp.asarray(self.calibration.trust, jnp.float32))
            self.st = decode_loop(self.target.graphdef, self.target.state, self.drafter, self.dparams, self.st,
                                  self.sa, jnp.int32(self.cycles_per_step), arrays,
                                  jnp.bool_(self.stop_on_finish),
                                  settings=dataclasses.replace(settings, kv_window=window))
            if self.calibration is not None:
                self.calibration.update(self.st.accepted_sum, self.st.budget_exp_sum)
            self._collect()
        self.busy_s += time.perf_counter() - t0

    @property
    def budget_trust(self) -> list[float] | None:
        """The pooled calibration's trust [trained drafter's rows, foreseen rows], or None
        (no async budget, or `pooled_calibration=False`)."""
        return None if self.calibration is None else [float(x) for x in self.calibration.trust]

    def counters(self) -> dict[str, Any]:
        """The decode loop's running totals since the engine started: target steps, the steps
        that ran the drafter, and packed tokens paid for (the buckets) and used (S + Σℓ);
        differences of two readings describe the steps between them. Scheduled policies add
        what the verified drafts delivered against what was expected of them, as [trained
        drafter's rows, foreseen rows (prompt lookup)]: `accepted` drafts, `budget_exp` (the
        survival the budget chose the bucket by) and `conf_exp` (this step's confidences)."""
        names = {"steps": "steps", "drafted_steps": "drafted_steps", "bucket_tokens": "bucket_sum",
                 "budget_tokens": "budget_sum"}
        out = {k: int(getattr(self.st, f)) for k, f in names.items() if getattr(self.st, f) is not None}
        for f in ("accepted_sum", "budget_exp_sum", "conf_exp_sum"):
            v = getattr(self.st, f)
            if v is not None:
                out[f.removesuffix("_sum")] = [float(x) for x in np.asarray(v)]
        return out

    def stats(self) -> dict[str, Any]:
        done = [r for r in self.finished if r.status == "finished"]
        st = {"requests_finished": len(done), "requests_cancelled": len(self.finished) - len(done),
              "tokens_out": self.tokens_out, "tokens_per_s": self.tokens_out / max(self.busy_s, 1e-9)}
        if done:
            st["mean_queue_s"] = float(np.mean([r.stats["queue_s"] for r in done]))
            if self.drafter is not None:
                st["tau"] = float(np.mean([r.stats["tau"] for r in done]))
        return st

    # ------------------------------------------------------------------ internals

    def _cache_len(self, need: int) -> int:
        """The cache length (a window, or T) that holds `need` positions."""
        return pick_window(self.windows, need) or self.T

    def _admit(self):
        """Free slots take queued requests; every prefilling slot gets its next prompt chunk
        (P packed tokens per step in all, so a long prompt takes several steps while the
        other slots keep decoding). First the state moves to the slot bucket that fits the
        requests in flight (running and queued)."""
        self._fit_slots()
        S = self.n_slots
        for slot in range(S):
            if self.queue and slot not in self.running:
                req = self.queue.popleft()
                req.status, req.slot, req.started_at = "prefilling", slot, time.perf_counter()
                self.running[slot] = req
        seq_len = np.zeros(S, np.int32)
        chunk, final = np.zeros(S, bool), np.zeros(S, bool)
        max_new, seeds = np.ones(S, np.int32), [0] * S
        stop_ids = np.full((S, self.M), -1, np.int32)
        logits = [None] * S
        cache, dcache = self.st.cache, self.st.dcache
        used = 0
        for slot in range(S):
            req = self.running.get(slot)
            if req is None or req.status != "prefilling" or used == self.P:
                continue
            # P prompt tokens per step in all, so a long prompt takes several steps while the
            # other slots keep decoding; each chunk costs its own rows against its own context.
            n = min(len(req.prompt_ids) - req.prefilled, self.P - used)
            # The chunk's query rows are its own (`prefill_rows`: 16, 32, 48, 64, 96, …): a short
            # prompt pays for its tokens, not for the step's whole budget P.
            # The cache is sized to the decode window: grown here when this prompt needs more.
            # The chunk runs on its row cut to the prompt's own window (`prefill_one`).
            window = pick_window(self.windows, req.prefilled + n)
            if cache.length < self._cache_len(req.prefilled + n):
                cache = cache.resized(self._cache_len(req.prefilled + n))
            logits[slot], cache, dcache = prefill_one(
                self.target.graphdef, self.target.state, self.drafter, self.dparams, cache, dcache, slot,
                req.prompt_ids[req.prefilled: req.prefilled + n], req.prefilled, max_rows=self.P, kv_window=window)
            chunk[slot] = True
            used += n
            req.prefilled += n
            seq_len[slot] = req.prefilled
            if req.prefilled == len(req.prompt_ids):
                final[slot] = True
                sp = req.sampling
                req.seed = resolve_seed(sp.seed)  # None → fresh, recorded on the request
                max_new[slot], seeds[slot] = sp.max_new_tokens, req.seed
                stops = request_stop_ids(sp, self.target.eos_token_ids)
                if len(stops) > self.M:
                    raise ValueError(f"request {req.id} has {len(stops)} stop token ids; the engine holds {self.M}")
                stop_ids[slot, : len(stops)] = stops
                self.slot_params[slot] = sp
        if not chunk.any():
            return
        if final.any():
            self.sa = self._sampling_arrays()
        V = self.target.cfg.vocab_size
        logits_SV = jnp.stack([lg if lg is not None else jnp.zeros((V,), jnp.float32) for lg in logits])
        # Admission reads and writes no cache: they stay out of its program, which therefore
        # does not depend on the cache's current length (one program, not one per window).
        st = admit(self.st.replace(cache=None, dcache=None), logits_SV, jnp.asarray(seq_len), jnp.asarray(chunk),
                   jnp.asarray(final), jnp.asarray(max_new), request_keys(seeds), jnp.asarray(stop_ids), self.sa,
                   self.prior)
        self.st = st.replace(cache=cache, dcache=dcache)
        for slot in np.flatnonzero(final):
            self.running[int(slot)].status = "running"
        self._collect()  # first tokens (and requests that stop on them)

    def _fit_slots(self) -> None:
        """Grows the decode state to the smallest slot bucket that holds every request in flight
        (capped at S), or shrinks it once they fit half of it."""
        need = len(self.running) + len(self.queue)
        want = next((b for b in self.slot_buckets if b >= need), self.S)
        if want != self.n_slots:
            self._resize_slots(want)

    def _resize_slots(self, n: int) -> None:
        """Moves the decode state to `n` slots in one copy (`take_state_slots`): the running and
        prefilling requests first, in slot order, to slots 0, 1, …; then free slots (done, their
        stale rows overwritten on admission). Requests keep their keys, caches and scheduler
        state; only their slot numbers change."""
        old = self.n_slots
        if n == old:
            return
        busy = sorted(self.running)
        if len(busy) > n:
            raise RuntimeError(f"{len(busy)} requests in flight do not fit {n} slots")
        free = [s for s in range(old) if s not in self.running]
        idx = (busy + free + [0] * n)[:n]  # growing: the extra rows are copies, marked done below
        st = take_state_slots(self.st, jnp.asarray(idx, jnp.int32), drafter=self.drafter)
        if n > old:
            st = st.replace(done=_set_done(st.done, np.arange(n) >= old))
        self.st = self._place(st)
        self.running = {new: self.running[s] for new, s in enumerate(busy)}
        for new, req in self.running.items():
            req.slot = new
        greedy = SamplingParams(temperature=0.0)
        self.slot_params = [self.slot_params[s] for s in busy] + [greedy] * (n - len(busy))
        self.sa = self._sampling_arrays()
        self.used_slot_buckets.add(n)

    def _collect(self):
        out, n_out, done = np.asarray(self.st.out), np.asarray(self.st.n_out), np.asarray(self.st.done)
        for slot, req in list(self.running.items()):
            if req.status != "running":
                continue
            new = out[slot, len(req.tokens): n_out[slot]].tolist()
            finished = bool(done[slot])
            reason = "stop" if finished and n_out[slot] < req.sampling.max_new_tokens else "length"
            if req.sampling.stop and new:
                cut = stop_string_cut(self.target.tokenizer.decode, req.tokens + new, req.sampling.stop)
                if cut is not None:
                    new = cut[0][len(req.tokens):]
                    req.text = cut[1]
                    finished, reason = True, "stop"
                    self.st = self.st.replace(done=_set_done(self.st.done, np.arange(self.n_slots) == slot))
            if new:
                req.tokens += new
                self.tokens_out += len(new)
                if req.on_token is not None:
                    req.on_token(req, new)
            if finished:
                self._finish(req, reason)

    def _finish(self, req: Request, reason: str):
        req.status = "cancelled" if reason == "cancelled" else "finished"
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            s = req.slot
            cycles = int(self.st.cycles[s])
            req.stats = {"queue_s": req.started_at - req.submitted_at,
                         "latency_s": req.finished_at - req.submitted_at, "cycles": cycles,
                         "tau": int(self.st.tau_sum[s]) / max(cycles, 1), "verified": int(self.st.verified[s])}
            # A free slot counts as greedy: a sampled request's settings left on its slot kept
            # every later batch off the greedy program (and its step-rate table) until another
            # request took that slot.
            if not self.slot_params[s].greedy:
                self.slot_params[s] = SamplingParams(temperature=0.0)
                self.sa = self._sampling_arrays()
        else:
            req.stats = {"queue_s": None}
        if req.text is None and self.target.tokenizer is not None:
            req.text = self.target.tokenizer.decode(req.tokens)
        self.finished.append(req)
