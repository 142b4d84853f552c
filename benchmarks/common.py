"""Shared helpers for the benchmark scripts: timing, tables, evaluation prompts."""

from __future__ import annotations

import json
import os
import platform
import time

import jax

from dspark_jax.decoding.profiling import cpu_model

# The prompt sets ship in the repository (benchmarks/data/README.md: sources and licences);
# DSPARK_EVAL_DATA points at another folder of the same format.
EVAL_DIR = os.environ.get("DSPARK_EVAL_DATA", os.path.join(os.path.dirname(__file__), "data"))


def eval_prompts(name: str, n: int) -> list[str]:
    """The first turns of the first n prompts of benchmarks/data/{name}.jsonl (gsm8k, humaneval, mt-bench)."""
    path = os.path.join(EVAL_DIR, f"{name}.jsonl")
    if not os.path.exists(path):
        have = sorted(f[:-6] for f in os.listdir(EVAL_DIR) if f.endswith(".jsonl")) if os.path.isdir(EVAL_DIR) else []
        raise FileNotFoundError(f"no prompt set {name!r} at {path!r}; available: {have}")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def machine_load() -> str:
    """The 1/5/15-minute load averages against the core count: numbers from a loaded machine
    (a load above the core count) are slower and noisier, so every table records it."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} cores"


def interleaved(configs: dict, *, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall times (s) of each config's fn(), run round-robin `repeats` times.

    Interleaving spreads a change in machine load over every config instead of biasing the
    ones that happened to run during it; the order rotates each round so no config always
    runs first (right after another config has evicted its caches). fn must block on its result.
    """
    names = list(configs)
    for _ in range(warmup):
        for n in names:
            configs[n]()
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            configs[n]()
            times[n].append(time.perf_counter() - t)
    return times


def median(xs) -> float:
    ys = sorted(xs)
    m = len(ys) // 2
    return ys[m] if len(ys) % 2 else 0.5 * (ys[m - 1] + ys[m])


def spread(xs, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """"median (min–max)" of xs × scale: the spread says how far to trust the median."""
    ys = [x * scale for x in xs]
    return f"{fmt.format(median(ys))} ({fmt.format(min(ys))}–{fmt.format(max(ys))})"


def hardware() -> str:
    dev = jax.devices()[0]
    return f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__} on {dev.platform}"


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table."""
    def fmt(x):
        return f"{x:.2f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)
