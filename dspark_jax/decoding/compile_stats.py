"""Counts XLA compilations (via jax.monitoring) so stats can separate compile time from run
time, and tests can assert that warm decoding compiles nothing new; watches the memory maps
that compiled programs hold (`memory_maps`, `MapGuard`)."""

from __future__ import annotations

import logging
import threading

import jax

log = logging.getLogger(__name__)

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


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's limit `vm.max_map_count`), or None where
    the kernel does not say (not Linux).

    XLA:CPU maps ~130–280 code and data pages per compiled program and keeps them while the
    program is cached; a process that reaches the limit fails its next compile ("LLVM
    compilation error: Cannot allocate memory") and can crash. Linux's default limit is 65,530:
    a few hundred programs."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return None
    return used, limit


class MapGuard:
    """Drops every compiled program (`jax.clear_caches()`) when the process's memory maps pass
    `fraction` of the kernel's limit, so that a long-lived process that keeps compiling new
    shapes slows down (the programs compile again, or load from the persistent compile cache,
    on next use) instead of crashing. Checks only after compiles happened (maps grow with
    programs), so calling `check()` every step costs nothing when warm."""

    def __init__(self, fraction: float = 0.85):
        self.fraction = fraction
        self.seen = -1
        self.clears = 0
        self.used: int | None = None
        self.limit: int | None = None

    def check(self) -> bool:
        """True when it dropped the compiled programs."""
        n = snapshot()[0]
        if n == self.seen:
            return False
        self.seen = n
        maps = memory_maps()
        if maps is None:
            return False
        self.used, self.limit = maps
        if self.used <= self.fraction * self.limit:
            return False
        log.warning("this process holds %d of the kernel's %d memory maps (vm.max_map_count; XLA:CPU maps "
                    "pages for every compiled program, and a compile past the limit crashes): dropping the "
                    "compiled programs, which compile again on next use. Raise the limit to keep them: "
                    "sysctl -w vm.max_map_count=262144", self.used, self.limit)
        jax.clear_caches()
        self.clears += 1
        maps = memory_maps()
        if maps is not None:
            self.used = maps[0]
        return True
