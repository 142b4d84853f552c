"""Shared helpers for the losslessness tests (test_verification.py, test_speculative*.py).

- `ref_probs`: an independent float64 NumPy reference of the sampling transform
  (temperature → top-k → top-p → min-p), so the statistical tests do not check the library
  against itself.
- `chi2_pvalue`: Pearson's chi-square of observed counts against exact probabilities, with
  a hard check that nothing lands on a probability-zero cell.
- `sample_rows`: one categorical draw per row from a [R, V] probability table.
- `bigram_target`: a one-layer target whose next-token distribution depends only on the
  previous token, so exact output distributions are computable in closed form.
- `sharpen`: redraws a random target's weights at informative scales (clear argmax gaps,
  so greedy comparisons across differently shaped programs are not decided by fp32 noise).
- `random_prompts`: token-id prompts of given lengths for the tiny targets.
- `window_tables`: a stand-in step-rate measurement whose table depends on the cache length.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

import dspark_jax as ds
from dspark_jax.decoding import profiling


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Transformed distribution(s) over the last axis, float64, exact zeros where removed."""
    x = np.asarray(logits, np.float64)
    if x.ndim > 1:
        return np.stack([ref_probs(r, temperature, top_k, top_p, min_p) for r in x.reshape(-1, x.shape[-1])]
                        ).reshape(x.shape)
    x = x / temperature
    keep = np.isfinite(x)
    order = np.argsort(-x, kind="stable")
    if top_k:
        thr = x[order[min(top_k, len(x)) - 1]]
        keep &= x >= thr
    if top_p < 1.0:
        p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        p /= p.sum()
        srt = p[order]
        before = np.cumsum(srt) - srt
        n_keep = max(int(np.sum((before < top_p) & (srt > 0))), 1)
        keep &= x >= x[order[n_keep - 1]]
    if min_p > 0.0:
        p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        keep &= p >= min_p * p.max()
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return p / p.sum()


