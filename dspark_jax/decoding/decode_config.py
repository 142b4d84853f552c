"""How to decode: one frozen config, validated in one place, used by `generate()` and the
serving engine alike.

The policy vocabulary users see is `DecodeConfig.policy` (+ `scheduler` for "dspark"):

- "ar": autoregressive (a drafter, if given, is ignored);
- "fixed": verify `num_draft` ≤ γ drafts per request per cycle (default γ);
- "dspark": the confidence scheduler picks how many drafts of each request the target
  verifies, maximising expected tokens per second: `scheduler` "async" (default; budget
  from earlier steps, can skip drafting) or "sync" (this step's confidences), or a callable
  (conf [S, K], active [S], caps [S], rates [U], buckets) -> lengths [S] run in place of sync;
- "threshold": verify the drafts whose predicted survival is ≥ `threshold`;
- None: "fixed" with a drafter, "ar" without.

`loop_schedule` is what the on-device cycle runs (`LoopSettings.policy`): "fixed", "async",
"sync", "threshold" or the callable — the same names the stand-alone `ds.schedule` takes.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from dspark_jax.models.drafters import bind_drafter

POLICIES = (None, "ar", "fixed", "dspark", "threshold")
SCHEDULERS = ("async", "sync")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Decoding options shared by `generate()` and `serve.engine.Engine` (see the module doc
    for the policies). `windowed_attention`: attention reads only a window of the cache that
    covers the active contexts (256 positions, doubling; `fine_windows`: also 1.5× steps
    between, 384, 768, …, which reads up to a third less at 16+ slots for twice the compiled
    decode loops; BENCHMARKS.md "Stop 34"). `compact_slots` (generate, fixed /
    ar): finished requests leave the slot bucket. `chunk_cycles`: cycles per host round trip
    when stop strings are set. `prefill_chunk`: prompt tokens per prefill step of a request.
    `batched_prefill`: the older single prefill program over all prompts (for comparison).
    `makespan` (generate, async scheduler): a static batch returns when its slowest request is
    done, so the budget weighs a step by the progress of the slots that could finish last
    (False: by the batch's tokens/s, as the serving engine does). `bucket_widths` (scheduled
    policies, profiled tables): each verification bucket's query grid — "narrow": the even
    share of the bucket's drafts plus one a slot (`profiling.narrow_widths`: small buckets cost
    less and admit at most width − 1 drafts a slot; serving at 8 slots 1.03–1.11× "full",
    BENCHMARKS.md "Stop 51"); "full": K + 1 tokens a slot in every bucket."""

    policy: str | None = None
    num_draft: int | None = None
    scheduler: Any = "async"
    threshold: float = 0.5
    windowed_attention: bool = True
    fine_windows: bool = False
    compact_slots: bool = True
    chunk_cycles: int = 16
    prefill_chunk: int = 512
    batched_prefill: bool = False
    makespan: bool = True
    bucket_widths: str = "narrow"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy == "dspark" and not (self.scheduler in SCHEDULERS or callable(self.scheduler)):
            raise ValueError(f"scheduler must be one of {SCHEDULERS} (or a callable), got {self.scheduler!r}")
        if self.policy == "threshold" and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be a survival probability in [0, 1], got {self.threshold}")
        if self.num_draft is not None and not (isinstance(self.num_draft, numbers.Integral) and self.num_draft >= 0):
            raise ValueError(f"num_draft must be an integer >= 0 (or None for the block size), got {self.num_draft!r}")
        if self.bucket_widths not in ("narrow", "full"):
            raise ValueError(f"bucket_widths must be 'narrow' or 'full', got {self.bucket_widths!r}")
        for name in ("chunk_cycles", "prefill_chunk"):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Integral) and v >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @classmethod
    def pick(cls, config: DecodeConfig | None, **options) -> DecodeConfig:
        """`config`, or the caller's loose options as one config (give one or the other)."""
        loose = cls(**options)
        if config is None:
            return loose
        if not isinstance(config, cls):
            raise TypeError(f"config must be a DecodeConfig, got {type(config).__name__}")
        if loose != cls():
            raise ValueError("pass the decoding options either as config=DecodeConfig(...) or one by one, not both")
        return config

    def resolve(self, target, drafter) -> tuple[str, Any, int]:
        """(policy, drafter or None, K drafts per cycle) for this target: the drafter checked
        and bound (`bind_drafter`), None when the policy decodes autoregressively (also when
        num_draft = 0); K = 0 then."""
        policy = self.policy
        if policy in ("fixed", "dspark", "threshold") and drafter is None:
            raise ValueError(f"policy={policy!r} needs a drafter")
        if policy is None:
            policy = "fixed" if drafter is not None else "ar"
        if policy == "ar":
            return "ar", None, 0
        drafter = bind_drafter(drafter, target)
        K = drafter.block_size if self.num_draft is None else int(self.num_draft)
        if not 0 <= K <= drafter.block_size:
            raise ValueError(f"num_draft must be in [0, {drafter.block_size}] (the block size), got {K}")
        if K == 0:
            return "ar", None, 0
        return policy, drafter, K

    def loop_schedule(self, policy: str):
        """The cycle's schedule for a resolved policy: "fixed" (also for ar), the scheduler, or
        "threshold"."""
        if policy in ("ar", "fixed"):
            return "fixed"
        return self.scheduler if policy == "dspark" else "threshold"
