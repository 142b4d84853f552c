"""`generate()`: the public, batched entry point (autoregressive or speculative).

Host side, in four steps: `_plan` renders/tokenises the prompts, validates them and picks
static buckets (batch, cache length, output buffer, prefill size) so that repeated calls of
similar size compile nothing new; `_prefill` writes each prompt into its slot; `_run` drives
the jitted decode loop (in chunks when stop strings need a host check, moving to larger
attention windows and compacting finished slots); `_report` detokenises and gathers the
statistics.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import compile_stats
from dspark_jax.decoding.decode_config import DecodeConfig
from dspark_jax.decoding.decode_loop import (
    GenState,
    LoopSettings,
    SchedArrays,
    decode_loop,
    should_compact,
    stop_id_table,
    take_slots,
)
from dspark_jax.decoding.prefill import next_pow2, prefill, prefill_one, start_decoding
from dspark_jax.decoding.profiling import StepRates, default_buckets, profile_window_rates
from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams
from dspark_jax.decoding.seeds import request_keys, resolve_seed
from dspark_jax.decoding.stop_strings import stop_string_cut
from dspark_jax.models.target import Target


class GenerationStats(TypedDict, total=False):
    """`GenerationOutput.stats`: a dict with these keys (the drafter ones only with a drafter)."""

    policy: str  # the policy that ran: "ar", "fixed", "dspark" or "threshold"
    num_draft: int  # K, drafts per request per cycle (0 autoregressive)
    prefill_s: float  # wall time of prefill (all prompts, first tokens sampled)
    decode_s: float  # wall time of decoding after prefill
    new_tokens: int  # tokens generated, all requests
    compile_s: float  # XLA compile time inside this call (0 when warm)
    compiles: int  # programs compiled inside this call
    tokens_per_s: float  # new_tokens ÷ (prefill + decode − compile)
    cycles: list[int]  # draft-and-verify cycles (target steps) per request
    seeds: list[int]  # each request's seed (rerun with these to reproduce sampled outputs)
    buckets: dict[str, Any]  # static shapes: slots, cache_len, out_len, prefill sizes, windows, slot buckets
    tau: float  # tokens per target step (accepted + 1, averaged over cycles)
    acceptance_per_position: list[float]  # P(draft k accepted | verified and reached), k = 1..K
    verified_per_request: list[int]  # Σ ℓ_r: drafts sent to the target, per request
    mean_verified: list[float]  # drafts verified per cycle, per request
    budget_per_step: float  # packed tokens used per target step (S + Σ ℓ)
    steps: int  # target steps the decode loop ran (with a drafter)
    bucket_per_step: float  # packed tokens paid for per step (the bucket)
    drafted_steps: float  # fraction of steps that ran the drafter (< 1 when async skipped it)
    step_rates: dict[str, Any]  # the scheduler's step-rate table (at the whole cache)
    window_step_rates: dict[int, dict[str, Any]]  # the tables at the cache lengths the loop ran at
    scheduler: str  # "async", "sync", "threshold" or "custom" (scheduled policies)


@dataclasses.dataclass
class GenerationOutput:
    texts: list[str]
    token_ids: list[list[int]]
    stats: GenerationStats


MIN_WINDOW = 256  # smallest attention window (cache-length bucket); windows double up to the cache


def attention_windows(cache_len: int, minimum: int = MIN_WINDOW, fine: bool = False) -> list[int]:
    """The attention windows below the cache length, doubling from `minimum`; the whole cache
    (None) follows the last one. At most log2(cache_len / minimum) + 1 compiled loops.
    `fine`: a 1.5× step between each two (256, 384, 512, 768, …), so a window wastes at most
    a third of its reads instead of half, at about twice the compiled loops."""
    out, w = [], minimum
    while w < cache_len:
        out.append(w)
        if fine and w * 3 // 2 < cache_len:
            out.append(w * 3 // 2)
        w *= 2
    return out


def pick_window(windows: list[int], need: int) -> int | None:
    """The smallest window holding `need` positions (None: the whole cache)."""
    return next((w for w in windows if need <= w), None)


def encode_prompt(target: Target, prompt) -> list[int]:
    """A prompt is a string (as is), a list of chat messages (chat template), or token ids."""
    tok = target.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError("this target has no tokenizer; pass prompts as lists of token ids")
        ids = tok.encode(prompt)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        if tok is None:
            raise ValueError("this target has no tokenizer; chat prompts need one")
        ids = tok.encode(tok.apply_chat_template(list(prompt), add_generation_prompt=True))
    elif isinstance(prompt, Sequence | np.ndarray) and all(
        isinstance(t, int | np.integer) for t in prompt
    ):
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(
            "each prompt must be a string, a list of chat messages ({'role', 'content'} dicts) "
            f"or a list of token ids; got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError("empty prompt: a prompt needs at least one token")
    V = target.cfg.vocab_size
    if min(ids) < 0 or max(ids) >= V:
        raise ValueError(f"prompt token ids must lie in [0, {V}); got min {min(ids)}, max {max(ids)}")
    return ids


def _normalize_prompts(prompts):
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], dict):
        return [prompts]  # one chat
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int | np.integer):
        return [prompts]  # one list of ids
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list")
    return list(prompts)


def generate(
    target: Target,
    prompts,
    *,
    drafter=None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    policy: str | None = None,
    num_draft: int | None = None,
    chunk_cycles: int = 16,
    prefill_chunk: int = 512,
    batched_prefill: bool = False,
    scheduler="async",
    threshold: float = 0.5,
    step_rates=None,
    reprofile: bool = False,
    windowed_attention: bool = True,
    compact_slots: bool = True,
    config: DecodeConfig | None = None,
) -> GenerationOutput:
    """Generates continuations of a batch of prompts; lossless with or without a drafter.

    policy: None / "ar" (autoregressive; the drafter is ignored), "fixed" (verify
    `num_draft` ≤ γ drafts per cycle; default γ), "dspark" (the confidence scheduler
    `scheduler`: "async" (default) or "sync"; a callable
    (conf [S, K], active [S], caps [S], rates [U], buckets) -> lengths [S] is run in place
    of "sync"), "threshold" (verify drafts whose survival is ≥ `threshold`).
    step_rates: the step-rate table of "dspark" — a `StepRates`, or a mapping
    {packed tokens: steps/s} whose keys become the buckets, used at every attention window;
    None profiles it at the smallest window and the whole cache, linear in between, and
    each loop schedules with its window's table (cached on disk; `reprofile=True` measures
    again).

    prefill_chunk: prompt tokens per prefill step (a static size). Prefill memory grows with
    chunk × cache length rather than prompt × cache length; 512 keeps a SmolLM2 prompt at its
    full 8k context well inside a few GB. Each prompt is prefilled on its own (`prefill_one`:
    its query rows against its own context), so prefill costs the sum over the prompts.
    `batched_prefill=True`: the older single program over all slots' packed prompts (one
    dispatch, but a [slots, chunk] query grid per chunk; kept for comparison).

    windowed_attention: attention (target and drafter) reads only a window of the cache that
    covers every active request's context — 256 positions, doubled as contexts grow — so a
    step costs what the used context costs, not the allocated cache; each window compiles
    once (at most log2(cache / 256) + 1 decode loops). False: always the whole cache.
    (`DecodeConfig.fine_windows`: 1.5× steps between the doublings.)

    compact_slots: with fixed-length or autoregressive decoding, once at most half of the
    slots are still active (and one has ≥ 32 tokens to go), the active ones move into the
    next smaller slot bucket (a power of two), so finished requests cost nothing. Each slot
    bucket compiles once. The confidence schedulers keep their slots (their step-rate table
    is profiled per slot count).

    config: all of the above but `step_rates` / `reprofile` as one `DecodeConfig` (the
    serving engine takes the same); give either it or the options one by one.
    """
    config = DecodeConfig.pick(config, policy=policy, num_draft=num_draft, scheduler=scheduler, threshold=threshold,
                               windowed_attention=windowed_attention, compact_slots=compact_slots,
                               chunk_cycles=chunk_cycles, prefill_chunk=prefill_chunk,
                               batched_prefill=batched_prefill)
    policy, drafter, K = config.resolve(target, drafter)
    plan = _plan(target, prompts, sampling, config, K)
    st, sa = _initial_state(target, drafter, plan)
    settings, sched = loop_settings(target, drafter, config.loop_schedule(policy), K, plan.S, plan.T,
                                    config.threshold, step_rates, reprofile, greedy=sa.all_greedy,
                                    windows=plan.windows, widths=config.bucket_widths)
    c0, cs0 = compile_stats.snapshot()
    t0 = time.perf_counter()
    st = _prefill(target, drafter, st, sa, plan, config)
    jax.block_until_ready(st.n_out)
    t1 = time.perf_counter()
    run = _run(target, drafter, st, sa, plan, config, settings, sched)
    t2 = time.perf_counter()
    c1, cs1 = compile_stats.snapshot()
    return _report(target, drafter, plan, run, policy, settings, sched,
                   prefill_s=t1 - t0, decode_s=t2 - t1, compiles=c1 - c0, compile_s=cs1 - cs0)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one `generate()` call runs: the encoded prompts and their sampling, and the static
    buckets — S slots, T cache length, O output buffer, the prefill query rows and chunk — so
    that a later call of similar size compiles nothing new."""

    ids: list[list[int]]
    params: list[SamplingParams]
    seeds: list[int]
    K: int  # drafts verified per cycle (the loop's static maximum)
    S: int
    T: int
    O: int
    q_prefill: int
    chunk: int
    windows: list[int]  # attention windows ([] = always the whole cache)

    @property
    def B(self) -> int:
        return len(self.ids)


