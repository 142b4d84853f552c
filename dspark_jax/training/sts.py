"""Sequential Temperature Scaling (STS): the NumPy fit and its report.

Shape letters (docs/architecture.md, "Shape letters"): Z draft-and-verify cycles, G block size γ (draft
positions per cycle), Y grid temperatures.

The confidence head predicts c_k = P(x_k accepted | x_<k accepted); a scheduler ranks
candidates by the survival a_k = Π_{i≤k} c_i. STS rescales each position's logit,
c'_k = σ(logit_k / T_k), choosing T_1..T_γ left to right so that the survival is calibrated
against the event "positions 1..k all accepted" (each T_k fitted with T_<k fixed, because
a_k depends on them). A temperature is monotone, so the order of candidates within a
position never changes. The cycles come from `calibration.collect_cycles` (the real engine).

Censoring: a cycle that verified ℓ drafts observes the events of positions 1..ℓ (after a
rejection they are known zeros, and count); positions k > ℓ are excluded, whatever happened
(see `cumulative_events` for why excluding only full acceptances would be biased).
"""

from __future__ import annotations

import os

import numpy as np

# 2^(-3 .. 3) in 48 equal log steps: 49 values on [0.125, 8], 1.0 exactly among them (vLLM's grid).
DEFAULT_GRID = tuple(float(t) for t in 2.0 ** np.linspace(-3.0, 3.0, 49))


# ----------------------------------------------------------------------------- events and ECE


