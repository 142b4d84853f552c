"""The on-device decode loop: the decode state, one speculative (or autoregressive) cycle, the loop.

Shape letters (docs/architecture.md, "Shape letters"): S request slots, G draft positions per cycle (γ), N
packed tokens (≤ S·(G+1)), U packed-token buckets, T cache length, O output buffer, J one
cycle's tokens, M stop ids, V vocab, F tapped target features.

One cycle (docs/method.md §5, docs/architecture.md): draft → choose ℓ_r ≤ G per slot → pack [anchor, d_1..d_ℓ] of
every slot into one static bucket → one packed target step (logits + features) →
verify → commit (rejected cache positions are overwritten later, never read) → append the
features of anchor + accepted drafts to the drafter's context cache → the last emitted
token is the next anchor. Autoregressive decoding is the same cycle with K = 0 and no
drafter: verification with zero drafts is exactly sampling from the target.

Policies (`LoopSettings.policy`): "fixed" verifies min(K, cap) drafts per slot in one
bucket of S·(K+1) tokens. The confidence schedulers ("sync", "async", "threshold";
`scheduler.py`) choose ℓ_r from the drafter's calibrated confidences and a step-rate table
(an array argument), and `lax.switch` runs the packed target step compiled for the chosen
bucket, so a smaller budget makes a cheaper step. "async" chooses the bucket before
drafting, from earlier confidences calibrated online against observed acceptances, and
skips the drafter when verifying anchors only pays.

A drafter plugs in through three pure methods (called inside jit; the drafter object is a
static argument, its parameters a traced one):
  init_cache(params, num_slots, length) -> cache pytree
  append(params, cache, target, feats [N, F], slot [N], pos [N], valid [N]) -> cache
      (a drafter with `reads_tokens = True` also gets `tokens_N=` the committed tokens)
  draft(params, cache, target, anchor [S], anchor_pos [S], keys [S], sa)
      -> tokens [S, γ], transformed logits [S, γ, V], confidences [S, γ]
and the attributes `block_size` (γ) and `feature_layers` (target layer ids it reads).
Optional: `take_slots(cache, idx) -> cache` for slot compaction when its cache is not a
`KVCache` [L, S, T, ...] (which is sliced to the attention window and compacted as is).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspark_jax.decoding.sampling import SamplingArrays
from dspark_jax.decoding.scheduler import async_budget, bucket_for, check_widths, schedule_lengths, survival
from dspark_jax.decoding.verification import verify
from dspark_jax.models.transformer import KVCache, StepKV, packed_layout


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Static shape settings of one compiled decode loop."""

    num_draft: int  # K: drafts verified per request per cycle (0 = autoregressive)
    # "fixed" (verify min(K, cap) drafts, one bucket of S·(K+1) tokens), or a confidence
    # scheduler: "sync", "async", "threshold", or a callable
    # (conf [S, K], active [S], caps [S], rates [U], buckets) -> lengths [S].
    policy: Any = "fixed"
    buckets: tuple[int, ...] = ()  # packed-token buckets of the scheduled policies, ascending
    # Tokens a slot (anchor + drafts) of each bucket's query grid, non-decreasing, the largest
    # K + 1; () = K + 1 for every bucket. A step's attention runs over the [S, width] grid
    # whatever its packed tokens, so a narrow grid makes a small bucket cheaper (`StepRates`).
    bucket_widths: tuple[int, ...] = ()
    # async: the budget's confidences are calibrated online per slot (see `cycle`): observed
    # acceptances, decayed by `calib_decay` per cycle, against the drafter's own confidences
    # worth `calib_prior` observations.
    calib_decay: float = 0.99
    calib_prior: float = 0.5
    # Attention window (cache-length bucket): the target, and a drafter whose context cache
    # is a KVCache, attend over the first `kv_window` cache positions only; the loop stops
    # before a cycle could reach past it, and the host continues with the next, doubled
    # window. None: the whole cache. The hosts (`generate`, the serving engine) size the
    # target's cache to the window (`KVCache.resized`), so only the drafter's is sliced.
    kv_window: int | None = None
    # Slot compaction: the loop also stops when at most `compact_at` slots are still active
    # and one of them has at least `compact_min_tokens` tokens to go; the host then gathers the
    # active slots into a smaller slot bucket (`take_slots`), so finished requests stop costing
    # anything. 0: never.
    compact_at: int = 0
    compact_min_tokens: int = 32
    # A static batch (`generate()`) ends with its slowest request: the async budget then
    # weighs a step by the progress of the slots that could finish last (those within K
    # tokens of the most tokens to go), and only they draft. The serving engine, whose free
    # slots take the next request at once, maximises tokens/s (False).
    makespan: bool = False
    # Calibration (fixed policy only): the drafter reports its confidence logits before STS
    # (`draft(raw_confidence=True)`), and `prev_conf` records them per cycle.
    raw_confidence: bool = False

    def __post_init__(self):
        if self.bucket_widths:
            check_widths(self.bucket_widths, self.buckets, self.num_draft)
        if self.raw_confidence and self.policy != "fixed":
            raise ValueError("raw_confidence (calibration) runs with the fixed policy only: the "
                             "schedulers read calibrated confidences")


