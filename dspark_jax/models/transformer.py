"""The target decoder (Llama / Qwen2 / Qwen3) with a slot-based KV cache.

Shape letters (docs/architecture.md, "Shape letters"): L layers, S cache slots, T cache length, Q max tokens
per slot in one step, N packed tokens, D model width, K KV heads, E head dim, V vocab, F tapped
features (n·D).

One forward serves every use: a *packed step* takes a flat array of N tokens (N a static
bucket size) laid out slot-major, described by per-slot `starts` (tokens already in the
cache) and `counts` (tokens of this slot in the step). Dense layers run on the N packed
tokens, so the cost follows N; attention scatters the step's K/V into the cache first and
then lets every slot's queries (gathered into an [S, Q] grid) attend to their own cache row
with the causal rule `key position <= query position`. Prefill (starts = 0), a decode step
(counts = 1), verification of draft blocks (counts = 1 + ℓ_r) and the full forward are all
packed steps. Cache entries past a slot's committed length (e.g. rejected drafts) are
never read before they are overwritten, because a slot's step tokens always start at its
committed length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspark_jax.config import ModelConfig
from dspark_jax.models.layers import (
    MLP,
    RECENT,
    Attention,
    Linear,
    RMSNorm,
    attend_cached,
    attend_cached_and_new,
    attend_in_fixed_order,
    narrow_weight_dot,
    param,
    rope_inv_freq,
)


@struct.dataclass
class KVCache:
    """Keys and values of every layer, in one of two layouts (a static flag):

    - heads-major (the target's, `KVCache.zeros`): k [S, K, E, T] (keys stored transposed),
      v [S, K, T, E] per layer. A slot's keys for one head are an [E, T] matrix, so decode and
      verification scores are a multiply-reduce vectorised over T and prefill scores a plain
      [Q·I, E] × [E, T] matmul: no per-step transpose (`layers.attend_cached`).
    - position-major (`heads_major=False`, the drafter's context cache): k, v [L, S, T, K, E].

    The target's cache is a tuple of per-layer arrays for unrolled layers and one stacked
    [L, ...] array for scanned layers (`lax.scan` walks the leading axis). Per-layer buffers
    matter on CPU: the fused attention reads its operands whole, so a layer's slice of a
    stacked buffer — or a window cut from a longer cache — is first copied out, once per
    layer and step (BENCHMARKS.md, "Engine cost"). The decode loops therefore size the cache
    to the attention window (`resized`) instead of slicing it.

    Every array keeps its slot, head and position axes at the same negative index whatever
    the leading axes, which is how the methods below treat both forms alike.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    heads_major: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_slots: int, length: int, dtype=None) -> KVCache:
        """The target's cache (heads-major): per-layer arrays, or stacked ones for scanned layers."""
        L, S, T, K, E = cfg.num_layers, num_slots, length, cfg.num_kv_heads, cfg.head_dim
        dt = dtype or cfg.jnp_dtype
        if cfg.scan_layers:
            return cls(jnp.zeros((L, S, K, E, T), dt), jnp.zeros((L, S, K, T, E), dt), heads_major=True)
        return cls(tuple(jnp.zeros((S, K, E, T), dt) for _ in range(L)),
                   tuple(jnp.zeros((S, K, T, E), dt) for _ in range(L)), heads_major=True)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def _k0(self) -> jax.Array:
        """The first layer's keys (or the stacked keys): where the shapes are read."""
        return self.k[0] if self.per_layer else self.k

    def map_arrays(self, f) -> KVCache:
        """f(array, is_key) applied to every array."""
        if self.per_layer:
            return self.replace(k=tuple(f(x, True) for x in self.k), v=tuple(f(x, False) for x in self.v))
        return self.replace(k=f(self.k, True), v=f(self.v, False))

    def _time_axis(self, is_key: bool) -> int:
        return (-1 if is_key else -2) if self.heads_major else -3

    # slot axis: -4 in every layout ([.., S, K, E, T], [.., S, K, T, E], [L, S, T, K, E])
    @property
    def num_slots(self) -> int:
        return self._k0.shape[-4]

    @property
    def length(self) -> int:
        return self._k0.shape[self._time_axis(True)]

    @property
    def heads_axis(self) -> int:
        """The KV-heads axis of every array, counted from the end (what tensor parallelism splits)."""
        return -3 if self.heads_major else -2

    def take(self, idx) -> KVCache:
        """The slots `idx` (slot compaction)."""
        return self.map_arrays(lambda x, _: jnp.take(x, idx, axis=x.ndim - 4))

    def window(self, w: int | None) -> KVCache:
        """The first `w` positions of every slot (None or ≥ T: the whole cache)."""
        if w is None or w >= self.length:
            return self
        return self.map_arrays(lambda x, key: jax.lax.slice_in_dim(x, 0, w, axis=x.ndim + self._time_axis(key)))

    def resized(self, length: int) -> KVCache:
        """The cache with `length` positions per slot: cut (positions past it must be unused)
        or zero-padded. One copy, where reading a window of a longer cache copies it every step."""
        T = self.length
        if length == T:
            return self
        if length < T:
            return self.window(length)

        def pad(x, key):
            widths = [(0, 0)] * x.ndim
            widths[x.ndim + self._time_axis(key)] = (0, length - T)
            return jnp.pad(x, widths)

        return self.map_arrays(pad)

    def slot_row(self, slot) -> KVCache:
        """Slot `slot`'s entries (a one-slot cache)."""
        return self.map_arrays(lambda x, _: jax.lax.dynamic_index_in_dim(x, slot, x.ndim - 4))

    def with_slot_row(self, row: KVCache, slot) -> KVCache:
        """This cache with slot `slot` overwritten by the one-slot cache `row`, whose
        positions may be fewer (a row cut to a window: the positions past it are kept)."""

        def paste(x, r):
            at = [0] * x.ndim
            at[x.ndim - 4] = slot
            return jax.lax.dynamic_update_slice(x, r.astype(x.dtype), at)

        if self.per_layer:
            return self.replace(k=tuple(map(paste, self.k, row.k)), v=tuple(map(paste, self.v, row.v)))
        return self.replace(k=paste(self.k, row.k), v=paste(self.v, row.v))


@struct.dataclass
class PackedLayout:
    """Where each packed token goes; derived on device from (starts, counts)."""

    slot_N: jax.Array  # slot of each packed token (clipped for padding)
    j_N: jax.Array  # index of the token inside its slot's step
    pos_N: jax.Array  # absolute position
    valid_N: jax.Array  # False for bucket padding
    grid_idx_SQ: jax.Array  # packed index of grid cell (s, q), N for empty cells
    grid_pos_SQ: jax.Array
    grid_valid_SQ: jax.Array


def packed_layout(starts_S, counts_S, num_tokens: int, q_max: int) -> PackedLayout:
    ends = jnp.cumsum(counts_S)
    offs = ends - counts_S
    n = jnp.arange(num_tokens)
    S = starts_S.shape[0]
    slot = jnp.clip(jnp.searchsorted(ends, n, side="right"), 0, S - 1)
    j = n - offs[slot]
    valid = n < ends[-1]
    pos = starts_S[slot] + j
    q = jnp.arange(q_max)
    grid_valid = q[None, :] < counts_S[:, None]
    grid_idx = jnp.where(grid_valid, offs[:, None] + q[None, :], num_tokens)
    grid_pos = starts_S[:, None] + q[None, :]
    return PackedLayout(slot, j, pos, valid, grid_idx, grid_pos, grid_valid)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs):
        dt = cfg.jnp_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.mlp = MLP(cfg, rngs=rngs)

    def qkv(self, x_ND, lay: PackedLayout, inv_freq):
        h = self.input_layernorm(x_ND)
        q = self.self_attn.project_q(h, lay.pos_N, inv_freq)
        k, v = self.self_attn.project_kv(h, lay.pos_N, inv_freq)
        return q, k, v

    def finish(self, x_ND, q_NHE, kt_SKET, v_SKTE, lay: PackedLayout, mask_SQT, new=None, recent=RECENT):
        """Attention of the step's queries over the cache, then the MLP. `mask_SQT` None: a
        batch-invariant decode step (at most `recent` queries a slot, `attend_in_fixed_order`),
        `new` = (k [N, K, E], v [N, K, E]) the step's keys and values when the cache does not
        hold them yet (a deferred write). Otherwise `mask_SQT` says which cached positions each
        query reads: [S, Q, T] with the step already written, or [S, T] (the committed
        context) with `new` = (k, v, mask [S, Q, Q]) beside it (`attend_cached_and_new`)."""
        grid = _grid(q_NHE, lay)
        if mask_SQT is None:
            new_SQ = None if new is None else (_grid(new[0], lay), _grid(new[1], lay))
            o_SQHE = attend_in_fixed_order(grid, kt_SKET, v_SKTE, lay.grid_pos_SQ, lay.grid_valid_SQ, new_SQ, recent)
        elif new is None:
            o_SQHE = attend_cached(grid, kt_SKET, v_SKTE, mask_SQT)
        else:
            k_N, v_N, new_SQQ = new
            o_SQHE = attend_cached_and_new(grid, kt_SKET, v_SKTE, mask_SQT, _grid(k_N, lay), _grid(v_N, lay), new_SQQ)
        o = o_SQHE[lay.slot_N, jnp.minimum(lay.j_N, o_SQHE.shape[1] - 1)]
        x_ND = x_ND + self.self_attn.project_out(o)
        return x_ND + self.mlp(self.post_attention_layernorm(x_ND))


