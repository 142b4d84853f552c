"""OpenAI-compatible HTTP server over the continuous-batching engine: `python -m serve.server`.

    python -m serve.server --target smollm2-135m --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as server-sent events, or
not), GET /v1/models, /health and /metrics (Prometheus text). The engine (`serve/engine.py`)
runs in its own thread, stepping while there is work and sleeping on a condition otherwise;
request handlers never wait on a decode step: submissions and cancellations go to the engine
thread through a command queue, and tokens come back to asyncio with `call_soon_threadsafe`.
A client that disconnects has its request cancelled and its slot freed at the next step.
SIGINT / SIGTERM: stop accepting connections, finish the requests in flight, exit.
Details: docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import dataclasses
import json
import logging
import math
import os
import secrets
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

try:
    from starlette.requests import Request  # module level: FastAPI resolves the handlers' annotations here
    from starlette.responses import Response
except ImportError:  # pragma: no cover
    raise SystemExit('the server needs FastAPI and uvicorn: pip install -e ".[serve]"') from None

log = logging.getLogger("serve.server")

CACHE_DIR = os.environ.get("DSPARK_XLA_CACHE", os.path.expanduser("~/.cache/dspark_jax/xla"))
MAX_STOP_STRINGS = 16


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# --------------------------------------------------------------------------- metrics


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
                ("dspark_max_queue", extra["max_queue"], "Queued requests beyond the slots before 429."),
            ]:
                head(name, "gauge", text)
                L.append(f"{name} {v}")
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


# --------------------------------------------------------------------------- engine thread


class QueueFull(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request's generation: created on the event loop, run by the engine thread."""

    prompt_ids: list[int]
    sampling: Any  # ds.SamplingParams
    loop: asyncio.AbstractEventLoop
    arrived: float
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    req: Any = None  # the engine's Request, set on the engine thread
    cancelled: bool = False
    done: bool = False  # set on the engine thread once it is out of the engine

    def emit(self, item):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def on_token(self, req, toks):  # called by the engine, on the engine thread
        self.emit(("tokens", list(toks)))


