"""OpenAI-compatible HTTP server over the continuous-batching engine: `python -m serve.server`.

    python -m serve.server --target smollm2-135m --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as server-sent events, or
not), GET /v1/models, /health and /metrics (Prometheus text). This module holds the FastAPI
app and the command line; the request format is in `serve/protocol.py`, the engine thread in
`serve/worker.py`, the responses in `serve/responses.py`, the metrics in `serve/metrics.py`.
SIGINT / SIGTERM: stop accepting connections, finish the requests in flight, exit.
Details: docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import time
import traceback

try:
    from starlette.requests import Request  # module level: FastAPI resolves the handlers' annotations here
except ImportError:  # pragma: no cover
    raise SystemExit('the server needs FastAPI and uvicorn: pip install -e ".[serve]"') from None

from serve.metrics import Metrics, StatusCounter
from serve.protocol import APIError, Settings, bad_request, fit_max_tokens, parse_json, parse_request
from serve.responses import JobStream, WatchedResponse
from serve.worker import EngineThread, Job, QueueFull

log = logging.getLogger("serve.server")

CACHE_DIR = os.environ.get("DSPARK_XLA_CACHE", os.path.expanduser("~/.cache/dspark_jax/xla"))


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
            return JSONResponse(bad_request(str(exc)).body(), status_code=400)

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
            maps = server.worker.maps
            text = server.metrics.render({"slots": server.engine.S, "active_slots": server.engine.n_slots,
                                          "max_queue": server.max_queue,
                                          "running": running, "queued": queued, "memory_maps": maps.used,
                                          "memory_maps_limit": maps.limit, "program_drops": maps.clears,
                                          "budget_trust": server.engine.budget_trust})
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

        return StatusCounter(app, self.metrics)

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
        body = parse_json(await request.body())
        r = parse_request(body, self.settings, self.target.eos_token_ids, chat=chat)
        ids = await asyncio.get_running_loop().run_in_executor(None, self._encode, r.prompt, chat)
        max_tokens = fit_max_tokens(r.max_tokens, len(ids), self.settings, chat=chat)
        sp = ds.SamplingParams(max_new_tokens=max_tokens, **r.sampling)
        job = Job(ids, sp, asyncio.get_running_loop(), arrived)
        try:
            self.worker.submit(job)
        except QueueFull:
            raise APIError(429, f"the server is at capacity ({self.engine.S} running + {self.max_queue} queued "
                                "requests); retry later", "rate_limit_error", None, "too_many_requests") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        stream_ctx = JobStream(job, rid, chat=chat, include_usage=r.include_usage, stop=r.stop, tokenizer=self.tok,
                               metrics=self.metrics, model_name=self.settings.model_name)
        if r.stream:
            return WatchedResponse(stream_ctx.sse, lambda: self.worker.cancel(job), streaming=True)
        return WatchedResponse(stream_ctx.whole, lambda: self.worker.cancel(job), streaming=False)

    def _encode(self, prompt, chat: bool) -> list[int]:
        from dspark_jax.decoding.generate import encode_prompt

        try:
            return encode_prompt(self.target, prompt)
        except ValueError as e:
            raise bad_request(str(e), "messages" if chat else "prompt") from None
        except Exception as e:  # noqa: BLE001 — a chat template error (jinja2) is the client's
            if type(e).__module__.startswith("jinja2"):
                raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
            raise


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
    ap.add_argument("--min-slots", type=int, default=1,
                    help="smallest slot bucket: the decode state shrinks to the power of two that holds the requests "
                         "in flight, down to this (= --slots: every step pays for all slots)")
    ap.add_argument("--pooled-calibration", action="store_true",
                    help="the async budget also calibrates on every request served (accepted drafts against what "
                         "it expected), not only on each request's own evidence")
    ap.add_argument("--bucket-widths", choices=("narrow", "full"), default="narrow",
                    help="query grid of each verification bucket: 'narrow' = the even share of the bucket's drafts "
                         "plus one a slot (small buckets cost less and admit fewer drafts a slot); 'full' = K + 1 "
                         "tokens a slot in every bucket")
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
    ap.add_argument("--weight-dtype", default=None,
                    help="bfloat16: matmul weights stored in bf16 under float32 arithmetic (half their memory; on CPUs "
                         "with AMX / AVX512-BF16 a step of many tokens costs about what one does)")
    ap.add_argument("--weight-terms", type=int, choices=(1, 3), default=3,
                    help="with --weight-dtype bfloat16: 3 (the float32 products) or 1 (activations rounded to bf16, "
                         "decode steps batch-invariant; serve.generate --help)")
    ap.add_argument("--fine-windows", action="store_true",
                    help="attention windows in 1.5x steps too (256, 384, 512, 768, ...): less attention over "
                         "unused cache positions at many requests, twice the compiled decode loops")
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
    return ds.load_drafter(name, target)  # a shipped name, a directory, 'ngram' or NAME+ngram (the hybrid)


def make_engine(args, target, drafter):
    import dspark_jax as ds
    from serve.engine import Engine

    policy = args.policy or ("dspark" if drafter is not None else "ar")
    if policy != "ar" and drafter is None:
        raise ValueError(f"--policy {policy} needs a drafter (got --drafter {args.drafter})")
    if args.num_draft is not None and policy != "fixed":
        raise ValueError("--num-draft applies to --policy fixed")
    config = ds.DecodeConfig(policy=policy, num_draft=args.num_draft, fine_windows=args.fine_windows,
                             bucket_widths=getattr(args, "bucket_widths", "narrow"))
    return Engine(target, drafter if policy != "ar" else None, slots=args.slots, min_slots=args.min_slots,
                  max_len=args.max_len, max_new_tokens=args.max_tokens_limit, prefill_tokens=args.prefill_tokens,
                  cycles_per_step=args.cycles_per_step, config=config,
                  pooled_calibration=getattr(args, "pooled_calibration", False))


def warmup(engine, target, full: bool = False):
    """Compiles admission and the decode loop before any client waits: greedy and sampled
    requests (greedy-only batches run a program of their own), at every slot bucket (as many
    requests as its slots), at the first attention window or, with `full`, at every window of
    the cache (a long prompt each); then the state's moves between windows and slot buckets.
    Drops the compiled programs rather than crash if the process nears the kernel's memory-map
    limit (`MapGuard`)."""
    import dspark_jax as ds
    from dspark_jax.decoding.compile_stats import MapGuard

    t0 = time.perf_counter()
    unit = target.tokenizer.encode("Hello world. ") if target.tokenizer is not None else [1]
    new = min(2 * engine.cycles_per_step, engine.max_new_tokens)
    # One prompt per prefill chunk size (a chunk of exactly c tokens runs in c rows), all inside
    # the first attention window.
    lengths = sorted({len(unit)} | {max(len(unit), c) for c in engine.chunk_sizes
                                    if c + new + engine.K + 1 <= min(engine.windows or [engine.T])})
    if full:  # a prompt that just crosses into each larger window
        bounds = [w for w in engine.windows if w is not None]
        lengths += [b - engine.K for b in bounds if b - engine.K + new + engine.K + 1 <= engine.T]
    guard = MapGuard()  # a warm-up of many windows must not crash the process either
    for slots in engine.slot_buckets:
        for n in lengths:
            ids = (unit * (n // len(unit) + 1))[:n]
            for temp in (0.0, 0.7):
                for _ in range(slots):
                    engine.submit(ids, ds.SamplingParams(temperature=temp, seed=0, ignore_eos=True,
                                                         max_new_tokens=new))
                engine.run()
                guard.check()
    engine.finished.clear()
    engine.warm_buckets(unit)
    guard.check()
    engine.compile_cache_moves()
    guard.check()
    log.info("warm-up (%d prompt lengths, greedy and sampled, slot buckets %s) done in %.1f s%s", len(lengths),
             engine.slot_buckets, time.perf_counter() - t0, "" if guard.used is None else
             f"; the process holds {guard.used} of the kernel's {guard.limit} memory maps")


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
        target = ds.load_target(args.target, dtype=args.dtype, weight_dtype=args.weight_dtype,
                                weight_terms=args.weight_terms)
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
