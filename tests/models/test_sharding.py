"""The logical-axis rules table: every parameter is covered, collisions raise, and a target
sharded over a fake 8-device CPU mesh computes the same logits as on one device."""

import os
import subprocess
import sys
import textwrap

import pytest

import dspark_jax as ds
from dspark_jax.sharding import SERVING_RULES, TRAINING_RULES, logical_to_spec, state_specs


@pytest.mark.slow
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


@pytest.mark.slow
def test_sharded_logits_equal_single_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


SERVE_SCRIPT = textwrap.dedent("""
    import numpy as np, jax
    import dspark_jax as ds
    from dspark_jax.sharding import make_mesh
    from serve.engine import Engine
    assert len(jax.devices()) == 8
    cfg = ds.ModelConfig.tiny(family="qwen3", tie_word_embeddings=False, num_layers=2)
    t = ds.Target.random(cfg, seed=4)
    dcfg = ds.DrafterConfig.for_target(cfg, num_feature_layers=2, block_size=4, num_layers=1, markov_rank=8,
                                       draft_vocab_size=64)
    d = ds.Drafter.random(dcfg, seed=5, draft_ids=np.arange(0, 128, 2))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, int(n)).tolist() for n in (5, 17, 9, 30, 12, 3)]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ref = ds.generate(t, prompts, sampling=sp).token_ids
    mesh = make_mesh(data=4, tensor=2)
    for policy in ("ar", "fixed", "dspark"):
        eng = Engine(t, d if policy != "ar" else None, slots=4, max_len=128, max_new_tokens=12,
                     prefill_tokens=16, policy=policy, num_draft=3 if policy != "ar" else None,
                     step_rates={4: 1.0, 8: 0.9, 12: 0.8, 16: 0.7}, mesh=mesh)
        w = eng.target.state["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
        assert len(w.sharding.device_set) == 8 and not w.sharding.is_fully_replicated
        assert len(jax.tree.leaves(eng.st.cache)[0].sharding.device_set) == 8
        reqs = [eng.submit(p, sp) for p in prompts]
        eng.run()
        assert [r.tokens for r in reqs] == ref, policy
    print("OK")
""")


@pytest.mark.slow
def test_sharded_serving_equals_single_device():
    """The serving engine with target and drafter sharded over 8 simulated devices (data 4 ×
    tensor 2, the serving rules) gives the same greedy tokens as one device, for
    autoregressive, fixed-length and scheduled speculative decoding."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    r = subprocess.run([sys.executable, "-c", SERVE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
