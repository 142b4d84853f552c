"""A one-line progress bar with ETA and live values, and the JSONL metrics log."""

from __future__ import annotations

import json
import sys
import time


class Progress:
    def __init__(self, name: str, total: int, unit: str = "it", stream=sys.stderr):
        self.name, self.total, self.unit, self.stream = name, max(int(total), 1), unit, stream
        self.t0, self.start = time.perf_counter(), None
        self.last_print = 0.0

    def update(self, done: int, **values) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = (done, now)
            return
        if now - self.last_print < 2.0 and done < self.total:
            return
        self.last_print = now
        d0, t0 = self.start
        rate = (done - d0) / max(now - t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        vals = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        self.stream.write(f"[{self.name}] {done}/{self.total} {self.unit} ({100 * done / self.total:.0f}%) "
                          f"{rate:.2f} {self.unit}/s ETA {eta / 60:.1f} min {vals}\n")
        self.stream.flush()


class MetricsLog:
    """Appends one JSON object per line; TensorBoard too when `tensorboardX` is installed."""

    def __init__(self, path: str):
        self.path = path
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(path.rsplit("/", 1)[0] + "/tb")
        except ImportError:
            self.tb = None

    def write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, int | float) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])
