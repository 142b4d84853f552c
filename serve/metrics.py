"""Prometheus metrics: counters, gauges and histograms fed by the engine thread and the event
loop, their text exposition for /metrics, and the ASGI middleware counting HTTP responses."""

from __future__ import annotations

import bisect
import collections
import math
import threading
from typing import Any


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float):
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{_num(b)}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


def _num(v) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v)) if math.isfinite(v) else ("+Inf" if v > 0 else "-Inf")


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)


class Metrics:
    """Counters, gauges and histograms, written from the engine thread and the event loop (one lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.http = collections.Counter()  # (endpoint, code) → responses
        self.finished = collections.Counter()  # finish reason → requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cycles = 0  # target steps (decode cycles) of finished requests
        self.cycle_tokens = 0  # tokens those cycles emitted (Σ τ·cycles)
        self.verified = 0  # drafts verified, summed over requests
        self.engine_errors = 0
        self.step_s = Histogram(_LATENCY_BUCKETS)
        self.ttft_s = Histogram(_LATENCY_BUCKETS)
        self.e2e_s = Histogram(_LATENCY_BUCKETS)
        self.queue_s = Histogram(_LATENCY_BUCKETS)
        self.tau = Histogram((1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0))
        self.req_verified = Histogram((0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))

    def observe(self, hist: Histogram, v: float):
        with self.lock:
            hist.observe(v)

    def count_http(self, endpoint: str, code: int):
        with self.lock:
            self.http[(endpoint, code)] += 1

    def on_dropped(self, prompt_tokens: int, reason: str):
        with self.lock:
            self.finished[reason] += 1
            self.prompt_tokens += prompt_tokens

    def on_finish(self, req, prompt_tokens: int, has_drafter: bool):
        with self.lock:
            self.finished[req.finish_reason] += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += len(req.tokens)
            st = req.stats or {}
            cycles = int(st.get("cycles") or 0)
            if cycles:
                self.cycles += cycles
                self.cycle_tokens += round(st["tau"] * cycles)
                if req.status == "finished":
                    self.tau.observe(st["tau"])
            if has_drafter and "verified" in st:
                self.verified += int(st["verified"])
                if req.status == "finished":
                    self.req_verified.observe(int(st["verified"]))
            if st.get("queue_s") is not None:
                self.queue_s.observe(st["queue_s"])

    def render(self, extra: dict[str, Any]) -> str:
        from dspark_jax.decoding import compile_stats

        compiles, compile_s = compile_stats.snapshot()
        L: list[str] = []

        def head(name, kind, text):
            L.append(f"# HELP {name} {text}")
            L.append(f"# TYPE {name} {kind}")

        with self.lock:
            head("dspark_http_requests_total", "counter", "HTTP responses by endpoint and status code.")
            for (ep, code), n in sorted(self.http.items()):
                L.append(f'dspark_http_requests_total{{endpoint="{ep}",code="{code}"}} {n}')
            head("dspark_requests_finished_total", "counter",
                 "Generation requests that left the engine, by finish reason (stop, length, cancelled, error).")
            for reason in sorted(set(self.finished) | {"stop", "length", "cancelled"}):
                L.append(f'dspark_requests_finished_total{{reason="{reason}"}} {self.finished[reason]}')
            for name, v, text in [
                ("dspark_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of requests that left the engine."),
                ("dspark_generation_tokens_total", self.generation_tokens,
                 "Generated tokens of requests that left the engine (cancelled ones included)."),
                ("dspark_decode_cycles_total", self.cycles, "Target steps (decode cycles) of those requests."),
                ("dspark_decode_cycle_tokens_total", self.cycle_tokens,
                 "Tokens those decode cycles emitted; tau = this / dspark_decode_cycles_total."),
                ("dspark_drafts_verified_total", self.verified, "Draft tokens sent to verification, all requests."),
                ("dspark_engine_errors_total", self.engine_errors, "Engine steps that raised."),
                ("dspark_xla_compiles_total", compiles, "XLA backend compilations in this process."),
                ("dspark_compiled_program_drops_total", extra.get("program_drops", 0),
                 "Times every compiled program was dropped because the process neared vm.max_map_count."),
            ]:
                head(name, "counter", text)
                L.append(f"{name} {v}")
            head("dspark_xla_compile_seconds_total", "counter", "Seconds spent tracing, lowering and compiling.")
            L.append(f"dspark_xla_compile_seconds_total {_num(compile_s)}")
            head("dspark_tau", "gauge", "Tokens per target step over all requests so far (1 = autoregressive).")
            L.append(f"dspark_tau {_num(self.cycle_tokens / self.cycles if self.cycles else 0.0)}")
            for name, v, text in [
                ("dspark_running_requests", extra["running"],
                 "Requests holding an engine slot (prefilling or decoding)."),
                ("dspark_queued_requests", extra["queued"], "Accepted requests waiting for a slot."),
                ("dspark_slots", extra["slots"], "Engine slots."),
                ("dspark_active_slots", extra.get("active_slots"),
                 "Slots the decode state holds now (the slot bucket that fits the requests in flight)."),
                ("dspark_max_queue", extra["max_queue"], "Queued requests beyond the slots before 429."),
                ("dspark_memory_maps", extra.get("memory_maps"),
                 "Memory maps this process holds (XLA:CPU maps pages per compiled program), at the last compile."),
                ("dspark_memory_maps_limit", extra.get("memory_maps_limit"), "The kernel's vm.max_map_count."),
            ]:
                if v is None:  # not Linux
                    continue
                head(name, "gauge", text)
                L.append(f"{name} {v}")
            trust = extra.get("budget_trust")
            if trust is not None:
                head("dspark_budget_trust", "gauge", "The async budget's pooled calibration: accepted drafts "
                     "against what it expected, over the requests served (it scales its expectations by this).")
                for rows, v in zip(("drafter", "foreseen"), trust):
                    L.append(f'dspark_budget_trust{{rows="{rows}"}} {_num(v)}')
            for name, h, text in [
                ("dspark_step_seconds", self.step_s, "Wall time of one engine step (admission + decode cycles)."),
                ("dspark_ttft_seconds", self.ttft_s, "Time from request arrival to its first token."),
                ("dspark_e2e_seconds", self.e2e_s, "Time from request arrival to its last token."),
                ("dspark_queue_seconds", self.queue_s, "Time a request waited for a slot."),
                ("dspark_request_tau", self.tau, "Tokens per target step of each finished request."),
                ("dspark_request_drafts_verified", self.req_verified, "Drafts verified per finished request."),
            ]:
                head(name, "histogram", text)
                L.extend(h.lines(name))
        return "\n".join(L) + "\n"


class StatusCounter:
    """ASGI middleware counting responses by endpoint and status code (pure ASGI: streaming and
    disconnects pass through untouched)."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        ep = path if path in self.ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                self.metrics.count_http(ep, msg["status"])
            await send(msg)

        await self.app(scope, receive, counting_send)