def _plan(target: Target, prompts, sampling, config: DecodeConfig, K: int) -> _Plan:
    """Validates the request batch (bad input raises before anything runs) and picks buckets."""
    prompts = _normalize_prompts(prompts)
    B = len(prompts)
    if sampling is None:
        sampling = SamplingParams()
    params = list(sampling) if isinstance(sampling, Sequence) else [sampling] * B
    if len(params) != B:
        raise ValueError(f"got {len(params)} SamplingParams for {B} prompts")
    ids = [encode_prompt(target, p) for p in prompts]
    cfg = target.cfg
    for i, (x, sp) in enumerate(zip(ids, params)):
        if len(x) + sp.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {len(x)} tokens; with max_new_tokens={sp.max_new_tokens} that exceeds "
                f"the model's context of {cfg.max_position_embeddings} tokens"
            )
    if any(sp.stop for sp in params) and target.tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    S = next_pow2(B)
    max_new = max(sp.max_new_tokens for sp in params)
    # Capped at the context: a prompt that fits the model never gets a cache twice its size.
    # Positions past the cap are only ever written by scratch drafts beyond max_new (dropped).
    T = min(next_pow2(max(len(x) for x in ids) + max_new + K + 1, 128), cfg.max_position_embeddings)
    q_prefill = min(next_pow2(max(len(x) for x in ids), 16), cfg.max_position_embeddings)
    return _Plan(ids=ids, params=params, seeds=[resolve_seed(sp.seed) for sp in params], K=K, S=S, T=T,
                 O=next_pow2(max_new) + K + 1, q_prefill=q_prefill,
                 chunk=min(config.prefill_chunk, q_prefill),  # prompt tokens per prefill step of one request
                 windows=attention_windows(T, fine=config.fine_windows) if config.windowed_attention else [])


