"""STS calibration data from the real engine, and a drafter with fitted temperatures.

`collect_cycles` decodes prompts speculatively with the engine's own cycle (fixed policy, γ
drafts verified per cycle), the drafter reporting its confidence logits before STS
(`LoopSettings.raw_confidence`), and records per cycle and request: those logits, how many
drafts were verified and how many were accepted. `training/sts.py` fits the temperatures on
them (NumPy); `with_temperatures` puts them into the drafter's config.

Shape letters (docs/architecture.md, "Shape letters"): Z cycles, G block size γ, S slots of one collection
batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.decode_loop import GenState, LoopSettings, cycle, stop_id_table
from dspark_jax.decoding.generate import encode_prompt, next_pow2
from dspark_jax.decoding.prefill import prefill
from dspark_jax.decoding.sampling import SamplingArrays, SamplingParams
from dspark_jax.decoding.seeds import request_keys, resolve_seed
from dspark_jax.models.drafters import Drafter


def with_temperatures(drafter: Drafter, temps, greedy_temps=None, *, survival=None, survival_greedy=None) -> Drafter:
    """The same drafter with `temps` as its STS temperatures (and `greedy_temps` for
    temperature-0 requests, if given; both saved by `save_drafter`). `survival` /
    `survival_greedy`: the measured survival per position (`sts.fit_and_report`'s
    `survival_rate_per_position`), kept as the drafter's acceptance prior
    (`DrafterConfig.acceptance_prior`, conditional per position)."""
    kw = {"sts_temperatures": tuple(float(t) for t in temps)}
    if greedy_temps is not None:
        kw["sts_temperatures_greedy"] = tuple(float(t) for t in greedy_temps)
    if survival is not None:
        kw["acceptance_prior"] = conditional_acceptance(survival)
    if survival_greedy is not None:
        kw["acceptance_prior_greedy"] = conditional_acceptance(survival_greedy)
    return Drafter(drafter.cfg.replace(**kw), drafter.graphdef, drafter.state)


def conditional_acceptance(survival) -> tuple[float, ...]:
    """Per-position acceptance given the earlier drafts were accepted, from the survival
    rates a_k = P(drafts 1..k accepted): c_k = a_k / a_{k−1} (a_0 = 1), in [0, 1]; 0 after a
    position nothing survived."""
    a = np.asarray(survival, np.float64)
    prev = np.concatenate([[1.0], a[:-1]])
    c = np.where(prev > 0, a / np.maximum(prev, 1e-30), 0.0)
    return tuple(round(float(x), 6) for x in np.clip(c, 0.0, 1.0))


# ----------------------------------------------------------------------------- collection


@functools.partial(jax.jit, static_argnames=("tgraph", "drafter", "settings"), donate_argnames=("st",))
def _collect_step(tgraph, tstate, drafter, dparams, st: GenState, sa, *, settings: LoopSettings):
    """One engine cycle (`decode_loop.cycle`, with raw confidences) and what it saw: raw
    confidence logits [S, G], accepted and verified counts [S], which slots were live."""
    target = nnx.merge(tgraph, tstate)
    active = ~st.done
    new = cycle(target, drafter, dparams, st, sa, settings, None)
    accepted = jnp.where(active, new.seq_len - st.seq_len - 1, 0)
    verified = new.verified - st.verified
    return new, new.prev_conf, accepted, verified, active


def _run_cycles(target, drafter: Drafter, ids: list[list[int]], params: list[SamplingParams]):
    """Prefill + cycles (γ drafts each) for one batch; returns (final GenState, per-cycle records)."""
    B, K = len(ids), drafter.block_size
    S = next_pow2(B)
    max_new = max(sp.max_new_tokens for sp in params)
    T = next_pow2(max(len(x) for x in ids) + max_new + K + 1, 128)
    O = next_pow2(max_new) + K + 1
    stop_ids = stop_id_table(params, target.eos_token_ids, S)
    pad = params + [SamplingParams(temperature=0.0)] * (S - B)
    sa = SamplingArrays.from_params(pad)
    lens = np.zeros(S, np.int32)
    lens[:B] = [len(x) for x in ids]
    tokens = np.zeros(next_pow2(int(lens.sum()), 16), np.int32)
    tokens[: lens.sum()] = np.concatenate(ids)
    max_new_arr = np.ones(S, np.int32)
    max_new_arr[:B] = [sp.max_new_tokens for sp in params]
    dparams = drafter.params
    # The engine's own seed → key rule (any int; None = fresh), so sampled cycles match generate's.
    keys = request_keys([resolve_seed(sp.seed) for sp in params] + [0] * (S - B))
    st = GenState.create(target.cfg, drafter, dparams, slots=S, cache_len=T, out_len=O, num_draft=K,
                         active=np.arange(S) < B, max_new=max_new_arr, keys=keys, stop_ids=stop_ids)
    st = prefill(target.graphdef, target.state, drafter, dparams, st, jnp.asarray(tokens), jnp.asarray(lens), sa,
                 q_max=next_pow2(max(len(x) for x in ids), 16))
    settings = LoopSettings(num_draft=K, raw_confidence=True)
    records = []  # (slot, conf [S, G], accepted [S], verified [S], live [S]) per cycle
    while not bool(np.all(np.asarray(st.done))):
        st, conf, acc, nv, live = _collect_step(target.graphdef, target.state, drafter, dparams, st, sa,
                                                settings=settings)
        records.append(tuple(np.asarray(x) for x in (conf, acc, nv, live)))
    return st, records


def collect_cycles(target, drafter: Drafter, prompts_token_ids, *, max_new_tokens: int,
                   sampling: SamplingParams | None = None, batch_size: int = 16):
    """Decodes every prompt speculatively (γ drafts verified per cycle, the engine's own cycle)
    and records each cycle of each request: (raw confidence logits [Z, G], accepted [Z],
    verified [Z]), request-major. `sampling` (default: temperature 1) sets everything but
    `max_new_tokens`; use the sampling the drafter will serve with."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"collect_cycles needs a ds.Drafter, got {type(drafter).__name__}")
    if not drafter.cfg.confidence_head:
        raise ValueError("this drafter has no confidence head (confidence_head=False): nothing to calibrate")
    drafter.bind(target)  # checks it fits the target
    sp = dataclasses.replace(sampling or SamplingParams(), max_new_tokens=int(max_new_tokens))
    ids = [encode_prompt(target, p) for p in prompts_token_ids]
    if not ids:
        raise ValueError("no prompts given")
    for i, x in enumerate(ids):
        if len(x) + max_new_tokens > target.cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(x)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                             f"the model's context of {target.cfg.max_position_embeddings} tokens")
    G = drafter.block_size
    per_request: list[list[tuple]] = []
    for b in range(0, len(ids), batch_size):
        chunk = ids[b: b + batch_size]
        _, records = _run_cycles(target, drafter, chunk, [sp] * len(chunk))
        for r in range(len(chunk)):
            per_request.append([(c[r], a[r], v[r]) for c, a, v, live in records if live[r]])
    rows = [x for req in per_request for x in req]
    if not rows:
        return np.zeros((0, G), np.float32), np.zeros(0, np.int32), np.zeros(0, np.int32)
    conf, acc, ver = zip(*rows)
    return np.stack(conf).astype(np.float32), np.asarray(acc, np.int32), np.asarray(ver, np.int32)
