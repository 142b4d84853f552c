"""Prompt lookup (n-gram) drafting: a drafter that needs no training.

The drafter keeps every request's committed tokens (prompt and output) in a per-slot token
buffer. Each cycle it takes the last n tokens of the request (the anchor included), finds
their most recent earlier occurrence in the request's own context — the longest n from
`max_ngram` down to `min_ngram` — and proposes the γ tokens that followed it. This is what
vLLM's `ngram` speculator, HF `prompt_lookup_num_tokens` and llama.cpp's lookup decoding do;
here it runs on device inside the same cycle, verification, schedulers and engine as the
DSpark drafter, so it is lossless by the same rules:

- the draft distribution is the one-hot of the proposed token (the proposal is a
  deterministic function of the context), so rejection sampling accepts it with probability
  p_target(token) and resamples from the residual otherwise — exactly the target;
- its confidences are a prior indexed by the match length and the draft position (longer
  matches continue more often, and a draft whose predecessors held holds more often); they
  follow from the committed context alone, so the async scheduler reads them before
  drafting (`foresight`) and budgets each cycle by its own match. Positions past what the
  context can continue get confidence 0 (and token 0).

Shape letters (docs/architecture.md): S slots, T cache length, G block size γ, N packed tokens, V vocab, J the
positions j = 0 .. max_ngram−1 back from the anchor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.sampling_transform import SamplingArrays

# P(draft k survives | drafts < k did), by match length 0 .. 4+ (rows; 0 = no match: nothing
# to draft) and draft position k = 1 .. 7 (columns): greedy lookup replayed on SmolLM2's greedy
# answers to 4,672 training prompts, 366,793 cycles (`python -m benchmarks.bench_ngram_prior
# --data train/data/smollm2-135m-greedy-5.npz`; BENCHMARKS.md, "Stop 39"). The first draft of a
# short match is the weak one (2-gram: 0.53, then 0.64 .. 0.86 once it held); a prior pooled
# over positions (0.37 / 0.70 / 0.70 / 0.95 before) overstated exactly the first draft, which
# every later one's survival multiplies. The async scheduler budgets each cycle by these
# (`foresight`: the match is known before drafting).
DEFAULT_CONFIDENCE = (
    (0.0,),
    (0.25, 0.57, 0.65, 0.71, 0.74, 0.77, 0.80),
    (0.53, 0.64, 0.73, 0.78, 0.81, 0.84, 0.86),
    (0.68, 0.64, 0.78, 0.70, 0.66, 0.80, 0.86),
    (0.89, 0.91, 0.92, 0.93, 0.94, 0.94, 0.95),
)


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """`ds.NgramDrafter()` (or `ds.load_drafter("ngram", target)`): prompt lookup drafting.

    block_size: γ, tokens proposed per cycle. max_ngram / min_ngram: the longest and shortest
    suffix matched (the longest match wins; among equal lengths, the most recent).
    confidence: the survival prior P(draft k survives | drafts < k did) by match length n
      (row min(n, rows − 1)); a row is one value for every position, or one per position
      (a row shorter than γ repeats its last value).
    """

    block_size: int = 7
    max_ngram: int = 4
    min_ngram: int = 1
    vocab_size: int = 0  # filled from the target by `bind` (one-hot draft distributions)
    confidence: tuple = DEFAULT_CONFIDENCE
    feature_layers: tuple[int, ...] = ()  # reads no target features
    reads_tokens: bool = True  # the engine passes the committed tokens to `append`

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {self.block_size}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 ≤ min_ngram ≤ max_ngram, got {self.min_ngram}, {self.max_ngram}")
        rows = [r if isinstance(r, (tuple, list)) else (r,) for r in self.confidence]
        if not rows or any(not r or any(not 0.0 <= float(c) <= 1.0 for c in r) for r in rows):
            raise ValueError(f"confidence must be rows of values in [0, 1] (one row per match length), "
                             f"got {self.confidence}")

    def bind(self, target) -> NgramDrafter:
        V = target.cfg.vocab_size
        return self if self.vocab_size == V else dataclasses.replace(self, vocab_size=V)

    @property
    def params(self):
        return None

    # --- the engine interface (pure; called inside jit) ---
    def init_cache(self, params, num_slots: int, length: int):
        """The token buffer [S, T]: token at each committed cache position (−1 = none yet)."""
        return jnp.full((num_slots, length), -1, jnp.int32)

    def take_slots(self, cache, idx):
        return cache[idx]

    def append(self, params, cache, target, feats_NF, slot_N, pos_N, valid_N, tokens_N=None):
        if tokens_N is None:
            raise ValueError("NgramDrafter.append needs the committed tokens (tokens_N)")
        S = cache.shape[0]
        ws = jnp.where(valid_N, slot_N, S)  # invalid → out of range → dropped
        return cache.at[ws, pos_N].set(tokens_N.astype(jnp.int32), mode="drop")

    def lookup(self, buf_ST, anchor_S, anchor_pos_S):
        """→ (tokens [S, G], match length [S], continuation known [S, G])."""
        S, T = buf_ST.shape
        G, J = self.block_size, self.max_ngram
        p = anchor_pos_S[:, None]  # the anchor's position (its token is not in the buffer yet)
        t = jnp.arange(T)[None]
        # The context as a sequence: buffer positions < p, then the anchor at p.
        seq = jnp.where(t < p, buf_ST, -1)
        seq = jnp.where(t == p, anchor_S[:, None], seq)
        # The suffix to match: tokens at p, p−1, …, p−J+1.
        back = p - jnp.arange(J)[None]  # [S, J]
        suf = jnp.where(back >= 0, jnp.take_along_axis(seq, jnp.maximum(back, 0), 1), -2)
        # Occurrence ending at t (t < p): seq[t − j] == suf[j] for j < n.
        run = jnp.ones((S, T), bool)
        length = jnp.zeros((S, T), jnp.int32)
        for j in range(J):
            prev = jnp.pad(seq, ((0, 0), (j, 0)), constant_values=-3)[:, :T]  # seq[t − j]
            run = run & (prev == suf[:, j:j + 1]) & (suf[:, j:j + 1] >= 0)
            length = length + run
        length = jnp.where(t < p, length, 0)
        length = jnp.where(length >= self.min_ngram, length, 0)
        # Longest match first, then the most recent.
        best = jnp.argmax(length * T + t, 1)  # [S]
        n = jnp.take_along_axis(length, best[:, None], 1)[:, 0]
        src = best[:, None] + 1 + jnp.arange(G)[None]  # [S, G]
        known = (n[:, None] > 0) & (src <= p)
        tok = jnp.take_along_axis(seq, jnp.clip(src, 0, T - 1), 1)
        tok = jnp.where(known & (tok >= 0), tok, 0)
        return tok, n, known & (tok >= 0)

    def foresight(self, cache, anchor_S, anchor_pos_S):
        """(confidences [S, G], known [S]) before drafting (DrafterProtocol, optional): the
        block's prior confidences follow from the committed context alone, so the async
        scheduler budgets a cycle by this cycle's match rather than by earlier cycles."""
        found = self.lookup(cache, anchor_S, anchor_pos_S)
        return self.block_confidence(found), jnp.ones_like(found[1], bool)  # no match: confidence 0

    def draft(self, params, cache, target, anchor_S, anchor_pos_S, keys_S, sa: SamplingArrays, **_):
        """→ (tokens [S, G], one-hot draft logits [S, G, V], confidences [S, G])."""
        return self.block(self.lookup(cache, anchor_S, anchor_pos_S), target)

    def block(self, found, target):
        """The draft block of a `lookup` result: tokens, one-hot logits, prior confidences."""
        tok = found[0]
        V = self.vocab_size or target.cfg.vocab_size
        logits = jnp.where(jax.nn.one_hot(tok, V, dtype=jnp.bool_), 0.0, -jnp.inf)
        return tok, logits, self.block_confidence(found)

    def block_confidence(self, found):
        """[S, G] prior confidences of a `lookup` result, by match length."""
        _, n, known = found
        table = jnp.asarray(self.prior_table(), jnp.float32)  # [rows, G]
        c = table[jnp.minimum(n, table.shape[0] - 1)]  # [S, G]
        # Survival needs the whole prefix: after the first unknown position, nothing survives.
        known = jnp.cumprod(known.astype(jnp.int32), 1) > 0
        return jnp.where(known, c, 0.0)

    def prior_table(self) -> list[list[float]]:
        """`confidence` as [match lengths, γ]: a scalar row holds at every position, a short
        row repeats its last value."""
        G = self.block_size
        rows = [list(r) if isinstance(r, (tuple, list)) else [r] for r in self.confidence]
        return [[float(r[min(k, len(r) - 1)]) for k in range(G)] for r in rows]