def _initial_state(target: Target, drafter, plan: _Plan) -> tuple[GenState, SamplingArrays]:
    """The decode state (empty caches, per-slot limits, keys and stop ids) and the sampling
    arrays; padding slots are inactive and greedy."""
    S, B = plan.S, plan.B
    sa = SamplingArrays.from_params(plan.params + [SamplingParams(temperature=0.0)] * (S - B))
    max_new = np.ones(S, np.int32)
    max_new[:B] = [sp.max_new_tokens for sp in plan.params]
    keys = request_keys(plan.seeds + [0] * (S - B))  # padding rows: any fixed key
    st = GenState.create(target.cfg, drafter, drafter.params if drafter is not None else None, slots=S,
                         cache_len=plan.T, out_len=plan.O, num_draft=plan.K, active=np.arange(S) < B,
                         max_new=max_new, keys=keys, stop_ids=stop_id_table(plan.params, target.eos_token_ids, S),
                         sa=sa)
    return st, sa


def _prefill(target: Target, drafter, st: GenState, sa: SamplingArrays, plan: _Plan, config: DecodeConfig) -> GenState:
    """Writes every prompt into its slot's caches and samples each request's first token."""
    dparams = drafter.params if drafter is not None else None
    ids, S, B = plan.ids, plan.S, plan.B
    lens = np.zeros(S, np.int32)
    lens[:B] = [len(x) for x in ids]
    if config.batched_prefill:
        tokens = np.zeros(next_pow2(int(lens.sum()), 16), np.int32)
        tokens[: lens.sum()] = np.concatenate(ids)
        return prefill(target.graphdef, target.state, drafter, dparams, st, jnp.asarray(tokens), jnp.asarray(lens), sa,
                       q_max=plan.q_prefill, chunk=min(config.prefill_chunk, tokens.size),
                       kv_window=pick_window(plan.windows, int(lens.max())))
    # One request at a time, each into its own cache row: cost Σ over the prompts (the
    # batched program's [S, chunk] query grid grows with S²). Each prompt runs in its own
    # buckets — query rows of its own pieces (`prefill_pieces`), the attention window that
    # holds it — so a short prompt never pays for the batch's longest (one program per bucket).
    cache, dcache = st.cache, st.dcache
    last = []
    for i, x in enumerate(ids):
        lg, cache, dcache = prefill_one(target.graphdef, target.state, drafter, dparams, cache, dcache, i, x,
                                        max_rows=plan.chunk, kv_window=pick_window(plan.windows, len(x)))
        last.append(lg)
    logits = jnp.stack(last + [jnp.zeros_like(last[0])] * (S - B))
    return start_decoding(st.replace(cache=cache, dcache=dcache), logits, jnp.asarray(lens), sa)