def _chi2_stat(obs, probs, min_expected: float):
    obs = np.asarray(obs, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    assert obs.shape == probs.shape
    zero = probs == 0
    assert obs[zero].sum() == 0, (
        f"{int(obs[zero].sum())} samples on probability-zero cells {np.flatnonzero(zero & (obs > 0))}")
    n = obs.sum()
    exp = n * probs / probs.sum()
    small = (exp < min_expected) & ~zero
    big = ~small & ~zero
    o, e = list(obs[big]), list(exp[big])
    if small.any():
        o.append(obs[small].sum())
        e.append(exp[small].sum())
    if len(o) < 2:
        return 0.0, 0
    o, e = np.asarray(o), np.asarray(e)
    return float(np.sum((o - e) ** 2 / e)), len(o) - 1


def chi2_pvalue(obs, probs, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square for counts `obs` against exact probabilities `probs`.

    Cells of probability exactly 0 must be empty (asserted: a token outside the support is a
    bug at any sample size). Cells with expected count < `min_expected` are pooled into one
    bin so the chi-square approximation holds.
    """
    stat, df = _chi2_stat(obs, probs, min_expected)
    return 1.0 if df == 0 else float(stats.chi2.sf(stat, df))


def transitions_chi2_pvalue(prev, nxt, P, min_expected: float = 5.0) -> float:
    """Goodness of fit of observed transitions prev → nxt to the Markov kernel P [V, V].

    Transitions pooled over positions of the same sequences are not independent, but by the
    strong Markov property the successive transitions *out of a given state* are i.i.d.
    draws from P[a] (Anderson & Goodman, 1957); the per-row chi-squares therefore add up to
    a chi-square with the summed degrees of freedom.
    """
    prev, nxt = np.asarray(prev).ravel(), np.asarray(nxt).ravel()
    V = P.shape[0]
    stat, df = 0.0, 0
    for a in range(V):
        sel = prev == a
        if sel.any():
            s, d = _chi2_stat(np.bincount(nxt[sel], minlength=V), P[a], min_expected)
            stat, df = stat + s, df + d
    return 1.0 if df == 0 else float(stats.chi2.sf(stat, df))


def counts(x, V: int) -> np.ndarray:
    return np.bincount(np.asarray(x).ravel(), minlength=V)


def joint_counts(a, b, V: int) -> np.ndarray:
    return np.bincount(np.asarray(a) * V + np.asarray(b), minlength=V * V).reshape(V, V)


def sample_rows(rng: np.random.Generator, probs) -> np.ndarray:
    """One draw per row of `probs` [R, V] (inverse CDF; zero-probability tokens never drawn)."""
    probs = np.asarray(probs, np.float64)
    cdf = np.cumsum(probs, -1)
    u = rng.random(probs.shape[0]) * cdf[:, -1]
    tok = (u[:, None] >= cdf).sum(-1)
    return np.minimum(tok, probs.shape[1] - 1).astype(np.int32)


def _set(state, path, value):
    flat = []
    for p, var in nnx.to_flat_state(state):
        flat.append((p, var.replace(jnp.asarray(value(var[...]), var[...].dtype)) if p == path else var))
    return nnx.from_flat_state(flat)


def bigram_target(vocab_size: int = 8, lm_head_scale: float = 20.0, seed: int = 0) -> ds.Target:
    """A 1-layer target with the attention output and MLP down projections zeroed.

    The residual stream at position t is then embed[x_t] exactly, so
    logits(· | x_≤t) = lm_head(norm(embed[x_t])): a bigram chain whose exact conditionals
    are `bigram_table(target)`. The LM head is scaled up so the conditionals are far from
    uniform (a wrong output distribution then shows up in few samples).
    """
    cfg = ds.ModelConfig.tiny(vocab_size=vocab_size, num_layers=1, tie_word_embeddings=False)
    t = ds.Target.random(cfg, seed=seed)
    st = t.state
    st = _set(st, ("layers", 0, "self_attn", "o_proj", "kernel"), np.zeros_like)
    st = _set(st, ("layers", 0, "mlp", "down_proj", "kernel"), np.zeros_like)
    st = _set(st, ("lm_head",), lambda w: np.asarray(w) * lm_head_scale)
    t.state = st
    return t


def bigram_table(target: ds.Target) -> np.ndarray:
    """[V, V] raw logits: row a = logits of the next token after token a (a 1-token forward)."""
    V = target.cfg.vocab_size
    return np.asarray(ds.logits(target, np.arange(V)[:, None]))[:, 0]


def sharpen(target: ds.Target, seed: int = 0) -> ds.Target:
    """Redraws the weights at informative scales (conftest.randomize_state): `Target.random`
    draws 0.02·N, giving logits whose top-2 gaps are often ~1e-4; redrawn, greedy ties at
    fp32 noise are rare."""
    from conftest import randomize_state

    target.state = randomize_state(target.state, seed)
    return target


def random_prompts(lengths, seed=0, high=128):
    """Prompts of the given lengths, token ids drawn from [3, high) (above the special ids)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, high, n).tolist() for n in lengths]


def window_tables(monkeypatch, tmp_path, cheap_at=512):
    """Stands in for the step-rate measurement: at cache lengths below `cheap_at` every
    verified draft costs far more than it can return (the loop never drafts), from it on
    they are almost free (it verifies every draft). Records the lengths measured."""
    measured = []

    def fake(target, drafter, *, slots, num_draft, cache_len, buckets, repeats=7, greedy=False, widths=None):
        measured.append(cache_len)
        per_step = (1.0, 1 / 0.99, 1 / 0.98, 1 / 0.97) if cache_len >= cheap_at else (1.0, 1 / 0.3, 1 / 0.2, 1 / 0.1)
        return profiling.StepRates(slots, tuple(buckets), 1e-3, tuple(per_step[: len(buckets)]), ar_s=cache_len / 256,
                                   widths=widths)

    monkeypatch.setenv("DSPARK_SPS_CACHE", str(tmp_path))
    monkeypatch.setattr("dspark_jax.decoding.profiling.measure_step_rates", fake)
    return measured