@struct.dataclass
class SchedArrays:
    """Traced inputs of the scheduled policies (changing them compiles nothing)."""

    rates: jax.Array  # [U] steps/s of draft + verify at each bucket
    skip_rate: jax.Array  # [] steps/s of a step that does not draft (0 = never skip)
    threshold: jax.Array  # [] survival threshold of policy "threshold"
    # [2] async: what the budget expects of a draft is scaled by this, per kind of row (the
    # trained drafter's, foreseen rows): the serving engine's calibration pooled over requests
    # (`serve.engine.PooledCalibration`): accepted drafts against what the budget expected, over
    # the requests it served. 1: each request's own online calibration alone.
    trust: jax.Array | None = None

    @classmethod
    def make(cls, rates, skip_rate=0.0, threshold=0.0, trust=(1.0, 1.0)) -> SchedArrays:
        return cls(jnp.asarray(rates, jnp.float32), jnp.asarray(skip_rate, jnp.float32),
                   jnp.asarray(threshold, jnp.float32), jnp.asarray(trust, jnp.float32))


@struct.dataclass
class GenState:
    cache: KVCache
    dcache: Any  # drafter context cache, or None
    seq_len: jax.Array  # [S] tokens committed in the cache; the anchor sits at this position
    anchor: jax.Array  # [S] last emitted token (not yet in the cache)
    out: jax.Array  # [S, O] emitted tokens
    n_out: jax.Array  # [S]
    done: jax.Array  # [S] bool
    max_new: jax.Array  # [S]
    keys: jax.Array  # [S] PRNG keys (one per request; never depends on the batch)
    stop_ids: jax.Array  # [S, M] stop token ids, -1 padded
    cycles: jax.Array  # [S] cycles run
    tau_sum: jax.Array  # [S] Σ (accepted + 1) over cycles
    reached: jax.Array  # [S, K] cycles where draft j was verified with its prefix accepted
    accepted_at: jax.Array  # [S, K] cycles where draft j was accepted
    # Scheduler state and statistics (`with_sched_state` fills them before the loop).
    verified: Any = None  # [S] Σ verified drafts ℓ over cycles
    prev_conf: Any = None  # [S, K] calibrated confidences of the slot's last draft (async budget)
    acc_w: Any = None  # [S, K] decayed count of accepted drafts per position (async calibration)
    reach_w: Any = None  # [S, K] decayed count of verified drafts whose prefix was accepted
    # The same evidence for foreseen rows (`foresight`, e.g. prompt lookup), pooled over positions:
    # decayed accepted drafts and the decayed sum of the confidences foresight gave them.
    f_acc_w: Any = None  # [S]
    f_exp_w: Any = None  # [S]
    steps: Any = None  # [] cycles run by the loop (with any active slot)
    drafted_steps: Any = None  # [] of which drafted
    budget_sum: Any = None  # [] Σ packed tokens used (N = S + Σℓ)
    bucket_sum: Any = None  # [] Σ packed tokens paid for (the bucket of each step)
    # What the scheduler expected of the drafts it verified against what they delivered, per
    # kind of row ([0] the trained drafter's, [1] foreseen rows, e.g. prompt lookup's):
    # accepted drafts, the survival the budget predicted for them (async: the online-calibrated
    # confidences it chose the bucket by; other policies: this step's confidences), and the
    # survival this step's own calibrated confidences gave them.
    accepted_sum: Any = None  # [2]
    budget_exp_sum: Any = None  # [2]
    conf_exp_sum: Any = None  # [2]

    @classmethod
    def create(cls, target_cfg, drafter, dparams, *, slots: int, cache_len: int, out_len: int, num_draft: int,
               active=None, max_new=None, keys=None, stop_ids=None, sa: SamplingArrays | None = None) -> GenState:
        """The one constructor of a decode state (generate(), the serving engine, calibration):
        empty caches, no tokens, fresh scheduler state. Slots not `active` [S] start done
        (default: all done, as in a serving engine before admission); `max_new` [S],
        `keys` [S] and `stop_ids` [S, M] default to 1, key 0 and no stop ids. `sa` (the slots'
        sampling): each slot's scheduler starts from the drafter's acceptance prior for its
        decoding (greedy or sampled; `prior_confidence`), else from 1."""
        S, K = slots, num_draft

        def zeros():  # a distinct buffer per field: the loop donates its state
            return jnp.zeros((S,), jnp.int32)

        st = cls(
            cache=KVCache.zeros(target_cfg, S, cache_len),
            dcache=drafter.init_cache(dparams, S, cache_len) if drafter is not None else None,
            seq_len=zeros(),
            anchor=zeros(),
            out=jnp.full((S, out_len), -1, jnp.int32),
            n_out=zeros(),
            done=jnp.ones((S,), bool) if active is None else ~jnp.asarray(active, bool),
            max_new=jnp.ones((S,), jnp.int32) if max_new is None else jnp.asarray(max_new, jnp.int32),
            keys=jax.vmap(jax.random.key)(jnp.zeros((S,), jnp.uint32)) if keys is None else keys,
            stop_ids=jnp.full((S, 1), -1, jnp.int32) if stop_ids is None else jnp.asarray(stop_ids, jnp.int32),
            cycles=zeros(),
            tau_sum=zeros(),
            reached=jnp.zeros((S, K), jnp.int32),
            accepted_at=jnp.zeros((S, K), jnp.int32),
        )
        prior = None if sa is None else prior_confidence(acceptance_prior(drafter, K), sa)
        return with_sched_state(st, K, prior)


