"""Tiny random target + drafter, for unit tests and smoke runs (seconds on a laptop CPU).

    from configs import tiny; cfg = tiny.get_config()
    target = ds.Target.random(cfg["target"]); drafter = ds.Drafter.random(cfg["drafter"])
"""

import dspark_jax as ds


def get_config() -> dict:
    target = ds.ModelConfig.tiny()
    drafter = ds.DrafterConfig.for_target(target, num_feature_layers=2, block_size=4, num_layers=1,
                                          markov_rank=8)
    return {"target": target, "drafter": drafter}
