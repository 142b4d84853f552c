"""The DSpark training loss (CE + TV + confidence) and its metrics.

Shape letters (docs/architecture.md): B sequences, A anchors, G block positions γ, V target vocab, P proposal
vocab V′ (= V without a draft vocabulary).

L = α_ce·L_ce + α_tv·L_tv + α_conf·L_conf + α_kl·L_kl, each term normalised by the sum of
its weights w_k = exp(−(k−1)/λ) over supervised block positions:
  L_ce   = −Σ w log p_d(x*)                (positions whose x* lies in the draft vocabulary)
  L_tv   = Σ w ‖p_d − p_t‖₁               (over the FULL vocabulary: the target's mass
                                           outside the draft vocabulary counts as lost)
  L_conf = Σ w BCE(c, c*),  c* = 1 − ½‖p_d − p_t‖₁, detached.
  L_kl   = −Σ w Σ_v p_t(v) log p_d(v)     (soft cross-entropy = KL(p_t ‖ p_d) + const, over
                                           the draft vocabulary)
DeepSpec's DSpark mix is α = (0.1, 0.9, 1.0, 0). The TV gradient on a logit scales with the
draft's own probability of the token (≈ 1/V′ at init), so from scratch that mix learns
slowly; CE and KL have gradient p_d − p_t and learn at once (see `LossConfig`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The loss mix (hashable: a static argument of the jitted train step).

    `labels`: "data" — CE on the sequence's own next tokens (DeepSpec); "target" — CE on the
    target's argmax at each predicted position (what greedy verification accepts), and the
    sequential head is teacher-forced on those argmax tokens too. With greedy-regenerated data
    the two agree; on off-policy text (a dataset's own answers) "target" still teaches what the
    target would say.
    """
    decay: float = 4.0  # λ
    # With a draft vocabulary: the target's distribution over it only, renormalised (EAGLE-3's
    # choice), and its argmax there as the "target" label — the target's LM head over V′
    # instead of V (6× fewer FLOPs for SmolLM2's 49k → 8k), the step's largest matmul. A
    # position whose true argmax lies outside V′ can never be accepted anyway; TV and the
    # confidence label then ignore the mass outside V′ (slightly optimistic).
    target_over_proposal: bool = False
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    alpha_kl: float = 0.0
    labels: str = "data"

    def __post_init__(self):
        if self.labels not in ("data", "target"):
            raise ValueError(f"loss labels must be 'data' or 'target', got {self.labels!r}")
        if self.decay <= 0:
            raise ValueError(f"loss decay (λ) must be > 0, got {self.decay}")
        al = (self.alpha_ce, self.alpha_tv, self.alpha_conf, self.alpha_kl)
        if min(al) < 0 or max(al) == 0:
            raise ValueError(f"loss weights must be ≥ 0 and not all 0, got {al}")

    @property
    def alpha(self) -> tuple[float, float, float, float]:
        return (self.alpha_ce, self.alpha_tv, self.alpha_conf, self.alpha_kl)


def position_weights(block_size: int, decay: float):
    """w_k = exp(−(k−1)/λ), k = 1..γ."""
    return jnp.exp(-jnp.arange(block_size, dtype=jnp.float32) / decay)


def dspark_loss(draft_logits_BAGP, conf_logit_BAG, tgt_logp_BAGP, tgt_in_mass_BAG, labels_BAG,
                label_in_vocab_BAG, block_mask_BAG, *, decay: float, alpha=(0.1, 0.9, 1.0, 0.0)):
    """Returns (loss, metrics). `tgt_logp_BAGP`: the target's log-probabilities (normalised
    over all V) restricted to the proposal vocabulary; `tgt_in_mass_BAG`: the target's mass on
    the proposal vocabulary (1 without a draft vocabulary)."""
    G = draft_logits_BAGP.shape[2]
    w = position_weights(G, decay)[None, None] * block_mask_BAG
    logp_d = jax.nn.log_softmax(draft_logits_BAGP.astype(jnp.float32), -1)
    p_d, p_t = jnp.exp(logp_d), jnp.exp(tgt_logp_BAGP)
    l1 = jnp.sum(jnp.abs(p_d - p_t), -1) + (1.0 - tgt_in_mass_BAG)  # ‖p_d − p_t‖₁ over V
    ce = -jnp.take_along_axis(logp_d, labels_BAG[..., None], -1)[..., 0]
    w_ce = w * label_in_vocab_BAG
    accept = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))  # c*: P(accept) under sampling
    c = jax.nn.sigmoid(conf_logit_BAG)
    # BCE from logits (stable): −[c* log σ(z) + (1 − c*) log σ(−z)].
    bce = -(accept * jax.nn.log_sigmoid(conf_logit_BAG) + (1 - accept) * jax.nn.log_sigmoid(-conf_logit_BAG))

    def norm(x, ww):
        return jnp.sum(x * ww) / jnp.maximum(jnp.sum(ww), 1e-9)

    l_ce, l_tv, l_conf = norm(ce, w_ce), norm(l1, w), norm(bce, w)
    alpha = tuple(alpha) + (0.0,) * (4 - len(alpha))
    loss = alpha[0] * l_ce + alpha[1] * l_tv + alpha[2] * l_conf
    l_kl = jnp.zeros((), jnp.float32)
    if alpha[3]:
        l_kl = norm(-jnp.sum(p_t * logp_d, -1), w)
        loss = loss + alpha[3] * l_kl
    # Greedy agreement: the draft's argmax equals the target's (T = 0 acceptance, teacher-forced).
    greedy = (jnp.argmax(draft_logits_BAGP, -1) == jnp.argmax(tgt_logp_BAGP, -1)).astype(jnp.float32)
    # Expected accepted length of a full block under sampling: 1 + Σ_k Π_{i≤k} (1 − TV_i),
    # over blocks whose γ positions are all supervised.
    full = jnp.all(block_mask_BAG > 0, -1)
    surv = jnp.cumprod(accept, -1)
    tau = jnp.sum((1.0 + jnp.sum(surv, -1)) * full) / jnp.maximum(jnp.sum(full), 1)
    m = block_mask_BAG
    metrics = {
        "loss": loss, "ce": l_ce, "tv": l_tv, "conf_bce": l_conf, "kl": l_kl,
        "expected_tau": tau,
        "acceptance": jnp.sum(accept * m, (0, 1)) / jnp.maximum(jnp.sum(m, (0, 1)), 1),  # [G]
        # Expected accepted length at T = 0 over full blocks: 1 + Σ_k Π_{i≤k} 1[argmax match].
        "greedy_tau": jnp.sum((1.0 + jnp.sum(jnp.cumprod(greedy, -1), -1)) * full) / jnp.maximum(jnp.sum(full), 1),
        "greedy_acceptance": jnp.sum(greedy * m, (0, 1)) / jnp.maximum(jnp.sum(m, (0, 1)), 1),  # [G]
        "conf_abs_err": norm(jnp.abs(c - accept), m),
        "supervised": jnp.sum(m),
    }
    return loss, metrics
