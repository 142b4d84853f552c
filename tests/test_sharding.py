"""The logical-axis rules table: every parameter is covered, collisions raise, and a target
sharded over a fake 8-device CPU mesh computes the same logits as on one device."""

import os
import subprocess
import sys
import textwrap

import pytest

import dspark_jax as ds
from dspark_jax.sharding import SERVING_RULES, TRAINING_RULES, logical_to_spec, state_specs


@pytest.mark.parametrize("rules", [TRAINING_RULES, SERVING_RULES])
@pytest.mark.parametrize("scan", [False, True])
def test_every_parameter_has_a_rule(rules, scan):
    t = ds.Target.random(ds.ModelConfig.tiny(family="qwen3", tie_word_embeddings=False, scan_layers=scan))
    d = ds.Drafter.random(ds.DrafterConfig.for_target(t.cfg, num_feature_layers=2, num_layers=1, markov_rank=8,
                                                      head_type="rnn"))
    state_specs(t.state, rules)
    state_specs(d.state, rules)


def test_collisions_and_unknown_axes_raise():
    with pytest.raises(ValueError, match="same mesh axis"):
        logical_to_spec(("mlp", "vocab"), TRAINING_RULES)
    with pytest.raises(ValueError, match="no sharding rule"):
        logical_to_spec(("embed", "bogus"), TRAINING_RULES)
    assert tuple(logical_to_spec(("embed", "mlp"), TRAINING_RULES, ndim=3)) == (None, "fsdp", "tensor")


SCRIPT = textwrap.dedent("""
    import numpy as np, jax
    import dspark_jax as ds
    from dspark_jax.sharding import make_mesh, shard_state, TRAINING_RULES, SERVING_RULES
    assert len(jax.devices()) == 8
    t = ds.Target.random(ds.ModelConfig.tiny(family="qwen3", tie_word_embeddings=False), seed=3)
    ids = np.random.default_rng(0).integers(0, 128, (2, 9))
    ref = np.asarray(ds.logits(t, ids))
    for rules, shape in ((TRAINING_RULES, (2, 2, 2)), (SERVING_RULES, (4, 1, 2))):
        mesh = make_mesh(*shape)
        st = shard_state(t.state, mesh, rules)
        assert any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(st))
        out = np.asarray(ds.logits(ds.Target(t.cfg, t.graphdef, st), ids))
        err = np.abs(out - ref).max()
        assert err < 1e-5, err
    print("OK")
""")


def test_sharded_logits_equal_single_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
