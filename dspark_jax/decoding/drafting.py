"""Jitted entry points around a drafter's pure calls (benchmarks and tests call these; the
decode loop inlines the same calls). The drafters themselves live in `models/drafters.py`
and `models/ngram.py`."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from dspark_jax.models.drafters import Drafter


@functools.partial(jax.jit, static_argnames=("drafter", "tgraph", "use_scan", "with_logits"))
def draft_block(drafter: Drafter, params, tgraph, tstate, cache, anchor_S, anchor_pos_S, keys_S, sa,
                use_scan=True, with_logits=True):
    """Jitted drafting of one block for every slot (the engine inlines the same call;
    `with_logits=False` is what it costs under greedy verification, which reads no logits)."""
    target = nnx.merge(tgraph, tstate)
    return drafter.draft(params, cache, target, anchor_S, anchor_pos_S, keys_S, sa, use_scan=use_scan,
                         with_logits=with_logits)


@functools.partial(jax.jit, static_argnames=("drafter", "tgraph"), donate_argnames=("cache",))
def append_features(drafter: Drafter, params, tgraph, tstate, cache, feats_NF, slot_N, pos_N, valid_N):
    target = nnx.merge(tgraph, tstate)
    return drafter.append(params, cache, target, feats_NF, slot_N, pos_N, valid_N)