def acceptance_prior(drafter, num_draft: int) -> np.ndarray:
    """[2, K] the drafter's measured acceptance per draft position (conditional), under
    sampling (row 0) and greedy decoding (row 1): `DrafterConfig.acceptance_prior(_greedy)`
    (a hybrid reads its trained drafter's). 1 where the drafter has none (a drafter without
    calibration, prompt lookup): optimistic, so a request's first cycle drafts."""
    cfg = getattr(drafter, "cfg", None)
    sampled = tuple(getattr(cfg, "acceptance_prior", ()) or ())
    greedy = tuple(getattr(cfg, "acceptance_prior_greedy", ()) or ()) or sampled
    rows = [list(r[:num_draft]) if r else [1.0] * num_draft for r in (sampled, greedy)]
    return np.asarray(rows, np.float32).reshape(2, num_draft)


def prior_confidence(prior_2K, sa: SamplingArrays):
    """[S, K] each slot's row of `acceptance_prior`: greedy for temperature-0 slots."""
    prior_2K = jnp.asarray(prior_2K, jnp.float32)
    return jnp.where((sa.temperature == 0)[:, None], prior_2K[1][None], prior_2K[0][None])


def request_stop_ids(sp, eos_ids) -> list[int]:
    """A request's stop token ids: its own, plus the model's EOS ids unless `ignore_eos`."""
    s = list(sp.stop_token_ids) if sp.stop_token_ids is not None else []
    if not sp.ignore_eos:
        s += [t for t in eos_ids if t not in s]
    return s


def stop_id_table(params, eos_ids, slots: int, width: int | None = None) -> np.ndarray:
    """[slots, M] stop ids of each request (row i for params[i]), −1 padded; M = `width` or
    the longest list. Rows past len(params) stay empty."""
    stops = [request_stop_ids(sp, eos_ids) for sp in params]
    M = width or max(1, max((len(s) for s in stops), default=1))
    table = np.full((slots, M), -1, np.int32)
    for i, s in enumerate(stops):
        if len(s) > M:
            raise ValueError(f"request {i} has {len(s)} stop token ids; at most {M} fit")
        table[i, : len(s)] = s
    return table


def with_sched_state(st: GenState, num_draft: int, prior_SK=None) -> GenState:
    """Fresh scheduler state. The async budget's confidences start at `prior_SK` [S, K] (the
    drafter's measured acceptance, `prior_confidence`), or at 1 (optimistic: the first cycle
    drafts). An optimistic start costs a drafting step of the largest bucket per request at
    any load (at 16 slots on a 2-core CPU, about five autoregressive steps), where a measured prior drafts only
    where it pays."""
    S = st.seq_len.shape[0]
    # Distinct buffers: the loop donates its state, and one buffer cannot be donated twice.
    def z():
        return jnp.zeros((), jnp.int32)

    K = num_draft
    prev_conf = jnp.ones((S, K), jnp.float32) if prior_SK is None else jnp.array(prior_SK, jnp.float32)
    return st.replace(verified=jnp.zeros((S,), jnp.int32), prev_conf=prev_conf,
                      acc_w=jnp.zeros((S, K), jnp.float32), reach_w=jnp.zeros((S, K), jnp.float32),
                      f_acc_w=jnp.zeros((S,), jnp.float32), f_exp_w=jnp.zeros((S,), jnp.float32),
                      steps=z(), drafted_steps=z(), budget_sum=z(), bucket_sum=z(),
                      accepted_sum=jnp.zeros((2,), jnp.float32), budget_exp_sum=jnp.zeros((2,), jnp.float32),
                      conf_exp_sum=jnp.zeros((2,), jnp.float32))


