"""Training: anchors and block masks, the loss against a NumPy reference, the tiny end-to-end
program (regenerate → train → loss falls, τ rises), resume after SIGKILL, and bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.training.batches import make_example
from dspark_jax.training.losses import dspark_loss

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_make_example_anchors_and_cumulative_mask():
    # 5 prompt tokens, 6 response tokens, then a second (unsupervised) turn and the end.
    tokens = np.arange(20, 35)
    mask = np.array([0] * 5 + [1] * 6 + [0] * 2 + [1] * 2)
    rng = np.random.default_rng(0)
    ex = make_example(tokens, mask, seq_len=16, num_anchors=32, block_size=4, rng=rng)
    anchors, bm = ex["anchors"], ex["block_mask"]
    cand = [i for i in range(14) if mask[i + 1] == 1]
    n = len(cand)
    assert sorted(anchors[:n].tolist()) == cand  # every candidate once (A > candidates)
    assert (bm[n:] == 0).all()
    for a, row in zip(anchors[:n], bm[:n]):
        want = np.cumprod([mask[a + 1 + k] if a + 1 + k < 15 else 0 for k in range(4)])
        np.testing.assert_array_equal(row, want)
    assert ex["tokens"][:15].tolist() == tokens.tolist() and ex["tokens"][15] == 0


def _np_loss(dl, cl, tl_full, ids, labels, bm, decay, alpha=(0.1, 0.9, 1.0)):
    """Direct NumPy transcription over the full vocabulary."""
    B, A, G, P = dl.shape
    V = tl_full.shape[-1]
    pt = np.exp(tl_full - tl_full.max(-1, keepdims=True))
    pt /= pt.sum(-1, keepdims=True)
    pd_small = np.exp(dl - dl.max(-1, keepdims=True))
    pd_small /= pd_small.sum(-1, keepdims=True)
    pd = np.zeros((B, A, G, V))
    pd[..., ids] = pd_small
    l1 = np.abs(pd - pt).sum(-1)
    acc = np.clip(1 - l1 / 2, 0, 1)
    w = np.exp(-np.arange(G) / decay)[None, None] * bm
    inv = {t: i for i, t in enumerate(ids)}
    ce = np.zeros((B, A, G))
    wce = np.zeros((B, A, G))
    for idx in np.ndindex(B, A, G):
        if labels[idx] in inv:
            ce[idx] = -np.log(pd_small[idx][inv[labels[idx]]])
            wce[idx] = w[idx]
    c = 1 / (1 + np.exp(-cl))
    bce = -(acc * np.log(c) + (1 - acc) * np.log(1 - c))
    l_ce = (ce * wce).sum() / wce.sum()
    l_tv = (l1 * w).sum() / w.sum()
    l_conf = (bce * w).sum() / w.sum()
    return alpha[0] * l_ce + alpha[1] * l_tv + alpha[2] * l_conf, l_ce, l_tv, l_conf


def test_loss_matches_numpy_reference():
    rng = np.random.default_rng(1)
    B, A, G, V = 2, 3, 4, 12
    ids = np.sort(rng.permutation(V)[:7])  # a draft vocabulary that misses 5 tokens
    dl = rng.normal(size=(B, A, G, len(ids))) * 2
    cl = rng.normal(size=(B, A, G))
    tl = rng.normal(size=(B, A, G, V)) * 2
    labels = rng.integers(0, V, (B, A, G))
    bm = np.cumprod(rng.random((B, A, G)) < 0.85, -1).astype(np.float32)
    bm[0, 0] = 1
    want = _np_loss(dl, cl, tl, ids, labels, bm, decay=4.0)
    logp = jax.nn.log_softmax(jnp.asarray(tl), -1)
    logp_p = logp[..., ids]
    where = np.full(V, -1)
    where[ids] = np.arange(len(ids))
    lab_p = where[labels]
    loss, m = dspark_loss(jnp.asarray(dl), jnp.asarray(cl), logp_p, jnp.exp(logp_p).sum(-1),
                          jnp.asarray(np.maximum(lab_p, 0)), jnp.asarray((lab_p >= 0).astype(np.float32)),
                          jnp.asarray(bm), decay=4.0)
    np.testing.assert_allclose([float(loss), float(m["ce"]), float(m["tv"]), float(m["conf_bce"])], want,
                               rtol=2e-5)


def _run_here(workdir, *extra, stage="train"):
    """In-process `train.main` (no new interpreter): (exit code, stderr)."""
    import contextlib
    import io

    from train.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir),
                   "--stage", stage, *extra])
    return rc, err.getvalue()


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    assert _run_here(d, stage="data")[0] == 0
    return d


def _copy_data(src, dst):
    import shutil

    shutil.copytree(os.path.join(src, "data"), os.path.join(dst, "data"))


def test_tiny_end_to_end_loss_falls_tau_rises(tiny_data, tmp_path):
    _copy_data(tiny_data, tmp_path)
    assert _run_here(tmp_path)[0] == 0
    m = _metrics(tmp_path)
    # Means of the first and last two logged steps (each a 5-step mean's worth of noise less).
    loss = [r["loss"] for r in m]
    tau = [r["expected_tau"] for r in m]
    assert sum(loss[-2:]) < sum(loss[:2])
    assert sum(tau[-2:]) > sum(tau[:2])
    assert _run_here(tmp_path, stage="export")[0] == 0
    import dspark_jax as ds

    t = ds.Target.random(ds.ModelConfig.tiny(), seed=0)
    d = ds.load_drafter(os.path.join(tmp_path, "export"), t)
    assert d.cfg.draft_vocab_size == 96
    out = ds.generate(t, [[1, 5, 9, 13]], drafter=d, sampling=ds.SamplingParams(temperature=0.0, max_new_tokens=8))
    ref = ds.generate(t, [[1, 5, 9, 13]], sampling=ds.SamplingParams(temperature=0.0, max_new_tokens=8))
    assert out.token_ids == ref.token_ids
    # A warm start from the export (`init_from` = an export directory, not a workdir): one step
    # at learning rate 0 must leave exactly the exported (bf16) weights, cast to fp32.
    warm = tmp_path / "warm"
    warm.mkdir()
    _copy_data(tiny_data, warm)
    rc, err = _run_here(warm, "--set", f"init_from={tmp_path / 'export'}", "--set", "max_steps=1",
                        "--set", "learning_rate=0.0")
    assert rc == 0 and "(export), fresh optimizer" in err, err[-2000:]
    from dspark_jax.io.drafter_io import read_drafter_tensors

    exported = read_drafter_tensors(str(tmp_path / "export"))
    got = _final_params(warm)
    trained = [k for k in got if k.replace("/", ".") in exported and k != "draft_ids"]
    assert len(trained) > 5
    for k in trained:
        np.testing.assert_array_equal(got[k], np.asarray(exported[k.replace("/", ".")], np.float32), err_msg=k)
    # A workdir with no checkpoint exports (and calibrates) the exported drafter `init_from`
    # names: a drafter trained elsewhere and brought back as its export.
    rc, err = _run_here(tmp_path / "again", "--set", f"init_from={tmp_path / 'export'}", stage="export")
    assert rc == 0 and "no checkpoint: the exported drafter" in err, err[-2000:]
    again = read_drafter_tensors(str(tmp_path / "again" / "export"))
    assert again.keys() == exported.keys()
    for k in again:
        np.testing.assert_array_equal(again[k], exported[k], err_msg=k)


def test_time_boxed_stages_keep_what_they_finished(tiny_data, tmp_path, monkeypatch):
    """`max_regen_seconds` / `max_train_seconds` (a borrowed accelerator's time box): the data
    stage starts no batch past its budget and keeps the shards it wrote; the train stage saves
    the step it reached and ends cleanly, and rerunning resumes from there."""
    import dspark_jax as ds
    from dspark_jax.training import records
    from dspark_jax.training import regenerate as regen

    class Clock:  # every reading one second after the last
        now = 0.0

        @classmethod
        def perf_counter(cls):
            cls.now += 1.0
            return cls.now

    t = ds.Target.random(ds.ModelConfig.tiny(), seed=0)
    prompts = [[1, 4 + i, 9] for i in range(6)]
    with monkeypatch.context() as m:
        m.setattr(regen, "time", Clock)
        got = regen.regenerate(t, prompts, str(tmp_path / "regen"), batch_size=2, max_new_tokens=4,
                               temperature=0.0, max_seconds=1.5)
    assert got["batches"] == 3
    assert [os.path.basename(p) for p in records.shard_paths(str(tmp_path / "regen"))] == ["shard-00000.array_record"]

    _copy_data(tiny_data, tmp_path)
    rc, err = _run_here(tmp_path, "--set", "max_train_seconds=1e-9")
    assert rc == 0 and "max_train_seconds=0 spent: saved step 1 of" in err, err[-2000:]
    assert (tmp_path / "ckpt" / "1").exists()
    rc, err = _run_here(tmp_path)
    assert rc == 0 and "resumed from step 1" in err
    assert _metrics(tmp_path)[-1]["step"] > 1 and "wall_s" in _metrics(tmp_path)[-1]


def test_prompts_stage_writes_the_split_it_reads_back(tmp_path, smollm2):
    """`--stage prompts` writes the config's prompts (those that fit `max_prompt_tokens`) as
    JSONL; a run that names that file as its only source gets the same training and held-out
    prompts (the held-out split is a hash of each prompt), so a machine without the sources'
    packages regenerates exactly what this one would."""
    import contextlib
    import io

    from dspark_jax.decoding.generate import encode_prompt
    from train.main import load_config, main
    from train.stages import _prompts

    sets = ["--set", 'prompt_sources=("mathgen@60","pystdlib@40")', "--set", "heldout_fraction=0.2",
            "--set", "max_prompt_tokens=160"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--config", os.path.join(ROOT, "configs", "smollm2_135m.py"), "--workdir", str(tmp_path),
                   "--stage", "prompts", *sets])
    assert rc == 0, err.getvalue()[-2000:]
    cfg = load_config(os.path.join(ROOT, "configs", "smollm2_135m.py")).with_overrides(sets[1::2])
    train, held = _prompts(cfg, None)
    fits = [p for p in train + held if len(encode_prompt(smollm2, p)) <= 160]
    assert 0 < len(fits) < len(train) + len(held) and held  # some pystdlib prompts are too long
    path = tmp_path / "prompts.jsonl"
    back_train, back_held = _prompts(cfg.replace(prompt_sources=(str(path),)), None)
    key = json.dumps
    assert sorted(map(key, back_train + back_held)) == sorted(map(key, fits))
    assert sorted(map(key, back_held)) == sorted(key(p) for p in held if p in fits)
    # Token-id prompts have no text to write.
    rc, err = _run_here(tmp_path / "tiny", stage="prompts")
    assert rc == 2 and "token-id prompts" in err


def _final_params(workdir):
    import dspark_jax as ds
    from train.main import load_config
    from train.stages import restore_params

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    t = ds.Target.random(ds.ModelConfig.tiny(), seed=0)
    d = restore_params(cfg, str(workdir), t)
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in
            __import__("flax").nnx.to_flat_state(d.state)}


def test_sigkill_and_resume_equals_uninterrupted(tiny_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        _copy_data(tiny_data, d)
    assert _run_here(a, "--set", "num_epochs=3")[0] == 0
    # b: killed (SIGKILL, no chance to save) once the step-10 checkpoint exists, then resumed.
    cmd = [sys.executable, "-m", "train.main", "--config", os.path.join(ROOT, "configs", "tiny.py"),
           "--workdir", str(b), "--stage", "train", "--set", "num_epochs=3"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = b / "ckpt" / "10"
    t0 = time.time()
    while not ck.exists() and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert ck.exists()
    rc, err = _run_here(b, "--set", "num_epochs=3")
    assert rc == 0 and "resumed from step" in err
    pa, pb = _final_params(a), _final_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_bad_input_clear_errors(tmp_path):
    rc, err = _run_here(tmp_path / "empty")
    assert rc == 2 and "no training data" in err
    rc, err = _run_here(tmp_path / "x", "--set", "num_feature_layers=9")
    assert rc == 2 and "cannot tap 9" in err
    rc, err = _run_here(tmp_path / "x", "--set", "no_such=1")
    assert rc == 2 and "no such setting" in err
    rc, err = _run_here(tmp_path / "x", "--config", os.path.join(ROOT, "configs", "nope.py"))
    assert rc == 2 and "no config file" in err
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file instead
        ro = tmp_path / "file"
        ro.write_text("x")
        ro = ro / "sub"
    rc, err = _run_here(ro)
    assert rc == 2 and "not writable" in err


def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(tiny_data, tmp_path):
    _copy_data(tiny_data, tmp_path)
    rc, err = _run_here(tmp_path, "--set", "num_epochs=2")  # 14 steps: checkpoints at 10 and 14
    assert rc == 0
    rc, err = _run_here(tmp_path, "--set", "num_epochs=6", "--set", "learning_rate=1e30")
    assert rc == 2
    assert "loss is nan at step" in err.lower() and "last good checkpoint (step 14)" in err
    assert (tmp_path / "ckpt" / "14").exists()


@pytest.mark.parametrize("preset", ["qwen3_8b_tpu", "llama31_8b_tpu"])
def test_tpu_presets_size_with_eval_shape(preset, capsys):
    from train.dry_run import main

    assert main(["--config", os.path.join(ROOT, "configs", f"{preset}.py"), "--mesh", "1,16,4"]) == 0
    out = capsys.readouterr().out
    assert "64 devices" in out and out.count("GiB per device") == 4
    # 8B target in bf16: 15–16 GiB in all, 1/64 of its sharded tensors per device.
    total = float(out.split("target (frozen)")[1].split("GiB")[0])
    assert 14.0 < total < 17.0


def test_the_target_runs_with_the_configured_numerics():
    """`target_dtype` (the TPU presets: bfloat16) and `target_weight_dtype` /
    `target_weight_terms` (`--set target_weight_dtype=bfloat16 --set target_weight_terms=1`:
    regeneration and the feature cache at bf16 precision on a CPU) reach the target every stage
    loads; the default is the float32 model."""
    from train.config import TrainConfig
    from train.stages import load_target

    cfg = TrainConfig(target="tiny-random")
    assert load_target(cfg).cfg.weight_dtype is None
    fast = load_target(cfg.with_overrides(["target_weight_dtype=bfloat16", "target_weight_terms=1"]))
    assert (fast.cfg.weight_dtype, fast.cfg.weight_terms) == ("bfloat16", 1)
    assert load_target(cfg.with_overrides(["target_dtype=bfloat16"])).cfg.dtype == "bfloat16"
    with pytest.raises(ValueError, match="weight_terms"):
        load_target(cfg.with_overrides(["target_weight_dtype=bfloat16", "target_weight_terms=5"]))
