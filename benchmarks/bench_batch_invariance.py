"""Are a decode step's numbers independent of the step's shape? Greedy speculative output equals
autoregressive output only if a verification step (a block of K + 1 tokens a slot) computes the
same logits as the K + 1 one-token steps it replaces; bitwise equality makes that exact rather
than empirical, and lets verification round activations to bf16 (1 term a row instead of 3,
`ModelConfig.weight_terms`) without parting from autoregressive output at near-ties — what
batch-invariant decode steps (`ModelConfig.batch_invariant`, on with 1 term) are for.
Measurements:

1. The target: K + 1 autoregressive steps against one verification step (deferred write, as
   the decode loop runs them) from the same prefilled cache — rows bitwise equal, the largest
   |Δ logit|, argmax agreement; per weight-term count (batch-invariant with 1 term).
2. The XLA:CPU reductions a decode step is made of, each computed for one row at several slot
   counts S, queries per slot Q and attention windows T (zero-padded): the shapes at which
   that row's result differs from the (S, Q, T) = (1, 1, 256) one; then alternatives that
   sum in one order (halving trees, chained multiply-adds) or were measured to (BENCHMARKS.md,
   "Stop 40", says what they cost in a decode step).

3. With `--generate N`: greedy `generate()` of 3·N evaluation prompts together, speculative
   (fixed and dspark policies) against autoregressive, with 1 term and batch-invariant decode
   steps on (`ModelConfig.batch_invariant`) and off (the control).

    python -m benchmarks.bench_batch_invariance [--target smollm2-135m] [--terms 3,1] [--trials 4]
        [--generate 4 --max-new-tokens 128 --policies fixed]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as ds
from benchmarks.common import eval_prompts, hardware, machine_load, table
from dspark_jax.models.layers import MIN_DOT_ROWS, _blocked_scores, _cached_scores, tree_sum
from dspark_jax.models.transformer import KVCache


def ar_vs_verify(target, *, slots: int, block: int, trials: int, seed: int = 0):
    """(rows bitwise equal, rows, max |Δ logit|, argmax agreement) of `block` one-token steps
    against one verification step of `block` tokens a slot, on random prompts."""
    cfg = target.cfg

    @functools.partial(jax.jit, static_argnames=("q_max", "defer"))
    def step(state, cache, toks, starts, counts, q_max, defer):
        logits, _, out = nnx.merge(target.graphdef, state)(cache, toks, starts, counts, q_max=q_max,
                                                           defer_write=defer)
        return logits, out.write(cache) if defer else out

    rng = np.random.default_rng(seed)
    equal = rows = 0
    worst, agree = 0.0, []
    for _ in range(trials):
        plen = rng.integers(5, 100, slots)
        cache = KVCache.zeros(cfg, slots, 256)
        toks = jnp.asarray(np.concatenate([rng.integers(0, cfg.vocab_size, n) for n in plen]), jnp.int32)
        _, cache = step(target.state, cache, toks, jnp.zeros(slots, jnp.int32), jnp.asarray(plen, jnp.int32),
                        q_max=int(plen.max()), defer=False)
        cont = rng.integers(0, cfg.vocab_size, (slots, block))
        verify, _ = step(target.state, jax.tree.map(jnp.copy, cache), jnp.asarray(cont.reshape(-1), jnp.int32),
                         jnp.asarray(plen, jnp.int32), jnp.full(slots, block, jnp.int32), q_max=block, defer=True)
        verify = np.asarray(verify).reshape(slots, block, -1)
        ar = []
        for j in range(block):
            logits, cache = step(target.state, cache, jnp.asarray(cont[:, j], jnp.int32),
                                 jnp.asarray(plen + j, jnp.int32), jnp.ones(slots, jnp.int32), q_max=1,
                                 defer=cfg.fixed_order_decode)  # as the decode loop runs a one-token step
            ar.append(np.asarray(logits))
        ar = np.stack(ar, 1)
        equal += int((ar == verify).all(-1).sum())
        rows += ar.shape[0] * ar.shape[1]
        worst = max(worst, float(np.abs(ar - verify).max()))
        agree.append(float((ar.argmax(-1) == verify.argmax(-1)).mean()))
    return equal, rows, worst, float(np.mean(agree))


def greedy_identity(target, drafter, prompts, *, max_new: int, policies=("fixed", "dspark")):
    """[(policy, answers identical to autoregressive, answers, first differing positions, τ)]:
    greedy `generate()` of all the prompts together (chat template), speculative against
    autoregressive."""
    chats = [[{"role": "user", "content": p}] for p in prompts]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=max_new)
    ar = ds.generate(target, chats, sampling=sp).token_ids
    out = []
    for policy in policies:
        got = ds.generate(target, chats, drafter=drafter, sampling=sp, policy=policy)
        first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(ar, got.token_ids) if a != b]
        out.append((policy, len(prompts) - len(first), len(prompts), first, got.stats["tau"]))
    return out


def _chained_scores(q, kt):
    """q [S, K, Q, I, E] · keys [S, K, E, T] as E multiply-adds in index order."""
    acc = q[..., 0, None] * kt[:, :, None, None, 0, :]
    for e in range(1, q.shape[-1]):
        acc = acc + q[..., e, None] * kt[:, :, None, None, e, :]
    return acc


def _reductions(K=3, I=3, E=64, D=576):
    """name → (fn → the first query's result, make_args(S, Q, T)): the reductions of a decode step in the forms the
    model uses (XLA's own), then forms that sum in one order by construction or measured so."""
    rng = np.random.default_rng(0)
    S_, Q_, T_, live = 8, 8, 2048, 200
    x = rng.standard_normal((S_ * Q_, D)).astype(np.float32)
    q = rng.standard_normal((S_, K, Q_ * I, E)).astype(np.float32)
    kt = rng.standard_normal((S_, K, E, T_)).astype(np.float32)
    p = rng.random((S_, K, Q_ * I, T_)).astype(np.float32)
    v = rng.standard_normal((S_, K, T_, E)).astype(np.float32)
    kt[..., live:], p[..., live:], v[:, :, live:] = 0, 0, 0  # a window wider than the context
    w = jnp.asarray(rng.standard_normal((D, D)), jnp.bfloat16)
    x16 = jnp.asarray(x, jnp.bfloat16)
    q_SQHE = q.reshape(S_, K, Q_, I, E).transpose(0, 2, 1, 3, 4).reshape(S_, Q_, K * I, E)  # the model's layout
    return {
        "RMSNorm: mean of squares over the hidden dim (minor)":
            (lambda a: jnp.mean(a * a, -1)[0], lambda S, Q, T: (x[:S * Q],)),
        "bf16 matmul row (rows = S·Q; fewer than `layers.MIN_DOT_ROWS` padded to it)":
            (lambda a: jnp.einsum("mi,oi->mo", a, w, preferred_element_type=jnp.float32)[0],
             lambda S, Q, T: (x16[:max(S * Q, MIN_DOT_ROWS)],)),
        "scores: q·k over the head dim, keys minor (`layers._cached_scores`)":
            (lambda a, b: _cached_scores(a, b)[1][0, :, :I, :live],
             lambda S, Q, T: (q_SQHE[:S, :Q], kt[:S, ..., :T])),
        "softmax denominator over positions (minor)":
            (lambda a: jnp.sum(a, -1)[0, :, :I], lambda S, Q, T: (p[:S, :, :Q * I, :T],)),
        "values: p·v over positions, head dim minor":
            (lambda a, b: jnp.sum(a[..., None] * b[:, :, None], axis=-2)[0, :, :I],
             lambda S, Q, T: (p[:S, :, :Q * I, :T], v[:S, :, :T])),
        "alternative: RMSNorm's sum as a halving tree":
            (lambda a: tree_sum(a * a)[0], lambda S, Q, T: (x[:S * Q],)),
        "alternative: denominator as a halving tree":
            (lambda a: tree_sum(a)[0, :, :I], lambda S, Q, T: (p[:S, :, :Q * I, :T],)),
        "alternative: scores over keys in position blocks [S, K, T/B, E, B], B = 256 or 128 (`layers._blocked_scores`)":
            (lambda a, b: _blocked_scores(a, b)[0, :, 0, :, :live],
             lambda S, Q, T: (q[:S, :, :Q * I].reshape(S, K, Q, I, E), kt[:S, ..., :T])),
        "alternative: scores as E chained multiply-adds, queries [S, K, Q, I, E]":
            (lambda a, b: _chained_scores(a, b)[0, :, 0, :, :live],
             lambda S, Q, T: (q[:S, :, :Q * I].reshape(S, K, Q, I, E), kt[:S, ..., :T])),
    }


def reduction_shapes(slots=(1, 2, 8), queries=(1, 2, 4, 8), windows=(256, 384, 512, 768, 1024, 2048)):
    """[(reduction, shapes (S, Q, T) whose first row differs from (1, 1, 256)'s, shapes tried)]."""
    out = []
    for name, (fn, make) in _reductions().items():
        f = jax.jit(fn)
        base, bad, tried = None, [], 0
        for S, Q, T in itertools.product(slots, queries, windows):
            y = np.asarray(f(*make(S, Q, T)))
            tried += 1
            if base is None:
                base = y
            elif not np.array_equal(y, base):
                bad.append((S, Q, T))
        out.append((name, bad, tried))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--terms", default="3,1", help="bf16 terms per activation to try (bf16 weights)")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--block", type=int, default=8, help="tokens a slot in the verification step (K + 1)")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="also greedy generate() of N prompts from each of HumanEval, MT-Bench, GSM8K together, "
                         "1 term, batch-invariant decode on and off (the control), speculative vs autoregressive")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policies", default="fixed",
                    help="comma-separated policies of --generate (dspark profiles its step-rate table: ~10 min more)")
    ap.add_argument("--drafter", default="smollm2-135m-dspark+ngram")
    a = ap.parse_args()
    print(f"{hardware()}; {machine_load()}")
    rows = []
    for terms in [int(t) for t in a.terms.split(",")]:
        target = ds.load_target(a.target, weight_dtype="bfloat16", weight_terms=terms)
        eq, n, worst, agree = ar_vs_verify(target, slots=a.slots, block=a.block, trials=a.trials)
        rows.append([f"bf16 weights, {terms} term(s)", f"{eq} / {n}", f"{worst:.2e}", f"{agree:.3f}"])
    print(f"\n{a.target}: {a.block} one-token steps vs one verification step of {a.block} tokens a slot, "
          f"{a.slots} slots, {a.trials} random prompts each")
    print(table(["weights", "rows bitwise equal", "max |Δ logit|", "argmax agreement"], rows))
    if a.generate:
        prompts = [p for name in ("humaneval", "mt-bench", "gsm8k") for p in eval_prompts(name, a.generate)]
        base = ds.load_target(a.target, weight_dtype="bfloat16", weight_terms=1)
        rows = []
        for on in (True, False):
            target = base.with_batch_invariant(on)
            drafter = ds.load_drafter(a.drafter, target)
            for policy, same, n, first, tau in greedy_identity(target, drafter, prompts, max_new=a.max_new_tokens,
                                                               policies=a.policies.split(",")):
                rows.append([f"1 term, batch-invariant {'on' if on else 'off'}", policy, f"{same} / {n}",
                             ", ".join(map(str, first)) or "–", f"{tau:.2f}"])
        print(f"\ngreedy generate(), {len(prompts)} prompts together ({a.generate} each of HumanEval, MT-Bench, "
              f"GSM8K), {a.max_new_tokens} new tokens, drafter {a.drafter}")
        print(table(["target", "policy", "answers identical to autoregressive", "first difference at", "τ"], rows))
    print("\nXLA reductions: shapes (S, Q, T) where row 0 differs from (1, 1, 256)")
    print(table(["reduction", "shapes that differ", "e.g."],
                [[name, f"{len(bad)} of {tried}", ", ".join(map(str, bad[:3])) or "–"]
                 for name, bad, tried in reduction_shapes()]))
    print(f"\n{machine_load()} at end")


if __name__ == "__main__":
    main()