def window_fits(st: GenState, settings: LoopSettings):
    """Whether the next cycle's queries (positions seq_len .. seq_len + K of every active
    slot) all lie inside the attention window. The last window is the whole cache, which
    generate() sizes for the longest request, so it always fits."""
    if settings.kv_window is None:
        return jnp.bool_(True)
    return jnp.all(st.done | (st.seq_len + settings.num_draft + 1 <= settings.kv_window))


def should_compact(st: GenState, settings: LoopSettings):
    """Few enough active slots, with enough left to decode, to pay for a smaller slot bucket."""
    if not settings.compact_at:
        return jnp.bool_(False)
    active = ~st.done
    left = jnp.max(jnp.where(active, st.max_new - st.n_out, 0))
    return (jnp.sum(active) <= settings.compact_at) & (left >= settings.compact_min_tokens)


PER_SLOT = ("seq_len", "anchor", "out", "n_out", "done", "max_new", "keys", "stop_ids", "cycles", "tau_sum",
            "reached", "accepted_at", "verified", "prev_conf", "acc_w", "reach_w", "f_acc_w", "f_exp_w")


def _take_state(st: GenState, idx, drafter) -> GenState:
    fields = {f: getattr(st, f)[idx] for f in PER_SLOT if getattr(st, f) is not None}
    cache = st.cache.take(idx)
    dcache = None if st.dcache is None else drafter.take_slots(st.dcache, idx)
    return st.replace(cache=cache, dcache=dcache, **fields)


# The state alone (the serving engine rebuilds its sampling rows itself): one program per
# shape, whatever the static flags of the slots' sampling.
take_state_slots = jax.jit(_take_state, static_argnames=("drafter",))


@functools.partial(jax.jit, static_argnames=("drafter",))
def take_slots(st: GenState, sa: SamplingArrays, idx, drafter=None):
    """The state of slots `idx` (in that order) as a smaller slot bucket: every per-slot field,
    the target's cache and the drafter's context cache (its own `take_slots`), and the
    sampling rows. Loop-wide counters carry over."""
    st = _take_state(st, idx, drafter)
    sa = sa.replace(temperature=sa.temperature[idx], top_k=sa.top_k[idx], top_p=sa.top_p[idx],
                    min_p=sa.min_p[idx])
    return st, sa


def window_cache(dcache, kv_window: int | None):
    """The drafter's context cache cut to the attention window: a KVCache [L, S, T, ...], or
    the KVCaches inside a tuple (a hybrid drafter's); other caches are passed whole."""
    if isinstance(dcache, tuple):
        return tuple(window_cache(c, kv_window) for c in dcache)
    if not isinstance(dcache, KVCache):
        return dcache
    return dcache.window(kv_window)


def append_context(drafter, dparams, dcache, target, feats_NF, slot_N, pos_N, valid_N, tokens_N, *, rows=False):
    """The drafter's `append`, with the committed tokens for a drafter that reads them
    (`reads_tokens`, e.g. prompt lookup) and without for one that reads features only.
    `rows`: `feats_NF` are `context_rows` already (`split_append`) and `append_rows` writes them."""
    kw = {"tokens_N": tokens_N} if drafter.reads_tokens else {}
    if rows:
        return drafter.append_rows(dparams, dcache, feats_NF, slot_N, pos_N, valid_N, **kw)
    return drafter.append(dparams, dcache, target, feats_NF, slot_N, pos_N, valid_N, **kw)


def split_append(drafter) -> bool:
    """Whether the drafter's append splits into `context_rows` + `append_rows` (DrafterProtocol);
    a wrapper (a `.drafter` inside, e.g. `HybridDrafter`) splits when the drafter it wraps does."""
    if not (hasattr(drafter, "context_rows") and hasattr(drafter, "append_rows")):
        return False
    inner = getattr(drafter, "drafter", None)
    return inner is None or split_append(inner)


