"""Shared helpers for the benchmark scripts: timing, tables, evaluation prompts."""

from __future__ import annotations

import json
import os
import platform
import time

import jax

EVAL_DIR = os.environ.get(
    "DSPARK_EVAL_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "eval_data")
)


def eval_prompts(name: str, n: int) -> list[str]:
    """First-turn prompts of ../shared/eval_data/{name}.jsonl (read at run time, never copied)."""
    path = os.path.join(EVAL_DIR, f"{name}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} not found; set DSPARK_EVAL_DATA to the eval_data folder")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def time_call(fn, *, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time (s) of fn() after warm-up; fn must block on its result."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def hardware() -> str:
    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__} on {dev.platform}"


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table."""
    def fmt(x):
        return f"{x:.2f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)