@dataclasses.dataclass(eq=False)  # hashed by identity: a static jit argument
class HybridDrafter:
    """Prompt lookup where the context repeats itself, the trained drafter elsewhere.

    Each cycle, per request: if the longest suffix match in the request's own context has at
    least `min_match` tokens, the block is the n-gram continuation (its one-hot distribution
    and its prior confidences); otherwise it is the DSpark block (its sampled tokens, draft
    distribution and calibrated confidences). The choice depends on the committed context
    only — never on the tokens the DSpark drafter sampled in this cycle — so the proposal
    distribution verification sees is exactly the chosen drafter's, and the output stays
    the target's (tests/models/test_ngram.py).
    """

    drafter: Any  # a DSpark/DFlash `Drafter`
    ngram: NgramDrafter = None
    min_match: int = 2

    def __post_init__(self):
        if self.ngram is None:
            self.ngram = NgramDrafter(block_size=self.drafter.block_size)
        if self.ngram.block_size != self.drafter.block_size:
            raise ValueError(f"the n-gram block size ({self.ngram.block_size}) must equal the drafter's "
                             f"({self.drafter.block_size})")
        if not 1 <= self.min_match <= self.ngram.max_ngram:
            raise ValueError(f"min_match must lie in [1, {self.ngram.max_ngram}], got {self.min_match}")

    reads_tokens = True

    @property
    def cfg(self):
        return self.drafter.cfg

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.drafter.feature_layers

    @property
    def params(self):
        return self.drafter.params

    def bind(self, target) -> HybridDrafter:
        self.drafter = self.drafter.bind(target)
        self.ngram = self.ngram.bind(target)
        return self

    def init_cache(self, params, num_slots: int, length: int):
        return (self.drafter.init_cache(params, num_slots, length), self.ngram.init_cache(None, num_slots, length))

    def take_slots(self, cache, idx):
        kv, buf = cache
        return (self.drafter.take_slots(kv, idx), self.ngram.take_slots(buf, idx))

    def append(self, params, cache, target, feats_NF, slot_N, pos_N, valid_N, tokens_N=None):
        kv, buf = cache
        return (self.drafter.append(params, kv, target, feats_NF, slot_N, pos_N, valid_N),
                self.ngram.append(None, buf, target, feats_NF, slot_N, pos_N, valid_N, tokens_N=tokens_N))

    # The split append (DrafterProtocol), used when the wrapped drafter has one (`split_append`).
    def context_rows(self, params, target, feats_NF, pos_N):
        return self.drafter.context_rows(params, target, feats_NF, pos_N)

    def append_rows(self, params, cache, rows, slot_N, pos_N, valid_N, tokens_N=None):
        kv, buf = cache
        return (self.drafter.append_rows(params, kv, rows, slot_N, pos_N, valid_N),
                self.ngram.append(None, buf, None, None, slot_N, pos_N, valid_N, tokens_N=tokens_N))

    def foresight(self, cache, anchor_S, anchor_pos_S):
        """The lookup's confidences on the rows whose block will be the lookup's (see
        `NgramDrafter.foresight`); the trained drafter's rows are left to the scheduler."""
        found = self.ngram.lookup(cache[1], anchor_S, anchor_pos_S)
        return self.ngram.block_confidence(found), found[1] >= self.min_match

    def draft(self, params, cache, target, anchor_S, anchor_pos_S, keys_S, sa: SamplingArrays, **kw):
        kv, buf = cache
        t1, l1, c1 = self.drafter.draft(params, kv, target, anchor_S, anchor_pos_S, keys_S, sa, **kw)
        found = self.ngram.lookup(buf, anchor_S, anchor_pos_S)
        n = found[1]
        t2, l2, c2 = self.ngram.block(found, target)
        use = n >= self.min_match  # [S], from the context alone
        tok = jnp.where(use[:, None], t2, t1)
        conf = jnp.where(use[:, None], c2, c1.astype(jnp.float32))
        logits = None if l1 is None else jnp.where(use[:, None, None], l2, l1.astype(jnp.float32))
        return tok, logits, conf