@dataclasses.dataclass
class _Run:
    """What the decode loop left: the last state, each request's saved results (`final`), the
    stop-string cuts, and the attention windows and slot buckets it ran in."""

    st: GenState
    final: dict[int, dict[str, np.ndarray]]
    cut: dict[int, tuple[list[int], str]]
    windows: list[int]
    slot_buckets: list[int]


def _run(target: Target, drafter, st: GenState, sa: SamplingArrays, plan: _Plan, config: DecodeConfig,
         settings: LoopSettings, sched: WindowSched | None) -> _Run:
    """Runs the jitted decode loop until every request is done: in one call, or in chunks of
    `chunk_cycles` when stop strings need a host check, moving to a bigger attention window as
    contexts grow and compacting the slots as requests finish."""
    params, S, B, K = plan.params, plan.S, plan.B, plan.K
    dparams = drafter.params if drafter is not None else None
    max_new = max(sp.max_new_tokens for sp in params)
    use_host_stops = any(sp.stop for sp in params)
    cut: dict[int, tuple[list[int], str]] = {}
    used_windows, used_slots = [], [S]
    # Slot compaction (fixed-length and autoregressive decoding): when at most half the slots
    # are still active, they move into the next smaller slot bucket, so finished requests
    # stop costing drafting, target and verification work.
    compact = config.compact_slots and settings.policy == "fixed" and S > 1
    rows = np.where(np.arange(S) < B, np.arange(S), -1)  # request of each slot (-1: padding)
    final: dict[int, dict[str, np.ndarray]] = {}  # per-request results of slots compacted away
    done = np.array(st.done)
    while True:
        # Without stop strings one call runs to the end (or to the end of its attention
        # window, or until the slots compact); with them, chunks let the host stop early.
        max_cycles = config.chunk_cycles if use_host_stops else max_new + 1
        seq_len = np.asarray(st.seq_len)
        window = pick_window(plan.windows, int(seq_len[~done].max(initial=0)) + K + 1)
        if window not in used_windows:
            used_windows.append(window)
        # The target's cache is cut (or grown) to the window once, here: attention over a
        # window of a longer cache would copy that window out every step (KVCache).
        st = st.replace(cache=st.cache.resized(window or plan.T))
        n_slots = len(rows)
        loop = dataclasses.replace(settings, kv_window=window, compact_at=n_slots // 2 if compact else 0,
                                   makespan=config.makespan and settings.policy == "async")
        st = decode_loop(target.graphdef, target.state, drafter, dparams, st, sa,
                         jnp.int32(max_cycles), sched.at(window or plan.T) if sched is not None else None,
                         settings=loop)
        done = np.array(st.done)  # a writable copy: np.asarray of a jax.Array is read-only
        if use_host_stops:
            out, n_out = np.asarray(st.out), np.asarray(st.n_out)
            newly = []
            for r, i in enumerate(rows):
                if i >= 0 and i not in cut and params[i].stop:
                    c = stop_string_cut(target.tokenizer.decode, out[r, : n_out[r]].tolist(), params[i].stop)
                    if c is not None:
                        cut[i] = c
                        newly.append(r)
            if newly:
                done[newly] = True
                st = st.replace(done=jnp.asarray(done))
        if done.all():
            break
        if loop.compact_at and bool(should_compact(st, loop)):
            keep = np.flatnonzero(~done)
            n_new = next_pow2(len(keep))
            pad = np.flatnonzero(done)[: n_new - len(keep)]  # finished slots as padding
            _save_rows(final, st, rows, np.flatnonzero(done))
            idx = np.concatenate([keep, pad])
            st, sa = take_slots(st, sa, jnp.asarray(idx, jnp.int32), drafter=drafter)
            rows = np.concatenate([rows[keep], np.full(len(pad), -1)])
            done = np.array(st.done)
            used_slots.append(n_new)
    _save_rows(final, st, rows, np.arange(len(rows)))
    return _Run(st=st, final=final, cut=cut, windows=used_windows, slot_buckets=used_slots)


