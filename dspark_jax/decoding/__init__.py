"""Decoding: sampling, verification, the on-device loop, schedulers, `generate()`."""

from dspark_jax.decoding.scheduler import schedule

__all__ = ["schedule"]