def fold_keys(keys, data):
    """Per-slot `jax.random.fold_in`: one key per request, folded with per-slot data."""
    return jax.vmap(jax.random.fold_in)(keys, data)


def _first_stop(tokens_SJ, limit_S, stop_ids_SM):
    """Index of the first stop token within the first `limit` entries of each row (or J)."""
    J = tokens_SJ.shape[1]
    is_stop = jnp.any(tokens_SJ[..., None] == stop_ids_SM[:, None, :], -1)
    is_stop &= jnp.arange(J)[None] < limit_S[:, None]
    return jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), J), jnp.any(is_stop, 1)


@struct.dataclass
class StepWrites:
    """What a deferred bucket step leaves to write after `lax.switch`: the target's new keys
    and values and the drafter's context append, padded to the largest bucket's tokens."""

    kv: StepKV
    feats: Any  # the drafter's `context_rows` [N, ...] (`split_append`), else features [N, F] or None
    slot: jax.Array  # [N]
    pos: jax.Array  # [N]
    keep: jax.Array  # [N] anchor + accepted drafts
    tokens: jax.Array  # [N]

    def apply(self, target, drafter, dparams, cache, dcache):
        """→ (cache, dcache) with the step's writes; in place when the loop state is donated."""
        cache = self.kv.write(cache)
        if drafter is not None:
            dcache = append_context(drafter, dparams, dcache, target, self.feats, self.slot, self.pos, self.keep,
                                    self.tokens, rows=split_append(drafter))
        return cache, dcache


def verify_bucket(target, drafter, dparams, cache, dcache, seq_len_S, anchor_S, sa, verify_keys, d_tok, d_logits,
                  nv, active, *, num_tokens: int, q_max: int, kv_window: int | None = None,
                  defer_to: int | None = None):
    """One packed target step at a static bucket of `num_tokens` tokens, then verification and
    the drafter's context append. → (accepted [S], emitted [S, K+1], cache, dcache).

    Every bucket variant has this signature, so `lax.switch` can pick one per cycle; only
    the chosen branch runs, so the step costs what its bucket costs. `q_max` = 1 is the
    variant without drafts (async skipped drafting): verification of zero drafts is
    exactly sampling from the target. `defer_to` (under `lax.switch`: the largest bucket's
    tokens): the caches are only read and the result is (accepted, emitted, `StepWrites`
    padded to that many tokens) — a switch branch that updates a buffer makes XLA copy it
    whole every step, so the writes happen once, after the switch."""
    S, K = d_tok.shape
    counts = jnp.where(active, 1 + nv, 0)
    lay = packed_layout(seq_len_S, counts, num_tokens, q_max)
    grid_tok = jnp.concatenate([anchor_S[:, None], d_tok], 1)[:, :q_max]  # [S, Q]
    tokens_N = grid_tok[lay.slot_N, jnp.clip(lay.j_N, 0, q_max - 1)]
    feature_layers = drafter.feature_layers if drafter is not None else ()
    # Batch-invariant decoding defers every step's write: one program form for every step,
    # whose numbers do not depend on how many tokens it carries (`layers.attend_in_fixed_order`).
    defer = defer_to is not None or target.cfg.fixed_order_decode
    logits_N, feats, step_kv = target(cache, tokens_N, seq_len_S, counts, q_max=q_max,
                                      feature_layers=feature_layers, kv_window=kv_window, defer_write=defer)
    # Back to the [S, Q] grid (empty cells read a clamped row; they are never used).
    tgt_logits = logits_N[jnp.minimum(lay.grid_idx_SQ, num_tokens - 1)]
    accepted, emitted = verify(verify_keys, d_tok[:, : q_max - 1], d_logits[:, : q_max - 1], tgt_logits,
                               jnp.minimum(nv, q_max - 1), sa)
    emitted = jnp.pad(emitted, ((0, 0), (0, K + 1 - q_max)), constant_values=-1)
    accepted = jnp.where(active, accepted, 0)
    keep = lay.valid_N & (lay.j_N <= accepted[lay.slot_N])
    if defer_to is not None:
        n = defer_to - num_tokens

        def pad(x):  # [N, ...] → [defer_to, ...]
            return jnp.pad(x, ((0, n),) + ((0, 0),) * (x.ndim - 1))

        if drafter is not None and split_append(drafter):  # computed at this bucket's size, not the largest
            feats = drafter.context_rows(dparams, target, feats, lay.pos_N)
        feats = jax.tree.map(pad, feats)
        return accepted, emitted, StepWrites(step_kv.padded(defer_to), feats, pad(lay.slot_N), pad(lay.pos_N),
                                             pad(keep), pad(tokens_N))
    cache = step_kv.write(cache) if defer else step_kv
    if drafter is not None:
        dcache = append_context(drafter, dparams, dcache, target, feats, lay.slot_N, lay.pos_N, keep, tokens_N)
    return accepted, emitted, cache, dcache


