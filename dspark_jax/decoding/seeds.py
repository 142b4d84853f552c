"""Per-request PRNG keys from user seeds.

A request's key depends on its own seed only, never on the batch it shares, so a seeded
request gives the same tokens alone or among others. Seeds in [0, 2³²) are used exactly as
`jax.random.key(seed)` (what a JAX user expects a seed to mean); any other Python int
(negative, or wider than 32 bits) is hashed to 128 bits first, so every int is a valid seed
and distinct seeds get distinct keys. `seed=None` draws a fresh 63-bit seed from the OS.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_WORDS = 4  # 128 bits for a hashed seed


def resolve_seed(seed: int | None) -> int:
    """The seed a request runs with: its own, or a fresh one from the OS."""
    return secrets.randbits(63) if seed is None else int(seed)


def _words(seed: int) -> tuple[bool, np.ndarray]:
    if 0 <= seed < 2**32:
        return False, np.array([seed, 0, 0, 0], np.uint32)
    n = (seed.bit_length() + 8) // 8  # room for the sign bit
    digest = hashlib.blake2b(seed.to_bytes(n, "little", signed=True), digest_size=4 * _WORDS).digest()
    return True, np.frombuffer(digest, np.uint32).copy()


def request_keys(seeds: Sequence[int]) -> jax.Array:
    """One PRNG key per request [R] from resolved (int) seeds."""
    hashed, words = zip(*(_words(int(s)) for s in seeds))
    w = jnp.asarray(np.stack(words))
    plain = jax.vmap(jax.random.key)(w[:, 0])
    folded = plain
    for i in range(1, _WORDS):
        folded = jax.vmap(jax.random.fold_in)(folded, w[:, i])
    data_plain, data_folded = jax.random.key_data(plain), jax.random.key_data(folded)
    pick = jnp.asarray(hashed).reshape((-1,) + (1,) * (data_plain.ndim - 1))
    return jax.random.wrap_key_data(jnp.where(pick, data_folded, data_plain))