class EngineThread:
    """Owns the engine: every engine call happens on this thread (the engine is not thread-safe)."""

    def __init__(self, engine, metrics: Metrics, capacity: int):
        self.engine, self.metrics, self.capacity = engine, metrics, capacity
        self.has_drafter = engine.drafter is not None
        self._cv = threading.Condition()
        self._cmds: collections.deque = collections.deque()
        self._jobs: dict[int, Job] = {}  # engine request id → job
        self.outstanding = 0  # accepted and not yet out of the engine
        self._stop = False
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, job: Job):
        with self._cv:
            if self._stop:
                raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
            if self.outstanding >= self.capacity:
                raise QueueFull
            self.outstanding += 1
            self._cmds.append(("submit", job))
            self._cv.notify()

    def cancel(self, job: Job):
        with self._cv:
            if job.done or job.cancelled:
                return
            job.cancelled = True
            self._cmds.append(("cancel", job))
            self._cv.notify()

    def stop(self, timeout: float | None = None):
        """Finishes the requests in the engine, then ends the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self.thread.join(timeout)

    # ------------------------------------------------------------ on the engine thread

    def _run(self):
        eng = self.engine
        while True:
            with self._cv:
                while not self._cmds and eng.idle and not self._stop:
                    self._cv.wait()
                if self._stop and not self._cmds and eng.idle:
                    return
                cmds = list(self._cmds)
                self._cmds.clear()
            for kind, job in cmds:
                if kind == "submit":
                    self._submit(job)
                elif job.req is not None and job.req.status in ("queued", "prefilling", "running"):
                    eng.cancel(job.req)
            if not eng.idle:
                t0 = time.perf_counter()
                try:
                    eng.step()
                except Exception:  # noqa: BLE001 — a failed step must not kill the server
                    self._fail_all(traceback.format_exc())
                self.metrics.observe(self.metrics.step_s, time.perf_counter() - t0)
            self._sweep()

    def _submit(self, job: Job):
        if job.cancelled:  # the client left before the engine saw the request
            self.metrics.on_dropped(len(job.prompt_ids), "cancelled")
            self._retire(job, None)
            return
        try:
            job.req = self.engine.submit(job.prompt_ids, job.sampling, on_token=job.on_token)
        except ValueError as e:
            self.metrics.on_dropped(len(job.prompt_ids), "error")
            job.emit(("error", APIError(400, str(e))))
            self._retire(job, None)
            return
        self._jobs[job.req.id] = job

    def _fail_all(self, tb: str):
        log.error("engine step failed; failing its requests:\n%s", tb)
        self.error = tb.strip().splitlines()[-1]
        with self.metrics.lock:
            self.metrics.engine_errors += 1
        for job in list(self._jobs.values()):
            try:
                self.engine.cancel(job.req)
            except Exception:  # noqa: BLE001
                pass
            job.emit(("error", APIError(500, f"the engine failed: {self.error}", "server_error")))

    def _sweep(self):
        eng = self.engine
        finished = list(eng.finished)
        eng.finished.clear()  # the engine keeps every finished request otherwise (memory grows)
        done = []
        for req in finished:
            job = self._jobs.pop(req.id, None)
            if job is not None:
                self.metrics.on_finish(req, len(req.prompt_ids), self.has_drafter)
                done.append((job, req))
        for job, req in done:
            self._retire(job, req)

    def load(self) -> tuple[int, int]:
        """(running, queued) now: requests holding a slot, and accepted ones waiting for one."""
        with self._cv:
            running = len(self.engine.running)
            return running, max(self.outstanding - running, 0)

    def _retire(self, job: Job, req):
        with self._cv:
            job.done = True
            self.outstanding -= 1
        if req is not None:
            job.emit(("done", req))


# --------------------------------------------------------------------------- request parsing


def _get(body: dict, name: str, kinds, default=None, *, alias: str | None = None):
    v = body.get(name, None)
    if v is None and alias is not None:
        v, name = body.get(alias, None), alias
    if v is None:
        return default
    if kinds is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and kinds is not bool or not isinstance(v, kinds):
        want = {float: "a number", int: "an integer", bool: "a boolean", str: "a string", dict: "an object",
                list: "an array", (str, list): "a string or an array"}.get(kinds, str(kinds))
        raise _bad(f"'{name}' must be {want}, got {json.dumps(v)[:80]}", name)
    return v


@dataclasses.dataclass
class Settings:
    model_name: str
    max_tokens_limit: int
    context: int  # prompt + completion tokens that fit one engine slot
    api_key: str | None
    stop_id_slots: int


class Server:
    """The FastAPI app around one engine thread."""

    def __init__(self, target, engine, *, model_name: str, api_key: str | None = None, max_queue: int = 64,
                 max_tokens_limit: int | None = None):
        self.target, self.engine = target, engine
        self.tok = target.tokenizer
        self.metrics = Metrics()
        self.max_queue = max_queue
        self.worker = EngineThread(engine, self.metrics, capacity=engine.S + max_queue)
        self.settings = Settings(
            model_name=model_name,
            max_tokens_limit=min(max_tokens_limit or engine.max_new_tokens, engine.max_new_tokens),
            context=engine.T - engine.K - 1,
            api_key=api_key,
            stop_id_slots=engine.M,
        )
        self.created = int(time.time())
        self.draining = False
        self.app = self._build_app()

    # ------------------------------------------------------------ app

    def _build_app(self):
        from contextlib import asynccontextmanager

        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException

        server = self

        @asynccontextmanager
        async def lifespan(app):
            server.worker.start()
            yield
            await asyncio.get_running_loop().run_in_executor(None, server.worker.stop)

        app = FastAPI(title="DSpark-JAX", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(request, exc: APIError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

        @app.exception_handler(RequestValidationError)
        async def validation_error(request, exc):
            return JSONResponse(_bad(str(exc)).body(), status_code=400)

        @app.exception_handler(Exception)
        async def internal_error(request, exc):
            log.error("unhandled error:\n%s", "".join(traceback.format_exception(exc)))
            return JSONResponse(APIError(500, f"internal error: {exc}", "server_error").body(), status_code=500)

        @app.get("/health")
        async def health():
            alive = server.worker.thread.is_alive()
            ok = alive and not server.draining
            body = {"status": "ok" if ok else ("draining" if alive else "engine stopped")}
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            running, queued = server.worker.load()
            text = server.metrics.render({"slots": server.engine.S, "max_queue": server.max_queue,
                                          "running": running, "queued": queued})
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models(request: Request):
            server._auth(request)
            return {"object": "list", "data": [server._model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str, request: Request):
            server._auth(request)
            if name != server.settings.model_name:
                raise APIError(404, f"The model '{name}' does not exist", "invalid_request_error", "model",
                               "model_not_found")
            return server._model_card()

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await server._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await server._generate(request, chat=True)

        return _StatusCounter(app, self.metrics)

    def _model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "dspark-jax",
                "max_model_len": self.settings.context}

    def _auth(self, request):
        key = self.settings.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            msg = ("Missing API key: pass it as 'Authorization: Bearer KEY'" if not got else
                   "Incorrect API key provided")
            raise APIError(401, msg, "invalid_request_error", None, "invalid_api_key")

    # ------------------------------------------------------------ generation

    async def _generate(self, request, *, chat: bool):
        import dspark_jax as ds

        arrived = time.perf_counter()
        self._auth(request)
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        s = self.settings
        model = _get(body, "model", str)
        if model is not None and model != s.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{s.model_name}'",
                           "invalid_request_error", "model", "model_not_found")
        n = _get(body, "n", int, 1)
        if n != 1:
            raise _bad(f"only n=1 is supported, got n={n}", "n")
        if chat:
            prompt = _chat_messages(body)
            if body.get("logprobs") or body.get("top_logprobs") is not None:
                raise _bad("logprobs are not supported", "logprobs")
            if body.get("tools"):
                raise _bad("tools are not supported", "tools")
        else:
            prompt = _completion_prompt(body)
            if body.get("logprobs") is not None:
                raise _bad("logprobs are not supported", "logprobs")
            if body.get("echo"):
                raise _bad("echo is not supported", "echo")
            if body.get("suffix"):
                raise _bad("suffix is not supported", "suffix")
            if _get(body, "best_of", int, 1) != 1:
                raise _bad("only best_of=1 is supported", "best_of")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = _get(body, name, float)
            if v not in (None, 0.0) and not (name == "repetition_penalty" and v == 1.0):
                raise _bad(f"'{name}' is not supported", name)
        if body.get("logit_bias"):
            raise _bad("logit_bias is not supported", "logit_bias")
        stream = _get(body, "stream", bool, False)
        opts = _get(body, "stream_options", dict, {})
        if opts and not stream:
            raise _bad("'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = bool(_get(opts, "include_usage", bool, False))
        stop = _get(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(x, str) and x for x in stop) or len(stop) > MAX_STOP_STRINGS:
            raise _bad(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings", "stop")
        stop_ids = _get(body, "stop_token_ids", list)
        if stop_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
                raise _bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
        ignore_eos = _get(body, "ignore_eos", bool, False)
        n_ids = len(set(stop_ids or []) | (set() if ignore_eos else set(self.target.eos_token_ids)))
        if n_ids > s.stop_id_slots:
            raise _bad(f"at most {s.stop_id_slots} stop token ids (EOS included) per request", "stop_token_ids")
        max_tokens = _get(body, "max_tokens", int, alias="max_completion_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise _bad(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and max_tokens > s.max_tokens_limit:
            raise _bad(f"'max_tokens' is {max_tokens}; this server allows at most {s.max_tokens_limit}",
                       "max_tokens")
        sampling_kw = dict(
            temperature=_get(body, "temperature", float, 1.0),
            top_p=_get(body, "top_p", float, 1.0),
            top_k=_get(body, "top_k", int, 0),
            min_p=_get(body, "min_p", float, 0.0),
            seed=_get(body, "seed", int),
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids) if stop_ids is not None else None,
            ignore_eos=ignore_eos,
        )
        if sampling_kw["top_k"] == -1:  # vLLM's "off"
            sampling_kw["top_k"] = 0
        # Validate the sampling values now, with the prompt still unread (SamplingParams' own checks).
        try:
            ds.SamplingParams(max_new_tokens=1, **sampling_kw)
        except ValueError as e:
            param = next((k for k in sorted(sampling_kw, key=len, reverse=True) if str(e).startswith(k)), None)
            raise _bad(str(e), param) from None
        ids = await asyncio.get_running_loop().run_in_executor(None, self._encode, prompt, chat)
        room = s.context - len(ids)
        if max_tokens is None:
            max_tokens = min(16 if not chat else s.max_tokens_limit, s.max_tokens_limit, max(room, 1))
        if len(ids) + max_tokens > s.context:
            raise _bad(f"This model's maximum context length is {s.context} tokens. However, you requested "
                       f"{len(ids) + max_tokens} tokens ({len(ids)} in the {'messages' if chat else 'prompt'}, "
                       f"{max_tokens} for the completion). Please reduce the length of the "
                       f"{'messages' if chat else 'prompt'} or the completion.",
                       "messages" if chat else "prompt", "context_length_exceeded")
        sp = ds.SamplingParams(max_new_tokens=max_tokens, **sampling_kw)
        job = Job(ids, sp, asyncio.get_running_loop(), arrived)
        try:
            self.worker.submit(job)
        except QueueFull:
            raise APIError(429, f"the server is at capacity ({self.engine.S} running + {self.max_queue} queued "
                                "requests); retry later", "rate_limit_error", None, "too_many_requests") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        stream_ctx = _Stream(self, job, rid, chat, include_usage, stop)
        if stream:
            return _Watched(stream_ctx.sse, lambda: self.worker.cancel(job), streaming=True)
        return _Watched(stream_ctx.whole, lambda: self.worker.cancel(job), streaming=False)

    def _encode(self, prompt, chat: bool) -> list[int]:
        from dspark_jax.decoding.generate import encode_prompt

        try:
            return encode_prompt(self.target, prompt)
        except ValueError as e:
            raise _bad(str(e), "messages" if chat else "prompt") from None
        except Exception as e:  # noqa: BLE001 — a chat template error (jinja2) is the client's
            if type(e).__module__.startswith("jinja2"):
                raise _bad(f"the chat template failed on these messages: {e}", "messages") from None
            raise


def _chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty array of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a 'role' and 'content'", "messages")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}]: role {m['role']!r} is not supported (system, user, assistant)", "messages")
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for p in c:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(p["text"])
            c = "".join(parts)
        if not isinstance(c, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    return out


def _completion_prompt(body: dict):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p  # token ids
    if isinstance(p, list) and len(p) > 1:
        raise _bad("only one prompt per request is supported", "prompt")
    raise _bad("'prompt' must be a string or a list of token ids", "prompt")


# --------------------------------------------------------------------------- responses


class _Stream:
    """Turns a job's engine events into OpenAI responses (incremental detokenisation)."""

    def __init__(self, server: Server, job: Job, rid: str, chat: bool, include_usage: bool, stop: list[str]):
        self.server, self.job, self.rid, self.chat = server, job, rid, chat
        self.include_usage, self.stop = include_usage, stop
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.sent = ""  # text streamed so far
        self.first_at: float | None = None

    def _safe_text(self) -> str:
        """The decoded text that can no longer change: no trailing partial UTF-8 character and
        no tail that could still grow into a stop string."""
        text = self.server.tok.decode(self.tokens)
        text = text.rstrip("\ufffd")
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        d = text[len(self.sent):]
        self.sent = text
        return d

    async def _events(self) -> AsyncIterator[tuple]:
        m = self.server.metrics
        while True:
            ev = await self.job.events.get()
            if ev[0] == "tokens" and self.first_at is None:
                self.first_at = time.perf_counter()
                m.observe(m.ttft_s, self.first_at - self.job.arrived)
            if ev[0] == "done":
                m.observe(m.e2e_s, time.perf_counter() - self.job.arrived)
            yield ev
            if ev[0] in ("done", "error"):
                return

    def _usage(self, req) -> dict:
        p, c = len(self.job.prompt_ids), len(req.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _final_text(self, req) -> str:
        return req.text if req.text is not None else self.server.tok.decode(req.tokens)

    async def whole(self, send_json: Callable):
        async for ev in self._events():
            if ev[0] == "error":
                await send_json(ev[1].status, ev[1].body())
                return
            if ev[0] == "done":
                req = ev[1]
                text = self._final_text(req)
                if self.chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                              "finish_reason": req.finish_reason}
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason}
                    obj = "text_completion"
                await send_json(200, {"id": self.rid, "object": obj, "created": self.created,
                                      "model": self.server.settings.model_name, "choices": [choice],
                                      "usage": self._usage(req), "system_fingerprint": None})
                return

    def _chunk(self, delta: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            d: dict = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        out = {"id": self.rid, "object": obj, "created": self.created, "model": self.server.settings.model_name,
               "choices": [choice], "system_fingerprint": None}
        if self.include_usage:
            out["usage"] = None
        return out

    async def sse(self) -> AsyncIterator[dict | str]:
        if self.chat:
            yield self._chunk("", None, role=True)
        async for ev in self._events():
            if ev[0] == "tokens":
                self.tokens += ev[1]
                d = self._delta(self._safe_text())
                if d:
                    yield self._chunk(d, None)
            elif ev[0] == "error":
                yield ev[1].body()
                break
            else:
                req = ev[1]
                text = self._final_text(req)
                rest = text[len(self.sent):] if text.startswith(self.sent) else ""
                yield self._chunk((rest or None) if self.chat else rest, req.finish_reason)
                if self.include_usage:
                    u = self._chunk(None, None)
                    u["choices"], u["usage"] = [], self._usage(req)
                    yield u
        yield "[DONE]"


class _Watched(Response):
    """An ASGI response that produces its body while watching the connection: when the client
    leaves first, `on_disconnect` runs (the request is cancelled and its slot freed)."""

    def __init__(self, produce, on_disconnect: Callable[[], None], *, streaming: bool):
        self.produce, self.on_disconnect, self.streaming = produce, on_disconnect, streaming
        self.background = None

    async def __call__(self, scope, receive, send):
        finished = False

        async def watch():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        async def send_json(status: int, body: dict):
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data, "more_body": False})

        async def run():
            nonlocal finished
            if self.streaming:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
                async for item in self.produce():
                    data = item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)
                    await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await self.produce(send_json)
            finished = True

        t_run, t_watch = asyncio.ensure_future(run()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({t_run, t_watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (t_run, t_watch):
                t.cancel()
            for t in (t_run, t_watch):
                try:
                    await t
                except (asyncio.CancelledError, OSError):
                    pass
                except Exception:  # noqa: BLE001
                    if t is t_run and not finished:
                        log.debug("response ended early:\n%s", traceback.format_exc())
            if not finished:
                self.on_disconnect()


class _StatusCounter:
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


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m serve.server", description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="embedded model name, HF model directory or .gguf file")
    ap.add_argument("--drafter", default="auto",
                    help="shipped drafter name or directory; 'ngram' (prompt lookup); NAME+ngram (the hybrid); "
                         "'none' (autoregressive); 'auto' = the drafter shipped for --target if any")
    ap.add_argument("--policy", choices=("dspark", "fixed", "ar"), default=None,
                    help="verification policy (default: dspark with a drafter, ar without)")
    ap.add_argument("--num-draft", type=int, default=None, help="drafts per cycle with --policy fixed")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    ap.add_argument("--max-len", type=int, default=2048,
                    help="tokens of prompt + completion per slot (the KV cache length, rounded up to 128·2^k)")
    ap.add_argument("--max-tokens-limit", type=int, default=256, help="largest max_tokens a request may ask for")
    ap.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    ap.add_argument("--prefill-tokens", type=int, default=256, help="prompt tokens admitted per engine step")
    ap.add_argument("--cycles-per-step", type=int, default=4,
                    help="decode cycles per engine step (fewer: smoother streaming, more host overhead)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $DSPARK_API_KEY, else none)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients use (default: --target)")
    ap.add_argument("--dtype", default=None, help="float32 (default; right on CPU) or bfloat16")
    ap.add_argument("--warmup", choices=("none", "short", "full"), default="short",
                    help="compile before listening: 'short' = greedy and sampled decoding at short context, "
                         "'full' = also every attention window of the cache (slower start), 'none'")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help=f"do not cache compiled programs on disk (default cache: $DSPARK_XLA_CACHE or {CACHE_DIR})")
    ap.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    ap.add_argument("--log-level", default="info")
    return ap


def load_drafter(name: str | None, target):
    """The drafter for `--drafter`: None (autoregressive), 'ngram', a shipped name or a directory."""
    import dspark_jax as ds

    if name in (None, "none"):
        return None
    if name == "auto":
        from dspark_jax.io.drafter_io import SHIPPED_DRAFTERS, shipped_drafter_path

        names = [n for n, t in SHIPPED_DRAFTERS.items() if t == target.name and os.path.isdir(shipped_drafter_path(n))]
        return ds.load_drafter(names[0], target) if names else None
    if name == "ngram":
        if not hasattr(ds, "NgramDrafter"):
            raise ValueError("ngram drafter not available: this version of dspark_jax has no ds.NgramDrafter")
        d = ds.NgramDrafter()
        return d.bind(target) if hasattr(d, "bind") else d
    return ds.load_drafter(name, target)  # a shipped name, a directory, or NAME+ngram (the hybrid)


def make_engine(args, target, drafter):
    from serve.engine import Engine

    class ServingEngine(Engine):
        def _sampling_arrays(self):
            # The engine compiles every sampling filter in, but `SamplingArrays.top_k_max` (a static
            # bound when every sampled row uses top-k) still varies with the requests' k, and each
            # power of two would compile a new program; the server pins it to 0 (full sort).
            sa = super()._sampling_arrays()
            return dataclasses.replace(sa, top_k_max=0) if getattr(sa, "top_k_max", 0) else sa

    policy = args.policy or ("dspark" if drafter is not None else "ar")
    if policy != "ar" and drafter is None:
        raise ValueError(f"--policy {policy} needs a drafter (got --drafter {args.drafter})")
    if args.num_draft is not None and policy != "fixed":
        raise ValueError("--num-draft applies to --policy fixed")
    return ServingEngine(target, drafter if policy != "ar" else None, slots=args.slots, max_len=args.max_len,
                         max_new_tokens=args.max_tokens_limit, prefill_tokens=args.prefill_tokens, policy=policy,
                         num_draft=args.num_draft, cycles_per_step=args.cycles_per_step)


def warmup(engine, target, full: bool = False):
    """Compiles admission and the decode loop before any client waits: a greedy and a sampled
    request (greedy-only batches run a program of their own), at the first attention window or,
    with `full`, at every window of the cache (a long prompt each)."""
    import dspark_jax as ds

    t0 = time.perf_counter()
    unit = target.tokenizer.encode("Hello world. ") if target.tokenizer is not None else [1]
    new = min(2 * engine.cycles_per_step, engine.max_new_tokens)
    lengths = [len(unit)]
    if full:  # a prompt that just crosses into each larger window
        bounds = [w for w in engine.windows if w is not None]
        lengths += [b - engine.K for b in bounds if b - engine.K + new + engine.K + 1 <= engine.T]
    for n in lengths:
        ids = (unit * (n // len(unit) + 1))[:n]
        for temp in (0.0, 0.7):
            engine.submit(ids, ds.SamplingParams(temperature=temp, seed=0, ignore_eos=True, max_new_tokens=new))
            engine.run()
    engine.finished.clear()
    log.info("warm-up (%d prompt lengths, greedy and sampled) done in %.1f s", len(lengths),
             time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for name, v in (("--slots", args.slots), ("--max-tokens-limit", args.max_tokens_limit),
                    ("--max-len", args.max_len), ("--cycles-per-step", args.cycles_per_step)):
        if v < 1:
            ap.error(f"{name} must be >= 1")
    if args.max_queue < 0:
        ap.error("--max-queue must be >= 0")
    import uvicorn

    import dspark_jax as ds
    from dspark_jax.decoding import compile_stats

    try:
        if args.drafter not in ("auto", "none", "ngram"):
            from dspark_jax.io.drafter_io import inspect_drafter

            inspect_drafter(args.drafter.removesuffix("+ngram"))  # a bad path fails before the target loads
        if not args.no_compile_cache:
            import jax

            jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        compile_stats.ensure_registered()
        t0 = time.perf_counter()
        target = ds.load_target(args.target, dtype=args.dtype)
        drafter = load_drafter(args.drafter, target)
        engine = make_engine(args, target, drafter)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("loaded %s (drafter: %s, policy %s, %d slots, cache %d tokens) in %.1f s", target.name,
             "none" if engine.drafter is None else args.drafter, engine.settings.policy if engine.drafter else "ar",
             engine.S, engine.T, time.perf_counter() - t0)
    if args.warmup != "none":
        warmup(engine, target, full=args.warmup == "full")
    server = Server(target, engine, model_name=args.served_model_name or args.target, api_key=args.api_key,
                    max_queue=args.max_queue, max_tokens_limit=args.max_tokens_limit)

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT / SIGTERM: refuse new requests, let uvicorn drain
            server.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(server.app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=not args.no_access_log, timeout_graceful_shutdown=None)
    try:
        _Uvicorn(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
