"""The engine thread: owns the engine, takes submissions and cancellations from the HTTP side
through a command queue, and hands each request's tokens back to asyncio."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import traceback
from typing import Any

from serve.metrics import Metrics
from serve.protocol import APIError

log = logging.getLogger(__name__)


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
        from dspark_jax.decoding.compile_stats import MapGuard

        # A long-lived process that keeps meeting new shapes must not run out of memory maps.
        self.maps = MapGuard()
        self.maps.check()
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
                self.maps.check()
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