def cycle(target, drafter, dparams, st: GenState, sa: SamplingArrays, settings: LoopSettings,
           sched: SchedArrays | None):
    S = st.seq_len.shape[0]
    K = settings.num_draft
    rows = jnp.arange(S)
    active = ~st.done
    # PRNG keys (not KV caches): one per request and cycle (seq_len is unique per cycle of
    # a request), split into the drafter's and the verifier's.
    cycle_keys = fold_keys(st.keys, st.seq_len)
    draft_keys = fold_keys(cycle_keys, jnp.ones_like(st.seq_len))
    verify_keys = fold_keys(cycle_keys, jnp.full_like(st.seq_len, 2))
    remaining = st.max_new - st.n_out
    caps = jnp.where(active, jnp.clip(jnp.minimum(K, remaining - 1), 0, K), 0)
    V = target.cfg.vocab_size

    # Greedy verification reads no draft distributions: an empty [S, K, 0] stands in for
    # them, so the drafter's scatter into the full vocabulary is dead code XLA removes.
    Vq = 0 if sa.all_greedy else V

    def draft():
        raw = {"raw_confidence": True} if settings.raw_confidence else {}
        tok, logits, conf = drafter.draft(dparams, window_cache(st.dcache, settings.kv_window), target, st.anchor,
                                          st.seq_len, draft_keys, sa, **raw)
        logits = jnp.zeros((S, K, 0), jnp.float32) if sa.all_greedy else logits[:, :K].astype(jnp.float32)
        return tok[:, :K], logits, conf[:, :K].astype(jnp.float32)

    def no_draft():
        return (jnp.zeros((S, K), jnp.int32), jnp.zeros((S, K, Vq), jnp.float32),
                jnp.zeros((S, K), jnp.float32))

    policy = settings.policy
    W = settings.kv_window
    drafted = jnp.bool_(K > 0)
    foreseen = jnp.zeros((S,), bool)
    pred = rank = None  # the budget's and this step's confidences of the scheduled policies
    if K == 0 or policy == "fixed":
        d_tok, d_logits, conf = draft() if K > 0 else no_draft()
        nv = caps
        sizes = (S * (K + 1),)
        branches = [functools.partial(verify_bucket, num_tokens=S * (K + 1), q_max=K + 1, kv_window=W)]
        idx = jnp.int32(0)
        if target.cfg.fixed_order_decode:
            # The batch-invariant step (one bf16 term) measured 1.2-1.35x faster as a conditional's
            # branch than as the loop body's own ops on XLA:CPU (8 slots: 164 against 122-133 tok/s;
            # BENCHMARKS, stop 45): the same step twice under the switch below, on a runtime index
            # that is always 0, its writes applied after it as the scheduled loop's are.
            N = S * (K + 1)
            branches = [functools.partial(verify_bucket, num_tokens=N, q_max=K + 1, kv_window=W, defer_to=N)] * 2
            idx = (st.seq_len[0] < 0).astype(jnp.int32)
    else:
        buckets = settings.buckets
        widths = settings.bucket_widths or None
        if policy == "async":
            # The budget comes from earlier steps only (never this step's drafts), so it is
            # known before drafting and a budget of 0 skips the drafter. Its confidences are
            # calibrated online: each position's observed acceptance (a decayed count) against
            # the drafter's last confidences as a prior — an uncalibrated drafter that claims
            # much and delivers nothing is switched off after a failed try, and re-tried as
            # the evidence fades.
            pred = (st.acc_w + settings.calib_prior * st.prev_conf) / (st.reach_w + settings.calib_prior)
            # The pooled calibration's trust scales the first position's confidence, i.e. every
            # survival probability (so the budget's expectation) by the same factor.
            trust = jnp.ones((2,), jnp.float32) if sched.trust is None else sched.trust
            first = jnp.arange(K)[None] == 0
            pred = jnp.clip(pred * jnp.where(first, trust[0], 1.0), 0.0, 1.0)
            if hasattr(drafter, "foresight"):
                # Confidences a drafter knows before drafting, from the committed context alone
                # (prompt lookup: whether and how long the context matches): those rows are
                # budgeted by them, and they do not count as the trained drafter's evidence.
                # Foresight's prior is corrected online by the request's own record: the ratio
                # s = (accepted + c) / (foreseen confidence of what was verified + c) scales the
                # first position's confidence, i.e. every survival probability by s, so lookup on
                # text that repeats less (or more) than the prior assumes drafts less (or more).
                # (Scaling every conditional confidence by s compounded along the block: s^k at
                # position k; measured at batch 1 on HumanEval, the hybrid fell 1.18× → 1.00×.)
                f_conf, foreseen = drafter.foresight(window_cache(st.dcache, W), st.anchor, st.seq_len)
                c = settings.calib_prior
                f_scale = (st.f_acc_w + c) / (st.f_exp_w + c)
                f_scale_K = jnp.where(first, f_scale[:, None] * trust[1], 1.0)
                f_pred = jnp.clip(f_conf[:, :K].astype(jnp.float32) * f_scale_K, 0.0, 1.0)
                pred = jnp.where(foreseen[:, None], f_pred, pred)
            critical = None
            if settings.makespan:
                # The slots that could be the batch's last to finish; the others do not draft
                # (their caps come from the committed counts, not from any draft: lossless).
                togo = jnp.where(active, remaining, 0)
                critical = active & (togo >= jnp.max(togo) - K)
                caps = jnp.where(critical, caps, 0)
            u = async_budget(pred, active, caps, sched.rates, buckets, skip_rate=sched.skip_rate,
                             critical_S=critical, widths=widths)
            drafted = u >= 0
            d_tok, d_logits, conf = jax.lax.cond(drafted, draft, no_draft)
        else:
            d_tok, d_logits, conf = draft()
            u = jnp.int32(0)
        rank = conf
        if callable(policy):  # a caller's scheduler (e.g. a test's negative control)
            nv = jnp.clip(policy(conf, active, caps, sched.rates, buckets), 0, caps).astype(jnp.int32)
            u = bucket_for(jnp.sum(active) + jnp.sum(nv), jnp.max(nv), buckets, widths)
        else:
            if policy == "async" and hasattr(drafter, "foresight"):
                # The bucket's drafts go to the best candidates by the same corrected confidences
                # (the scale comes from earlier cycles: the decision still never reads this one's).
                rank = jnp.where(foreseen[:, None], jnp.clip(conf * f_scale_K, 0.0, 1.0), conf)
            nv, u = schedule_lengths(rank, policy, sched.rates, buckets, active_S=active, caps_S=caps, k=K,
                                     threshold=sched.threshold, bucket_u=u, fill=True, widths=widths)
        nv = jnp.where(drafted, nv, 0)
        # Branch 0: no drafts (q_max = 1, S tokens); branch 1 + u: bucket u.
        sizes = (S, *buckets)
        N = max(buckets)
        if N < S:
            raise ValueError(f"the largest bucket ({N} tokens) must hold every slot's anchor ({S} slots)")
        branches = [functools.partial(verify_bucket, num_tokens=S, q_max=1, kv_window=W, defer_to=N)] + [
            functools.partial(verify_bucket, num_tokens=n, q_max=q, kv_window=W, defer_to=N)
            for n, q in zip(buckets, widths or (K + 1,) * len(buckets))]
        # A step that verifies no draft at all runs the one-query-per-slot variant: the same
        # target sample, without the [S, K+1] query grid of the drafting buckets.
        idx = jnp.where(drafted & (jnp.sum(nv) > 0), 1 + jnp.clip(u, 0, len(buckets) - 1), 0).astype(jnp.int32)

    def run(i):
        return lambda ops: branches[i](target, drafter, dparams, *ops)

    ops = (st.cache, st.dcache, st.seq_len, st.anchor, sa, verify_keys, d_tok, d_logits, nv, active)
    if len(branches) == 1:
        accepted, emitted, cache, dcache = branches[0](target, drafter, dparams, *ops)
    else:  # the branches only read the caches; their writes land here, once
        accepted, emitted, writes = jax.lax.switch(idx, [run(i) for i in range(len(branches))], ops)
        cache, dcache = writes.apply(target, drafter, dparams, st.cache, st.dcache)
    n_emit = accepted + 1
    stop_at, hit = _first_stop(emitted, n_emit, st.stop_ids)
    n_emit = jnp.minimum(jnp.where(hit, stop_at, n_emit), remaining)
    n_emit = jnp.where(active, n_emit, 0)
    # Entries past n_out are scratch: a finished row may scribble there, nobody reads them.
    # (The buffer holds max_new + K + 1, so the slice never gets clamped onto real tokens.)
    out = jax.vmap(lambda o, e, i: jax.lax.dynamic_update_slice(o, e, (i,)))(st.out, emitted, st.n_out)
    n_out = st.n_out + n_emit
    j = jnp.arange(K)[None]
    act = active[:, None]
    any_active = jnp.any(active)
    reached_now = act & (j < nv[:, None]) & (j <= accepted[:, None])
    accepted_now = act & (j < accepted[:, None])
    lam = jnp.where(act, settings.calib_decay, 1.0)
    learn = act & ~foreseen[:, None]  # the online calibration's evidence: the trained drafter's cycles
    seen = active & foreseen & drafted  # foresight's evidence: its rows' drafted cycles
    f_acc = jnp.sum(accepted_now, 1).astype(jnp.float32)
    f_exp = jnp.sum(jnp.where(reached_now, conf, 0.0), 1)
    lam_s = jnp.where(active, settings.calib_decay, 1.0)
    if rank is not None:
        verified_now = act & (j < nv[:, None]) & drafted

        def by_kind(x_SK):  # [2]: the trained drafter's rows, foreseen rows
            x_S = jnp.sum(jnp.where(verified_now, x_SK, 0.0), 1)
            return jnp.stack([jnp.sum(jnp.where(foreseen, 0.0, x_S)), jnp.sum(jnp.where(foreseen, x_S, 0.0))])

        a_rank = survival(rank)
        tally = {"accepted_sum": st.accepted_sum + by_kind(accepted_now.astype(jnp.float32)),
                 "budget_exp_sum": st.budget_exp_sum + by_kind(a_rank if pred is None else survival(pred)),
                 "conf_exp_sum": st.conf_exp_sum + by_kind(a_rank)}
    else:
        tally = {}
    return st.replace(
        cache=cache,
        dcache=dcache,
        seq_len=st.seq_len + jnp.where(active, accepted + 1, 0),
        anchor=jnp.where(active, emitted[rows, accepted], st.anchor),
        out=out,
        n_out=n_out,
        done=st.done | (active & (hit | (n_out >= st.max_new))),
        cycles=st.cycles + active,
        tau_sum=st.tau_sum + jnp.where(active, accepted + 1, 0),
        reached=st.reached + reached_now,
        accepted_at=st.accepted_at + accepted_now,
        verified=st.verified + jnp.where(active, nv, 0),
        prev_conf=jnp.where(learn & drafted, conf, st.prev_conf),
        acc_w=lam * st.acc_w + (learn & accepted_now),
        reach_w=lam * st.reach_w + (learn & reached_now),
        f_acc_w=st.f_acc_w if st.f_acc_w is None else lam_s * st.f_acc_w + jnp.where(seen, f_acc, 0.0),
        f_exp_w=st.f_exp_w if st.f_exp_w is None else lam_s * st.f_exp_w + jnp.where(seen, f_exp, 0.0),
        steps=st.steps + any_active,
        drafted_steps=st.drafted_steps + (any_active & drafted),
        budget_sum=st.budget_sum + jnp.sum(jnp.where(active, 1 + nv, 0)),
        bucket_sum=st.bucket_sum + jnp.where(any_active, jnp.asarray(sizes, jnp.int32)[idx], 0),
        **tally,
    )


