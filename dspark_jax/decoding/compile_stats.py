"""Counts XLA compilations (via jax.monitoring) so stats can separate compile time from run
time, and tests can assert that warm decoding compiles nothing new."""

from __future__ import annotations

import threading

import jax

_lock = threading.Lock()
_count = 0
_seconds = 0.0
_registered = False

_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def _listener(name, duration, **_):
    global _count, _seconds
    if name in _EVENTS:
        with _lock:
            _seconds += duration
            if name == "/jax/core/compile/backend_compile_duration":
                _count += 1


def ensure_registered():
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _registered = True


def snapshot() -> tuple[int, float]:
    """(backend compiles so far, seconds spent tracing + lowering + compiling so far)."""
    ensure_registered()
    return _count, _seconds
