"""Compile counting and the memory-map guard of long-lived processes."""

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.decoding import compile_stats


def test_the_map_guard_drops_compiled_programs_only_past_its_fraction():
    maps = compile_stats.memory_maps()
    if maps is None:
        pytest.skip("the kernel does not report memory maps (not Linux)")
    used, limit = maps
    assert 0 < used < limit

    f = jax.jit(lambda x: x * 3.0 + 1.0)
    x = jnp.arange(5.0)
    f(x).block_until_ready()
    c0, _ = compile_stats.snapshot()
    assert not compile_stats.MapGuard(fraction=1.0).check()  # far from the limit: keeps everything
    f(x).block_until_ready()
    assert compile_stats.snapshot()[0] == c0  # still compiled

    guard = compile_stats.MapGuard(fraction=0.0)  # any map is too many
    assert guard.check() and guard.clears == 1 and 0 < guard.used <= guard.limit == limit
    assert not guard.check()  # no compile since: not even a look at the maps
    f(x).block_until_ready()
    assert compile_stats.snapshot()[0] == c0 + 1  # dropped, so compiled again
    assert guard.check() and guard.clears == 2
