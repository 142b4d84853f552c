"""Drafters as the decode cycle sees them.

- `DrafterProtocol`: what the cycle needs from a drafter (every drafter implements it).
- `Drafter`: a loaded DSpark/DFlash drafter (config + split NNX state) with a per-slot
  context cache of projected target features. Each cycle appends only the features of the
  tokens just committed (anchor + accepted drafts); block K/V are never kept.
- `OracleDrafter`: proposes a fixed continuation per request (e.g. the target's own greedy
  output) — the "almost everything accepted" end of the spectrum, for tests and benchmarks.
- Prompt lookup and the hybrid live in `models/ngram.py`.

Shape letters (docs/architecture.md): S slots, T cache length, G block size γ, N packed tokens, F features, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models.draft_heads import sample_block, sts_confidence
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.transformer import KVCache
from dspark_jax.sampling_transform import SamplingArrays


@runtime_checkable
class DrafterProtocol(Protocol):
    """What the decode cycle (`decoding/decode_loop.py`) needs from a drafter.

    Host side: `block_size` (γ, tokens per block), `feature_layers` (target layers whose
    hidden states `append` receives; () for none), `reads_tokens` (whether `append` also
    takes the committed tokens, `tokens_N=`), `params` (the pytree passed back into every
    pure call) and `bind(target)` (checks the drafter fits the target and returns the drafter
    to use with it). Inside jit: `init_cache` (a per-slot context cache of any pytree),
    `take_slots` (the cache of a subset of slots, for slot compaction), `append` (the
    committed tokens' features into the cache) and `draft` (one block per slot: tokens
    [S, G], draft logits [S, G, V] after the request's sampling transform — or one-hot for a
    deterministic proposal — and survival confidences [S, G]). Equality and hashing are
    the jit cache key: a drafter is a static argument.

    Optional, both or neither: `context_rows(params, target, feats_NF, pos_N)` (what `append`
    computes per token before it writes, e.g. projected keys and values: a pytree of
    [N, ...] arrays) and
    `append_rows(params, cache, rows, slot_N, pos_N, valid_N, **kw)` (the write), so that
    `append` = `append_rows(context_rows(...))`. The scheduled policies compute the rows
    inside their bucket's branch (at that bucket's size) and write after the switch; a
    drafter without them gets its features padded to the largest bucket instead.

    Optional: `foresight(cache, anchor_S, anchor_pos_S)` → (confidences [S, G], known [S]):
    the confidences of this cycle's block, where they follow from the committed context
    alone (prompt lookup's match). The async scheduler budgets the known rows by them
    instead of by earlier cycles, and keeps its online calibration for the others.
    """

    block_size: int
    feature_layers: tuple[int, ...]
    reads_tokens: bool

    @property
    def params(self) -> Any: ...

    def bind(self, target) -> DrafterProtocol: ...

    def init_cache(self, params, num_slots: int, length: int) -> Any: ...

    def take_slots(self, cache, idx) -> Any: ...

    def append(self, params, cache, target, feats_NF, slot_N, pos_N, valid_N, **kw) -> Any: ...

    def draft(self, params, cache, target, anchor_S, anchor_pos_S, keys_S, sa: SamplingArrays, **kw) -> tuple: ...


def bind_drafter(drafter, target):
    """The drafter to run with `target` (None stays None): checked against `DrafterProtocol`
    (a clear error names what is missing), then `bind`-ed to the target."""
    if drafter is None:
        return None
    if not isinstance(drafter, DrafterProtocol):
        need = ("block_size", "feature_layers", "reads_tokens", "params", "bind", "init_cache", "take_slots",
                "append", "draft")
        missing = [n for n in need if not hasattr(drafter, n)]
        raise TypeError(f"{type(drafter).__name__} is not a drafter: it lacks {', '.join(missing)} "
                        "(see dspark_jax.models.drafters.DrafterProtocol)")
    return drafter.bind(target)


@dataclasses.dataclass(eq=False)  # hashed by identity: it is a static jit argument
class Drafter:
    cfg: DrafterConfig
    graphdef: Any
    state: Any

    def __post_init__(self):
        if self.cfg.draft_vocab_size:
            ids = self.state["draft_ids"].get_value()
            if isinstance(ids, jax.ShapeDtypeStruct):
                return  # abstract (eval_shape): nothing to check yet
            ids = np.asarray(ids)
            V = self.cfg.vocab_size
            if ids.shape != (self.cfg.draft_vocab_size,):
                raise ValueError(f"draft_ids has shape {ids.shape}, expected ({self.cfg.draft_vocab_size},)")
            if ids.min() < 0 or ids.max() >= V:
                raise ValueError(
                    f"draft vocabulary ids must lie in [0, {V}) (the target's vocabulary); "
                    f"got min {ids.min()}, max {ids.max()}"
                )
            if len(np.unique(ids)) != len(ids):
                raise ValueError("draft vocabulary ids must be distinct")
        self._bound_to = None

    reads_tokens = False  # reads the target's features only

    def bind(self, target) -> Drafter:
        """Checks the drafter fits the target, then fills the runtime copy of the target's LM
        head restricted to the draft vocabulary (once per target; gathered here so that no
        decode step pays for the gather)."""
        self.cfg.check_compatible(target.cfg)
        if self.cfg.draft_vocab_size and self._bound_to is not target.state:
            ids = jnp.asarray(self.state["draft_ids"].get_value())
            lm = target.module().lm_head_matrix()
            var = self.state["draft_lm_head"]
            var.set_value(jnp.take(lm, ids, axis=1).astype(var.get_value().dtype))
            self._bound_to = target.state
        return self

    @classmethod
    def random(cls, cfg: DrafterConfig, seed: int = 0, draft_ids=None) -> Drafter:
        """Random weights; `draft_ids` [V′] sets the draft vocabulary (default: ids 0..V′−1)."""
        model = DSparkDrafter(cfg, rngs=nnx.Rngs(seed))
        if draft_ids is not None:
            if not cfg.draft_vocab_size:
                raise ValueError("draft_ids given but the config has draft_vocab_size=0")
            model.draft_ids.set_value(jnp.asarray(np.asarray(draft_ids), jnp.int32))
        return cls(cfg, *nnx.split(model))

    @property
    def params(self):
        return self.state

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.target_layer_ids)

    def module(self) -> DSparkDrafter:
        return nnx.merge(self.graphdef, self.state)

    # --- the engine interface (pure; called inside jit) ---
    def init_cache(self, params, num_slots: int, length: int) -> KVCache:
        c = self.cfg
        shape = (c.num_layers, num_slots, length, c.num_kv_heads, c.head_dim)
        return KVCache(jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype))

    def take_slots(self, cache: KVCache, idx) -> KVCache:
        return cache.take(idx)

    def context_rows(self, params, target, feats_NF, pos_N):
        """The committed tokens' context keys and values, k, v [N, L, K, E]."""
        ks, vs = nnx.merge(self.graphdef, params).context_kv(feats_NF, pos_N)
        return jnp.stack(ks, 1), jnp.stack(vs, 1)

    def append_rows(self, params, cache: KVCache, rows, slot_N, pos_N, valid_N) -> KVCache:
        k_NL, v_NL = rows
        S = cache.k.shape[1]
        ws = jnp.where(valid_N, slot_N, S)  # invalid → out of range → dropped
        k = cache.k.at[:, ws, pos_N].set(k_NL.swapaxes(0, 1).astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, ws, pos_N].set(v_NL.swapaxes(0, 1).astype(cache.v.dtype), mode="drop")
        return KVCache(k, v)

    def append(self, params, cache: KVCache, target, feats_NF, slot_N, pos_N, valid_N) -> KVCache:
        return self.append_rows(params, cache, self.context_rows(params, target, feats_NF, pos_N), slot_N, pos_N,
                                valid_N)

    def draft(self, params, cache: KVCache, target, anchor_S, anchor_pos_S, keys_S, sa: SamplingArrays,
              *, use_scan: bool = True, with_logits: bool = True, raw_confidence: bool = False):
        """→ (tokens [S, G], transformed logits [S, G, V] (None with `with_logits=False`),
        calibrated confidences [S, G] — or, with `raw_confidence`, the confidence head's
        logits before STS, which the calibration fits on)."""
        d = nnx.merge(self.graphdef, params)
        G = self.cfg.block_size
        T = cache.length
        # The target's own lookup (`Transformer.embed`): a narrower (bf16) table's rows are
        # gathered as raw bits; indexing it here cost a float32 copy of the whole table per loop call.
        x = d.block_inputs(target.embed(anchor_S))  # [S, G, D]
        pos = anchor_pos_S[:, None] + jnp.arange(G)
        # Context strictly before the anchor (its features do not exist yet), whole block.
        ctx = jnp.arange(T)[None, None, :] < anchor_pos_S[:, None, None]
        mask = jnp.concatenate([jnp.broadcast_to(ctx, (x.shape[0], G, T)),
                                jnp.ones((x.shape[0], G, G), bool)], -1)
        h = d.backbone(x, pos, list(cache.k), list(cache.v), mask)
        ids = d.proposal_ids
        head = target.lm_head_matrix() if ids is None else d.draft_lm_head[...]  # [D, V′]
        U = jnp.einsum("sgd,dv->sgv", h, head, preferred_element_type=jnp.float32)
        toks, logits, conf = sample_block(d.head, d.confidence, U, h, anchor_S, keys_S, sa, draft_ids=ids,
                                          vocab_size=self.cfg.vocab_size, topk=self.cfg.draft_topk,
                                          use_scan=use_scan, with_logits=with_logits)
        if raw_confidence:
            return toks, logits, conf
        c = sts_confidence(conf, self.cfg.sts_temperatures)
        if self.cfg.sts_temperatures_greedy:  # greedy requests: calibrated for argmax survival
            cg = sts_confidence(conf, self.cfg.sts_temperatures_greedy)
            c = jnp.where((sa.temperature == 0.0)[:, None], cg, c)
        return toks, logits, c


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Drafts `continuations[r][i]` for the token at position prompt_len_r + i (a one-hot draft
    distribution). With the target's own greedy continuation, greedy verification accepts
    everything up to where the continuation ends. Equality (the jit cache key) covers only the
    static fields, so oracles with same-shaped tables share one compiled program."""

    continuations: np.ndarray = dataclasses.field(compare=False)  # [S, C] int32, −1 = unknown
    prompt_lens: np.ndarray = dataclasses.field(compare=False)  # [S]
    block_size: int = 7
    vocab_size: int = 0
    feature_layers: tuple[int, ...] = ()
    reads_tokens = False

    @classmethod
    def from_lists(cls, conts: list[list[int]], prompt_lens: list[int], vocab_size: int, block_size=7,
                   length: int | None = None):
        C = (length or max(1, max(len(c) for c in conts))) + block_size + 1
        arr = np.full((len(conts), C), -1, np.int32)
        for i, c in enumerate(conts):
            arr[i, : len(c)] = c
        return cls(arr, np.asarray(prompt_lens, np.int32), block_size, vocab_size)

    @property
    def params(self):
        return (jnp.asarray(self.continuations), jnp.asarray(self.prompt_lens))

    def bind(self, target) -> OracleDrafter:
        return self

    def init_cache(self, params, num_slots, length):
        # The only state: which continuation each slot drafts from (its request), so that
        # slots can be compacted (`take_slots`) when requests finish.
        return jnp.arange(num_slots, dtype=jnp.int32)

    def take_slots(self, cache, idx):
        return cache[idx]

    def append(self, params, cache, target, feats, slot, pos, valid):
        return cache

    def draft(self, params, cache, target, anchor_S, anchor_pos_S, keys_S, sa):
        conts, plen = params
        S, G = anchor_S.shape[0], self.block_size
        rows = cache[:, None] % conts.shape[0]
        # Token at absolute position anchor_pos + 1 + k is continuation index anchor_pos + 1 + k − prompt_len.
        idx = anchor_pos_S[:, None] + 1 + jnp.arange(G) - plen[rows[:, 0]][:, None]
        tok = conts[rows, jnp.clip(idx, 0, conts.shape[1] - 1)]
        tok = jnp.where((idx >= 0) & (idx < conts.shape[1]) & (tok >= 0), tok, 0)
        logits = jnp.where(jax.nn.one_hot(tok, self.vocab_size) > 0, 0.0, -jnp.inf)
        return tok, logits, jnp.ones((S, G), jnp.float32)
