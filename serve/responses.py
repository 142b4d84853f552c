"""Generation responses: a job's engine events turned into an OpenAI completion or a stream of
server-sent-event chunks (incremental detokenisation, stop-string hold-back), sent by an ASGI
response that cancels the job when the client disconnects first."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

from serve import protocol
from serve.metrics import Metrics
from serve.worker import Job

log = logging.getLogger(__name__)


class JobStream:
    """Turns a job's engine events into OpenAI responses (incremental detokenisation)."""

    def __init__(self, job: Job, rid: str, *, chat: bool, include_usage: bool, stop: list[str], tokenizer,
                 metrics: Metrics, model_name: str):
        self.job, self.rid, self.chat = job, rid, chat
        self.include_usage, self.stop = include_usage, stop
        self.tok, self.metrics, self.model_name = tokenizer, metrics, model_name
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.sent = ""  # text streamed so far
        self.first_at: float | None = None

    def _safe_text(self) -> str:
        """The decoded text that can no longer change: no trailing partial UTF-8 character and
        no tail that could still grow into a stop string."""
        text = self.tok.decode(self.tokens)
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
        m = self.metrics
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
        return protocol.usage_body(len(self.job.prompt_ids), len(req.tokens))

    def _final_text(self, req) -> str:
        return req.text if req.text is not None else self.tok.decode(req.tokens)

    async def whole(self, send_json: Callable):
        async for ev in self._events():
            if ev[0] == "error":
                await send_json(ev[1].status, ev[1].body())
                return
            if ev[0] == "done":
                req = ev[1]
                await send_json(200, protocol.completion_body(
                    self.rid, self.created, self.model_name, chat=self.chat, text=self._final_text(req),
                    finish_reason=req.finish_reason, usage=self._usage(req)))
                return

    def _chunk(self, delta: str | None, finish: str | None, role: bool = False) -> dict:
        return protocol.chunk(self.rid, self.created, self.model_name, chat=self.chat, delta=delta, finish=finish,
                              role=role, include_usage=self.include_usage)

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


class WatchedResponse(Response):
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