def _report(target: Target, drafter, plan: _Plan, run: _Run, policy, settings: LoopSettings,
            sched: WindowSched | None, *,
            prefill_s: float, decode_s: float, compiles: int, compile_s: float) -> GenerationOutput:
    """Texts, token ids and `GenerationStats` of a finished run."""
    B, final, cut, st = plan.B, run.final, run.cut, run.st
    token_ids, texts = [], []
    for i in range(B):
        if i in cut:
            token_ids.append(cut[i][0])
            texts.append(cut[i][1])
            continue
        t = final[i]["out"][: final[i]["n_out"]].tolist()
        token_ids.append(t)
        texts.append(target.tokenizer.decode(t) if target.tokenizer is not None else "")
    n_tok = int(sum(len(t) for t in token_ids))

    def per_request(name):
        return np.stack([final[i][name] for i in range(B)])

    cycles = per_request("cycles")
    stats: GenerationStats = {
        "policy": policy,
        "num_draft": plan.K,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "new_tokens": n_tok,
        "compile_s": compile_s,
        "compiles": compiles,
        # Throughput excludes compile time (zero on a warm call with the same buckets).
        "tokens_per_s": n_tok / max(prefill_s + decode_s - compile_s, 1e-9),
        "cycles": cycles.tolist(),
        "seeds": plan.seeds,  # what each request ran with (drawn fresh where seed=None): rerun with these
        "buckets": {"slots": plan.S, "cache_len": plan.T, "out_len": plan.O, "prefill_tokens": plan.q_prefill,
                    "prefill_chunk": plan.chunk, "attention_windows": [w or plan.T for w in run.windows],
                    "slot_buckets": run.slot_buckets},
    }
    if drafter is not None:
        reached = per_request("reached").sum(0)
        acc = per_request("accepted_at").sum(0)
        stats["tau"] = float(per_request("tau_sum").sum() / max(cycles.sum(), 1))
        stats["acceptance_per_position"] = (acc / np.maximum(reached, 1)).tolist()
        verified = per_request("verified")
        steps = max(int(st.steps), 1)
        stats["verified_per_request"] = verified.tolist()  # Σ ℓ_r: drafts sent to the target
        stats["mean_verified"] = (verified / np.maximum(cycles, 1)).tolist()  # per cycle
        stats["steps"] = int(st.steps)  # target steps the loop ran (each verifies every running slot)
        stats["budget_per_step"] = int(st.budget_sum) / steps  # packed tokens used, N = S + Σℓ
        stats["bucket_per_step"] = int(st.bucket_sum) / steps  # packed tokens paid for
        stats["drafted_steps"] = int(st.drafted_steps) / steps  # < 1 when async skipped drafting
        if sched is not None and sched.tables:
            stats["step_rates"] = sched.table(plan.T).to_dict()
            if len(sched.tables) > 1:  # one per cache length the loop ran at (and the whole cache)
                stats["window_step_rates"] = {t: sched.table(t).to_dict()
                                              for t in sorted({w or plan.T for w in run.windows} | {plan.T})}
        if settings.policy != "fixed":
            stats["scheduler"] = settings.policy if isinstance(settings.policy, str) else "custom"
            # The verified drafts' acceptance against the survival the scheduler expected of them
            # (the budget's online-calibrated confidences; this step's own): a calibration check.
            tally = {k: np.asarray(getattr(st, f"{k}_sum")) for k in ("accepted", "budget_exp", "conf_exp")}
            stats["calibration"] = {kind: {k: float(v[i]) for k, v in tally.items()}
                                    for i, kind in enumerate(("drafter", "foreseen"))}
    return GenerationOutput(texts, token_ids, stats)