def _grid(x_N, lay: PackedLayout):
    """Packed rows [N, ...] → the [S, Q, ...] grid (empty cells read a zero row)."""
    return jnp.concatenate([x_N, jnp.zeros_like(x_N[:1])], 0)[lay.grid_idx_SQ]


@struct.dataclass
class StepKV:
    """A step's new keys and values, not yet in the cache (`Transformer(..., defer_write=N)`):
    k, v [L, N, K, E] and where each packed token goes (`_write_index`: slot S = dropped)."""

    k: jax.Array
    v: jax.Array
    slot: jax.Array  # [N + 1]
    pos: jax.Array  # [N + 1]

    def padded(self, num_tokens: int) -> StepKV:
        """The same writes with `num_tokens` packed rows (the extra ones dropped), so that
        steps of different sizes return one shape from `lax.switch`."""
        n = num_tokens - self.k.shape[1]
        rows = ((0, 0), (0, n), (0, 0), (0, 0))
        S_drop = jnp.max(self.slot)  # the trailing dummy's slot is S: out of range
        return StepKV(jnp.pad(self.k, rows), jnp.pad(self.v, rows),
                      jnp.concatenate([self.slot, jnp.full((n,), S_drop, self.slot.dtype)]),
                      jnp.concatenate([self.pos, jnp.zeros((n,), self.pos.dtype)]))

    def write(self, cache: KVCache) -> KVCache:
        """The cache with these keys and values scattered in (in place when donated)."""
        if cache.per_layer:
            ks, vs = list(cache.k), list(cache.v)
            for i in range(len(ks)):
                ks[i], vs[i] = _write_layer(ks[i], vs[i], None, self.slot, self.pos, self.k[i], self.v[i])
            return cache.replace(k=tuple(ks), v=tuple(vs))
        ks, vs = cache.k, cache.v
        for i in range(ks.shape[0]):
            ks, vs = _write_layer(ks, vs, i, self.slot, self.pos, self.k[i], self.v[i])
        return cache.replace(k=ks, v=vs)