def cumulative_events(accepted, verified, gamma: int):
    """(accepted [Z], verified [Z]) → (event [Z, G] float, observed [Z, G] bool).

    event_k = 1 iff drafts 1..k were all accepted (k is 1-based); it is observed iff k ≤ ℓ
    (the verified length). Inside the verified prefix every event is known, zeros after a
    rejection included. Beyond ℓ the event is known only when a rejection came first, so
    counting those zeros while censoring full acceptances would select on the outcome and
    bias the survival low (with varied ℓ it pushes every later T to the grid's top); they
    are censored too. With ℓ = γ, as in fixed-length collection, nothing is censored.
    """
    a = np.asarray(accepted, np.int64).reshape(-1)
    v = np.asarray(verified, np.int64).reshape(-1)
    if a.shape != v.shape:
        raise ValueError(f"accepted has {a.shape[0]} cycles but verified has {v.shape[0]}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if a.size and (a.min() < 0 or np.any(a > v) or v.max() > gamma):
        raise ValueError(f"need 0 <= accepted <= verified <= gamma={gamma} for every cycle")
    k = np.arange(1, gamma + 1)[None]
    event = (k <= a[:, None]).astype(np.float64)
    observed = np.broadcast_to(k <= v[:, None], event.shape).copy()
    return event, observed


def _bin_index(pred, n_bins):
    return np.clip((pred * n_bins).astype(np.int64), 0, n_bins - 1)  # pred == 1 → last bin


def ece(pred, event, observed=None, n_bins: int = 15) -> float:
    """Expected calibration error (equal-width bins on [0, 1]) over the observed entries:
    Σ_b (n_b / n) |mean pred_b − mean event_b|. NaN when nothing is observed."""
    pred, event = np.asarray(pred, np.float64), np.asarray(event, np.float64)
    if pred.shape != event.shape:
        raise ValueError(f"pred {pred.shape} and event {event.shape} must have the same shape")
    if observed is not None:
        observed = np.asarray(observed, bool)
        if observed.shape != pred.shape:
            raise ValueError(f"observed {observed.shape} must have the shape of pred {pred.shape}")
        pred, event = pred[observed], event[observed]
    return float(_ece_rows(pred.reshape(1, -1), event.reshape(-1), n_bins)[0])


def _ece_rows(pred_YZ, event_Z, n_bins):
    """ECE of every row of pred_YZ against the same events (one bincount for all rows)."""
    Y, Z = pred_YZ.shape
    if Z == 0:
        return np.full(Y, np.nan)
    idx = _bin_index(pred_YZ, n_bins) + n_bins * np.arange(Y)[:, None]
    sum_p = np.bincount(idx.ravel(), pred_YZ.ravel(), Y * n_bins).reshape(Y, n_bins)
    sum_e = np.bincount(idx.ravel(), np.broadcast_to(event_Z, (Y, Z)).ravel(), Y * n_bins).reshape(Y, n_bins)
    return np.abs(sum_p - sum_e).sum(1) / Z  # Σ_b n_b/Z · |Σp/n_b − Σe/n_b|


# ----------------------------------------------------------------------------- STS


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free σ


def apply_sts(conf_logits, temps=()):
    """Calibrated per-position confidences σ(logit_k / T_k) [..., G]; `temps` () = all 1.
    The NumPy twin of `dspark_jax.models.draft_heads.sts_confidence` (used when drafting)."""
    z = np.asarray(conf_logits, np.float64)
    if temps is not None and len(temps):
        t = np.asarray(temps, np.float64)
        if t.shape != z.shape[-1:]:
            raise ValueError(f"got {t.size} temperatures for {z.shape[-1]} draft positions")
        z = z / t
    return _sigmoid(z)


def survival(conf_logits, temps=()):
    """a_k = Π_{i≤k} σ(logit_i / T_i) [..., G]: P(drafts 1..k all accepted) as predicted."""
    return np.cumprod(apply_sts(conf_logits, temps), axis=-1)


def fit_sts(conf_logits, event, observed, grid=None, n_bins: int = 15) -> tuple[float, ...]:
    """Per-position temperatures T_1..T_G (left to right, earlier ones fixed) minimising the
    ECE of the survival a_k against event_k over observed entries. Ties go to the T closest
    to 1; a position with nothing observed keeps T = 1."""
    z = np.asarray(conf_logits, np.float64)
    event, observed = np.asarray(event, np.float64), np.asarray(observed, bool)
    if z.ndim != 2 or event.shape != z.shape or observed.shape != z.shape:
        raise ValueError(
            f"conf_logits, event and observed must all be [Z, G] (cycles × positions); got {z.shape}, "
            f"{event.shape}, {observed.shape}"
        )
    if not np.all(np.isfinite(z)):
        raise ValueError("conf_logits contain NaN or inf")
    grid = np.asarray(DEFAULT_GRID if grid is None else grid, np.float64).reshape(-1)
    if grid.size == 0 or np.any(~np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError("the temperature grid must be non-empty, finite and > 0")
    prefer = np.abs(np.log(grid))  # tie-break: the smallest change
    temps = []
    prefix = np.ones(z.shape[0])  # Π_{i<k} c'_i with the temperatures already chosen
    for k in range(z.shape[1]):
        obs = observed[:, k]
        T = 1.0
        if obs.any():
            pred_YZ = prefix[obs][None] * _sigmoid(z[obs, k][None] / grid[:, None])
            err = _ece_rows(pred_YZ, event[obs, k], n_bins)
            T = float(grid[np.lexsort((prefer, err))[0]])
        temps.append(T)
        prefix = prefix * _sigmoid(z[:, k] / T)
    return tuple(temps)



# ----------------------------------------------------------------------------- report


def _per_position_ece(pred, event, observed, n_bins):
    return [ece(pred[:, k], event[:, k], observed[:, k], n_bins) for k in range(pred.shape[1])]


def reliability_diagram(path: str, pred_before, pred_after, event, observed, n_bins: int = 15,
                        min_count: int = 10) -> str:
    """Writes a PNG with one panel per draft position: binned survival vs observed rate,
    before and after calibration (ECE, over all bins, in the legend). Bins holding fewer than
    `min_count` entries are not drawn (their rate is noise). Returns `path`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the reliability diagram needs matplotlib: pip install matplotlib") from e
    observed = np.asarray(observed, bool)
    event = np.asarray(event, np.float64)
    G = event.shape[1]
    cols = min(G, 4)
    rows = -(-G // cols)
    fig = Figure(figsize=(3.2 * cols, 3.0 * rows))  # no pyplot: no global state, no display
    FigureCanvasAgg(fig)
    for k in range(G):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.plot([0, 1], [0, 1], color="0.7", lw=1)
        obs = observed[:, k]
        for pred, name, style in ((pred_before, "before", "o-"), (pred_after, "after", "s-")):
            p = np.asarray(pred, np.float64)[obs, k]
            e = event[obs, k]
            b = _bin_index(p, n_bins)
            n = np.bincount(b, minlength=n_bins)
            keep = n >= min_count
            x = np.bincount(b, p, n_bins)[keep] / n[keep]
            y = np.bincount(b, e, n_bins)[keep] / n[keep]
            ax.plot(x, y, style, ms=3, label=f"{name} ECE {100 * ece(p, e, None, n_bins):.1f}%")
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {k + 1} (n={int(obs.sum())})",
               xlabel="predicted survival", ylabel="all accepted")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def fit_and_report(conf_logits, accepted, verified, gamma: int, png_path: str | None = None,
                   grid=None, n_bins: int = 15) -> dict:
    """Fits STS on collected cycles. Returns a JSON-ready dict: `temperatures`, per-position
    `ece_before` / `ece_after` (None where nothing was observed), their pooled values,
    counts, and `png` (the reliability diagram's path, or None)."""
    z = np.asarray(conf_logits, np.float64)
    if z.ndim != 2 or z.shape[1] != gamma:
        raise ValueError(f"conf_logits must be [cycles, gamma={gamma}], got {z.shape}")
    if z.shape[0] == 0:
        raise ValueError("no cycles to calibrate on: collect some with collect_cycles first")
    event, observed = cumulative_events(accepted, verified, gamma)
    temps = fit_sts(z, event, observed, grid, n_bins)
    before, after = survival(z), survival(z, temps)

    def clean(xs):
        return [None if np.isnan(x) else x for x in xs]

    report = {
        "temperatures": list(temps),
        "ece_before": clean(_per_position_ece(before, event, observed, n_bins)),
        "ece_after": clean(_per_position_ece(after, event, observed, n_bins)),
        "ece_before_all": ece(before, event, observed, n_bins),
        "ece_after_all": ece(after, event, observed, n_bins),
        "num_cycles": int(z.shape[0]),
        "observed_per_position": observed.sum(0).tolist(),
        "survival_rate_per_position": clean((event * observed).sum(0) / np.maximum(observed.sum(0), 1)),
        "mean_accepted": float(np.mean(accepted)),
        "png": None,
    }
    if png_path is not None:
        report["png"] = reliability_diagram(png_path, before, after, event, observed, n_bins)
    return report