_SAVED = ("out", "n_out", "cycles", "tau_sum", "reached", "accepted_at", "verified")


def _save_rows(final: dict, st: GenState, rows: np.ndarray, which) -> None:
    """Copies the results of slots `which` into `final[request]` (padding slots are skipped)."""
    which = [r for r in which if rows[r] >= 0 and rows[r] not in final]
    if not which:
        return
    host = {f: np.asarray(getattr(st, f)) for f in _SAVED}
    for r in which:
        final[int(rows[r])] = {f: host[f][r] for f in _SAVED}


@dataclasses.dataclass(frozen=True)
class WindowSched:
    """The scheduled policies' traced inputs per cache length a decode loop runs at (its
    attention windows and its whole cache), each from that length's step-rate table. A
    step's attention reads the window, so where drafting pays moves with it; the arrays are
    traced inputs, so switching between them compiles nothing."""

    arrays: dict[int, SchedArrays]
    tables: dict[int, StepRates]

    def at(self, length: int) -> SchedArrays:
        """The arrays of the smallest profiled length that holds `length` (else the longest)."""
        return self.arrays[self._length(length)]

    def table(self, length: int) -> StepRates:
        return self.tables[self._length(length)]

    def _length(self, length: int) -> int:
        return next((t for t in sorted(self.arrays) if t >= length), max(self.arrays))

    @classmethod
    def fixed(cls, sched: SchedArrays, table: StepRates | None = None) -> WindowSched:
        """One set of arrays at every length (a table given by the caller, or a forced one)."""
        return cls({0: sched}, {0: table} if table is not None else {})


def loop_settings(target, drafter, name, K, S, T, threshold, step_rates, reprofile, greedy=False, windows=(),
                  widths=None):
    """(LoopSettings, WindowSched or None) for the cycle's schedule `name`
    (`DecodeConfig.loop_schedule`). `greedy` (every request at T = 0) profiles the cheaper
    greedy cycle (no draft distributions, argmax verification) instead of the sampled one.
    A profiled table is measured per cache length the loop runs at — `windows` (the
    attention windows below T) and T (`profile_window_rates`); a given `step_rates` holds
    at every length. `widths` (`DecodeConfig.bucket_widths`): the profiled buckets' query grids."""
    if drafter is None or name == "fixed":
        return LoopSettings(num_draft=K), None
    widths = None if widths == "full" else widths
    if isinstance(step_rates, StepRates):
        if step_rates.slots != S:
            raise ValueError(f"step_rates were measured for {step_rates.slots} slots, but this call runs {S} "
                             "(the batch rounded up to a power of two); profile the table for that slot count")
        tables = {T: step_rates}
    elif step_rates is not None:
        tables = {T: StepRates.from_mapping(step_rates, slots=S)}
    elif name == "threshold":  # needs buckets, not rates
        tables = {T: StepRates.from_mapping({n: 1.0 for n in default_buckets(S, K)}, slots=S)}
    else:
        tables = profile_window_rates(target, drafter, slots=S, num_draft=K, lengths=[*windows, T],
                                      reprofile=reprofile, greedy=greedy, widths=widths)
    table = tables[T]
    buckets = tuple(n for n in table.buckets if n <= S * (K + 1))
    if not buckets or buckets[-1] < S:
        raise ValueError(f"the step-rate table's buckets {table.buckets} need one of at least {S} packed "
                         f"tokens (the anchors of {S} slots) and at most {S * (K + 1)}")
    widths = tuple(table.widths[: len(buckets)]) if table.widths is not None else ()
    settings = LoopSettings(num_draft=K, policy=name, buckets=buckets, bucket_widths=widths)
    arrays = {t: SchedArrays.make(tb.rates[: len(buckets)], tb.skip_rate, threshold) for t, tb in tables.items()}
    return settings, WindowSched(arrays, tables)