def _write_index(lay: PackedLayout, num_slots: int):
    """(slot, position) of each packed token's cache write, plus one trailing dummy entry.

    Padding tokens target slot S (out of range) and are dropped by the scatter. The dummy
    (also slot S, so always dropped) keeps a one-token step a scatter: XLA rewrites a
    single-update scatter as a bounds-checked dynamic-update-slice, which copies the whole
    cache buffer once per layer (measured: a 1-slot decode step 2.3× slower). Used by
    `_write_layer`."""
    ws = jnp.where(lay.valid_N, lay.slot_N, num_slots)
    return jnp.append(ws, num_slots), jnp.append(lay.pos_N, 0)


def _write_layer(ks, vs, i, ws, wp, k_NKE, v_NKE):
    """Layer i's new keys and values scattered into the heads-major buffers at the
    `_write_index` entries (k [N, K, E] lands at [slot, :, :, pos] of the transposed keys);
    the dummy entry gets zeros and is dropped. `i` None: `ks`, `vs` are the layer's own
    buffers [S, ...]; otherwise the stacked [L, S, ...] ones."""

    def padded(x):
        return jnp.concatenate([x, jnp.zeros_like(x[:1])], 0)

    lead = () if i is None else (i,)
    ks = ks.at[(*lead, ws, slice(None), slice(None), wp)].set(padded(k_NKE).astype(ks.dtype), mode="drop")
    vs = vs.at[(*lead, ws, slice(None), wp)].set(padded(v_NKE).astype(vs.dtype), mode="drop")
    return ks, vs


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = cfg.jnp_dtype
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r):
                return DecoderLayer(cfg, rngs=r)

            self.layers = make(rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, "embed")
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)
        )
        self.set_config(cfg)

    lm_head_layout = "dv"

    def set_config(self, cfg: ModelConfig):
        """Sets the config after a change that keeps the weights' shapes (`Target`'s narrowed
        weights, `batch_invariant`), and with it how every norm sums (`RMSNorm.fixed_order`)."""
        self.cfg = cfg
        for _, m in nnx.iter_graph(self):
            if isinstance(m, RMSNorm):
                m.fixed_order = cfg.fixed_order_decode

    def narrow_weights(self, dtype, terms: int = 3):
        """Stores every matmul weight (projections, LM head) as `dtype` — bfloat16 under float32
        activations: `layers.narrow_weight_dot` multiplies them exactly in the activations, so
        the model computes as the float32 model with bf16-rounded weights.

        The embedding *lookup* table keeps its wide dtype, with bf16-rounded values (a step
        reads one row of it per token; a tied LM head becomes a narrowed copy of it). Looking
        rows up in a narrowed table, XLA:CPU moves the convert in front of the gather — onto
        the whole [V, D] table — and hoists it out of the decode loop: 113 MB written per loop
        call for SmolLM2, ~28 ms on a 2-core CPU, where the serving engine calls the loop every
        few cycles (an optimization barrier does not stop it; gathering raw bits still copies
        the table once per call)."""
        for _, m in nnx.iter_graph(self):
            if isinstance(m, Linear):
                m.narrow(dtype, terms)
        emb = self.embed_tokens
        axes = tuple(emb.get_metadata()["axes"])
        if self.lm_head is None:  # tied: the head is the table's rows, [V, D] as `narrow_weight_dot` reads it
            self.lm_head = nnx.data(nnx.Param(emb[...].astype(dtype), axes=axes))
            self.lm_head_layout = "vd"
        elif self.lm_head_layout == "dv":
            self.lm_head = nnx.Param(self.lm_head[...].T.astype(dtype), axes=("vocab", "embed"))
            self.lm_head_layout = "vd"
        # The table's values rounded like every other weight, stored wide.
        self.embed_tokens = nnx.Param(emb[...].astype(dtype).astype(emb[...].dtype), axes=axes)

    # The drafter shares these two (frozen) with the target.
    def embed(self, tokens):
        # Rows of a wide table (`narrow_weights` keeps it wide: see there why).
        return self.embed_tokens[...][tokens].astype(self.cfg.jnp_dtype)

    def lm_head_matrix(self):
        """[D, V]."""
        if self.lm_head is None:
            return self.embed_tokens[...].T
        return self.lm_head[...].T if self.lm_head_layout == "vd" else self.lm_head[...]

    def unembed(self, h_ND):
        """Final norm + LM head, logits in fp32."""
        h = self.norm(h_ND)
        if self.lm_head is None:  # tied: contract with the [V, D] embedding as stored (no transposed copy)
            emb = self.embed_tokens[...]
            if emb.dtype != h.dtype:
                return narrow_weight_dot(h, emb, self.cfg.weight_terms).astype(jnp.float32)
            return jnp.einsum("...d,vd->...v", h, emb, preferred_element_type=jnp.float32)
        if self.lm_head_layout == "vd":
            return narrow_weight_dot(h, self.lm_head[...], self.cfg.weight_terms).astype(jnp.float32)
        return jnp.einsum("...d,dv->...v", h, self.lm_head[...], preferred_element_type=jnp.float32)

    def __call__(self, cache: KVCache, tokens_N, starts_S, counts_S, *, q_max: int,
                 logits_idx=None, feature_layers: tuple[int, ...] = (), kv_window: int | None = None,
                 defer_write: bool = False):
        """Packed step. Returns (logits [M, V] fp32, features [N, n·D] or None, new cache).

        `logits_idx` [M] selects which packed tokens get logits (None = all N); prefill
        asks only for each slot's last token, which saves the [N, V] projection.
        `kv_window` (static, ≤ T): attention reads only the first `kv_window` cache positions,
        so a step costs what the used context costs, not the allocated cache. The caller
        guarantees every query position of the step lies below it.
        `defer_write`: the cache is only read (each query attends to its slot's positions
        before `starts` in the cache plus the step's own tokens) and the third result is the
        step's `StepKV` instead of the updated cache, to `write` later. Inside `lax.switch` a
        branch that updates a buffer makes XLA copy that buffer whole, in every branch, every
        step (the confidence schedulers' bucket switch copied the whole KV cache twice a step).
        """
        cfg = self.cfg
        if not cache.heads_major:
            raise ValueError("the target's KV cache is heads-major: make it with KVCache.zeros")
        N = tokens_N.shape[0]
        T = cache.length
        W = T if kv_window is None else min(int(kv_window), T)
        lay = packed_layout(starts_S, counts_S, N, q_max)
        # A decode step (or a deferred write) attends in a fixed order: its numbers do not depend
        # on the step's shape. A block longer than RECENT queries a slot widens the recent part
        # (exact still, but no longer bitwise the same as one-token steps').
        recent = max(RECENT, q_max) if defer_write else RECENT
        fixed = cfg.fixed_order_decode and (defer_write or q_max <= RECENT)
        if fixed:
            mask = None
        elif defer_write:
            mask = jnp.arange(W)[None, :] < starts_S[:, None]  # [S, W]: the committed context
            q = jnp.arange(q_max)
            new_mask = (q[None, :] <= q[:, None])[None] & lay.grid_valid_SQ[:, None, :]  # [S, Q, Q]
        else:
            mask = (jnp.arange(W)[None, None, :] <= lay.grid_pos_SQ[..., None]) & lay.grid_valid_SQ[..., None]
        def new_of(k, v):  # the step's own keys and values beside the cache (a deferred write)
            if not defer_write:
                return None
            return (k, v) if fixed else (k, v, new_mask)

        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        x = self.embed(tokens_N)
        taps = {-1: x} if -1 in feature_layers else {}
        ws, wp = _write_index(lay, cache.num_slots)
        if cfg.scan_layers:
            if cache.per_layer:
                raise ValueError("scanned layers take a stacked KV cache: make it with KVCache.zeros")
            gdef, lstate = nnx.split(self.layers)

            # The whole stacked cache rides in the carry and each layer scatters into its own
            # slice: XLA updates the loop's buffer in place. (Passing per-layer slices as scan
            # inputs and stacking them back as outputs copies the whole cache every step.)
            def body(carry, st):
                x, ks, vs, i = carry
                layer = nnx.merge(gdef, st)
                q, k, v = layer.qkv(x, lay, inv_freq)
                if not defer_write:
                    ks, vs = _write_layer(ks, vs, i, ws, wp, k, v)
                k_w = jax.lax.dynamic_index_in_dim(ks, i, 0, keepdims=False)[..., :W]
                v_w = jax.lax.dynamic_index_in_dim(vs, i, 0, keepdims=False)[:, :, :W]
                x = layer.finish(x, q, k_w, v_w, lay, mask, new_of(k, v), recent)
                return (x, ks, vs, i + 1), (x if feature_layers else None, k if defer_write else None,
                                            v if defer_write else None)

            (x, ks, vs, _), (hs, new_k, new_v) = jax.lax.scan(body, (x, cache.k, cache.v, jnp.int32(0)), lstate)
            cache = StepKV(new_k, new_v, ws, wp) if defer_write else cache.replace(k=ks, v=vs)
            taps.update({i: hs[i] for i in feature_layers if i >= 0})
        else:
            if not cache.per_layer:
                raise ValueError("unrolled layers take a per-layer KV cache: make it with KVCache.zeros")
            ks, vs = list(cache.k), list(cache.v)
            new_k, new_v = [], []
            for i, layer in enumerate(self.layers):
                q, k, v = layer.qkv(x, lay, inv_freq)
                if defer_write:
                    new_k.append(k)
                    new_v.append(v)
                else:
                    ks[i], vs[i] = _write_layer(ks[i], vs[i], None, ws, wp, k, v)
                # W < T copies the window out (on CPU); the decode loops size the cache to it.
                k_w = ks[i] if W == T else ks[i][..., :W]
                v_w = vs[i] if W == T else vs[i][:, :, :W]
                x = layer.finish(x, q, k_w, v_w, lay, mask, new_of(k, v), recent)
                if i in feature_layers:
                    taps[i] = x
            if defer_write:
                cache = StepKV(jnp.stack(new_k), jnp.stack(new_v), ws, wp)
            else:
                cache = cache.replace(k=tuple(ks), v=tuple(vs))
        feats = jnp.concatenate([taps[i] for i in feature_layers], -1) if feature_layers else None
        h = x if logits_idx is None else x[logits_idx]
        return self.unembed(h), feats, cache


# --------------------------------------------------------------------------- pure entry points


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "q_max", "feature_layers", "last_only"),
    donate_argnames=("cache",),
)
def packed_step(graphdef, state, cache, tokens_N, starts_S, counts_S, *, q_max,
                feature_layers=(), last_only=False):
    """Jitted packed step; donates the cache it replaces. `last_only`: logits of each slot's last token [S, V]."""
    model = nnx.merge(graphdef, state)
    idx = jnp.maximum(jnp.cumsum(counts_S) - 1, 0) if last_only else None
    return model(cache, tokens_N, starts_S, counts_S, q_max=q_max, logits_idx=idx,
                 feature_layers=feature_layers)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def full_logits(graphdef, state, tokens_BT):
    """Full causal forward of [B, T] token ids → [B, T, V] fp32 logits (a throwaway cache)."""
    model = nnx.merge(graphdef, state)
    B, T = tokens_BT.shape
    cache = KVCache.zeros(model.cfg, B, T)
    logits, _, _ = model(cache, tokens_BT.reshape(-1), jnp.zeros(B, jnp.int32),
                         jnp.full(B, T, jnp.int32), q_max=T)
    return logits.reshape(B, T, -1)