@functools.partial(
    jax.jit, static_argnames=("tgraph", "drafter", "settings"), donate_argnames=("st",)
)
def decode_loop(tgraph, tstate, drafter, dparams, st: GenState, sa: SamplingArrays, max_cycles,
                sched: SchedArrays | None = None, stop_on_finish=False, *, settings: LoopSettings):
    """Runs cycles on device until every request is done or `max_cycles` cycles have run.

    `sched` (scheduled policies) is an argument, not a static: a re-profiled step-rate
    table or another threshold reuses the compiled loop. `stop_on_finish` (traced; the serving
    engine's) also ends the loop after the cycle in which a request finished: its client
    hears at once and its slot is refilled by the next call instead of idling for the rest
    of this one. Speculation finishes requests at any cycle, not in lockstep: at 8 slots, calls
    of 4 cycles, the hybrid drafter needs 6% fewer target steps with it (BENCHMARKS.md, stop 46)."""
    target = nnx.merge(tgraph, tstate)
    done0 = jnp.sum(st.done)

    def cond(c):
        i, s = c
        finished = jnp.asarray(stop_on_finish) & (jnp.sum(s.done) > done0)
        return ((i < max_cycles) & ~jnp.all(s.done) & ~finished & window_fits(s, settings)
                & ~should_compact(s, settings))

    def body(c):
        i, s = c
        return i + 1, cycle(target, drafter, dparams, s, sa, settings, sched)

    _, st = jax.lax.while_loop(cond, body, (jnp.int32(0), st))
    return st
