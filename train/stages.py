"""The stages of `python -m train.main` (see train/main.py). Each is resumable."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax as ds
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.sharding import TRAINING_RULES, shard_state
from dspark_jax.training import batches, distributed, records
from dspark_jax.training import train_step as ts
from dspark_jax.training.prompts import is_heldout, iter_prompts, sharegpt_pairs
from dspark_jax.training.regenerate import regenerate, write_original_answers
from train.config import TrainConfig
from train.progress import MetricsLog, Progress


def load_target(cfg: TrainConfig):
    if cfg.target == "tiny-random":  # tests and smoke runs: no tokenizer, token-id prompts
        tiny = ds.ModelConfig.tiny(dtype=cfg.target_dtype, weight_dtype=cfg.target_weight_dtype,
                                   weight_terms=cfg.target_weight_terms)
        return ds.Target.random(tiny, seed=cfg.seed)
    return ds.load_target(cfg.target, dtype=cfg.target_dtype, weight_dtype=cfg.target_weight_dtype,
                          weight_terms=cfg.target_weight_terms)


def _source_spec(spec: str) -> tuple[str, int, int | None]:
    """'name' → (name, 0, None): every prompt; 'name@N' → (name, 0, N): a seeded sample of N;
    'name@A:B' → (name, A, B): items A..B-1 of the same seeded order, so slices of one source
    under one seed never overlap (a later run can take the prompts an earlier one did not)."""
    src, at, cap = spec.rpartition("@") if "@" in spec else (spec, "", "")
    if not at:
        return spec, 0, None
    a, colon, b = cap.partition(":")
    if not colon:
        a, b = "0", a
    if not (a.isdigit() and b.isdigit()) or int(b) <= int(a):
        raise ValueError(f"prompt source {spec!r}: expected 'name@N' or 'name@A:B' with integers 0 <= A < B")
    return src, int(a), int(b)


def _prompts(cfg: TrainConfig, target):
    """(train prompts, held-out prompts); 'synthetic' gives token-id prompts for tiny targets."""
    rng = np.random.default_rng(cfg.seed)
    allp: list = []
    for spec in cfg.prompt_sources:
        src, start, stop = _source_spec(spec)
        if src == "synthetic":
            V = target.cfg.vocab_size
            got = [[1] + rng.integers(3, V, int(rng.integers(4, 12))).tolist() for _ in range(cfg.max_prompts)]
        else:
            got = list(iter_prompts(src))
        if stop is not None:  # a seeded sample of this source only
            random.Random(f"{cfg.seed}:{src}").shuffle(got)
            got = got[start:stop]
        allp += got
    if not allp:
        raise ValueError(f"the prompt sources {cfg.prompt_sources} hold no prompts")
    random.Random(cfg.seed).shuffle(allp)
    key = (lambda p: p if isinstance(p[0], dict) else [{"role": "ids", "content": str(p)}])
    held = [p for p in allp if is_heldout(key(p), cfg.heldout_fraction)][: cfg.max_heldout_prompts]
    train = [p for p in allp if not is_heldout(key(p), cfg.heldout_fraction)][: cfg.max_prompts]
    return train, held


def prompts(cfg: TrainConfig, workdir: str) -> None:
    """The config's prompts (training, then held-out) as one JSONL file, `workdir/prompts.jsonl`,
    without those over `max_prompt_tokens`: a machine without the prompt sources' packages (an
    accelerator host, say) regenerates from it with `--set prompt_sources=("…/prompts.jsonl",)`,
    which splits it the same way (the held-out split is a hash of each prompt)."""
    from dspark_jax.decoding.generate import encode_prompt

    target = load_target(cfg)
    train, held = _prompts(cfg, target)
    if any(not isinstance(p[0], dict) for p in train + held):
        raise ValueError("the prompts stage writes chat prompts; 'synthetic' token-id prompts have no text")
    path = os.path.join(workdir, "prompts.jsonl")
    kept = 0
    with open(path + ".tmp", "w") as f:
        for p in train + held:
            if len(encode_prompt(target, p)) <= cfg.max_prompt_tokens:
                f.write(json.dumps({"messages": p}) + "\n")
                kept += 1
    os.replace(path + ".tmp", path)
    print(f"[prompts] {kept} of {len(train) + len(held)} prompts ({len(held)} held out) fit "
          f"{cfg.max_prompt_tokens} tokens: {path}", file=sys.stderr)


def data(cfg: TrainConfig, workdir: str) -> None:
    target = load_target(cfg)
    train, held = _prompts(cfg, target)
    kw = dict(batch_size=cfg.regen_batch_size, max_prompt_tokens=cfg.max_prompt_tokens,
              max_new_tokens=cfg.regen_max_new_tokens, temperature=cfg.regen_temperature,
              top_p=cfg.regen_top_p, top_k=cfg.regen_top_k, seed=cfg.seed)
    regenerate(target, held, os.path.join(workdir, "data", "heldout"), **kw)
    regenerate(target, train, os.path.join(workdir, "data", "train"), max_batches=cfg.max_regen_batches,
               max_seconds=cfg.max_regen_seconds, **kw)
    if cfg.original_answers:
        rng = np.random.default_rng(cfg.seed + 1)
        pairs = [([{"role": "user", "content": q}], a) for q, a in sharegpt_pairs()]
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
        held_key = [p for p, _ in pairs]
        pairs = [pr for pr, k in zip(pairs, held_key) if not is_heldout(k, cfg.heldout_fraction)]
        n = write_original_answers(target, pairs[: cfg.original_answers], os.path.join(workdir, "data", "train"),
                                   max_prompt_tokens=cfg.max_prompt_tokens,
                                   max_answer_tokens=cfg.regen_max_new_tokens)
        print(f"[data] original answers: {n}", file=sys.stderr)
    counts = records.token_counts(os.path.join(workdir, "data", "train"), target.cfg.vocab_size)
    np.save(os.path.join(workdir, "data", "token_counts.npy"), counts)
    print(f"[data] {int(counts.sum())} supervised tokens, {int((counts > 0).sum())} distinct", file=sys.stderr)


def drafter_config(cfg: TrainConfig, target) -> ds.DrafterConfig:
    V = target.cfg.vocab_size
    dv = cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < V else 0
    return ds.DrafterConfig.for_target(
        target.cfg, num_feature_layers=cfg.num_feature_layers, block_size=cfg.block_size,
        num_layers=cfg.num_draft_layers, markov_rank=cfg.markov_rank, head_type=cfg.head_type,
        draft_vocab_size=dv, loss_decay=cfg.loss_decay, dtype="float32")


def _init_drafter(cfg: TrainConfig, dcfg: ds.DrafterConfig, workdir: str) -> DSparkDrafter:
    model = DSparkDrafter(dcfg, rngs=nnx.Rngs(cfg.seed))
    if dcfg.rank:
        # Start from the parallel (DFlash) drafter: the sequential bias begins at zero.
        model.head.w2.set_value(jnp.zeros_like(model.head.w2[...]))
    if dcfg.draft_vocab_size:
        model.draft_ids.set_value(jnp.asarray(_draft_ids(cfg, dcfg, workdir)))
    return model


def _draft_ids(cfg: TrainConfig, dcfg: ds.DrafterConfig, workdir: str) -> np.ndarray:
    """This workdir's draft vocabulary: the most frequent supervised tokens of its data, fixed
    in `workdir/draft_ids.npy` the first time it is needed (later stages read the same file)."""
    path = os.path.join(workdir, "draft_ids.npy")
    if os.path.exists(path):
        ids = np.load(path)
        if ids.shape != (dcfg.draft_vocab_size,):
            raise ValueError(f"{path} holds {ids.shape[0]} draft tokens; the config asks for {dcfg.draft_vocab_size}")
        return ids
    ids = _vocabulary_of(workdir, dcfg.draft_vocab_size)
    tmp = path + ".tmp.npy"
    np.save(tmp, ids)
    os.replace(tmp, path)
    return ids


def _vocabulary_of(workdir: str, size: int) -> np.ndarray:
    path = os.path.join(workdir, "draft_ids.npy")
    if os.path.exists(path):
        return np.load(path)
    counts = os.path.join(workdir, "data", "token_counts.npy")
    if not os.path.exists(counts):
        raise FileNotFoundError(f"{counts} is missing: run the data stage first")
    return records.draft_vocabulary(np.load(counts), size)


def remap_proposal_columns(params, old_ids: np.ndarray, new_ids: np.ndarray):
    """Warm start across draft vocabularies: the sequential head's W2 [R, P] has one column per
    draft token; a token kept from the old vocabulary keeps its column, a new one starts at zero
    (no transition bias, as a fresh drafter starts). Nothing else depends on the vocabulary."""
    where = {int(t): i for i, t in enumerate(np.asarray(old_ids))}
    src = np.array([where.get(int(t), -1) for t in np.asarray(new_ids)])

    def fix(path, x):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if "head" in names and "w2" in names:
            a = np.asarray(x)
            out = np.where(src[None, :] >= 0, a[:, np.maximum(src, 0)], 0).astype(a.dtype)
            return jax.device_put(out, x.sharding) if isinstance(x, jax.Array) else out
        return x

    return jax.tree_util.tree_map_with_path(fix, params), int((src >= 0).sum())


def _warm_start(cfg: TrainConfig, dcfg: ds.DrafterConfig, workdir: str, state):
    """The parameters `init_from` names, shaped like `state.params`: another workdir's latest
    checkpoint, or an exported drafter (a directory with config.json + model.safetensors, or a
    shipped drafter's name, cast back to the training dtype). A different draft vocabulary keeps
    the kept tokens' head columns (`remap_proposal_columns`)."""
    import orbax.checkpoint as ocp

    from dspark_jax.io import drafter_io

    src_dir = cfg.init_from
    if os.path.isdir(os.path.join(src_dir, "ckpt")):
        src = ocp.CheckpointManager(os.path.abspath(os.path.join(src_dir, "ckpt")))
        if src.latest_step() is None:
            raise FileNotFoundError(f"init_from={src_dir!r} holds no checkpoint")
        src_step = src.latest_step()
        restored = src.restore(src_step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state))))
        src.close()
        params, what = restored["state"].params, f"step {src_step}"
        old_ids = _vocabulary_of(src_dir, dcfg.draft_vocab_size) if dcfg.draft_vocab_size else None
    else:
        path = drafter_io.resolve_drafter_path(src_dir)
        kind, _ = drafter_io.inspect_drafter(path)  # raises a clear error for anything else
        if kind != "ours":
            raise ValueError(f"init_from={src_dir!r} is a {kind} checkpoint; warm starts read this "
                             "library's exports or training workdirs")
        tensors = drafter_io.read_drafter_tensors(path)
        old_ids = tensors.pop("draft_ids", None)
        flat = []
        for p, leaf in nnx.to_flat_state(state.params):
            name = drafter_io.flat_name(p)
            if name not in tensors:
                raise ValueError(f"init_from={src_dir!r} has no tensor {name!r}: trained with another config?")
            a = np.asarray(tensors[name], np.float32)
            want = leaf.get_value() if hasattr(leaf, "get_value") else leaf
            if a.shape != want.shape:
                raise ValueError(f"init_from={src_dir!r}: {name!r} has shape {a.shape}, this config's {want.shape}")
            flat.append((p, leaf.replace(jax.device_put(a.astype(want.dtype), want.sharding))))
        params, what = nnx.from_flat_state(flat), "export"
    if dcfg.draft_vocab_size and dcfg.rank and old_ids is not None:
        new_ids = _draft_ids(cfg, dcfg, workdir)
        if not np.array_equal(np.asarray(old_ids), new_ids):
            params, kept = remap_proposal_columns(params, np.asarray(old_ids), new_ids)
            print(f"[train] draft vocabulary: {kept} of {len(new_ids)} tokens kept their head columns "
                  f"from {src_dir}", file=sys.stderr)
    print(f"[train] parameters from {src_dir} ({what}), fresh optimizer", file=sys.stderr)
    return params


class _FeatureCache:
    """Offline mode: the target's tapped features and last hidden state per sequence (bf16
    memmaps), computed once and reused every epoch. Resumable: `done.json` counts finished rows."""

    def __init__(self, workdir, n, seq_len, feat_dim, hidden):
        import ml_dtypes

        self.dir = os.path.join(workdir, "features")
        os.makedirs(self.dir, exist_ok=True)
        self.done_path = os.path.join(self.dir, "done.json")
        meta = {"n": n, "seq_len": seq_len, "feat_dim": feat_dim}
        old = json.load(open(self.done_path)) if os.path.exists(self.done_path) else None
        # A cache for another dataset or shape is rebuilt, never reused.
        fresh = old is None or {k: old.get(k) for k in meta} != meta
        mode = "w+" if fresh else "r+"
        self.meta = meta
        bf16 = ml_dtypes.bfloat16
        self.feats = np.memmap(os.path.join(self.dir, "feats.bin"), bf16, mode, shape=(n, seq_len, feat_dim))
        self.last = np.memmap(os.path.join(self.dir, "last.bin"), bf16, mode, shape=(n, seq_len, hidden))
        self.done = 0 if fresh else old["rows"]
        self.n = n

    def fill(self, target, examples, lengths, feature_layers, chunk, bucket=128):
        """Runs the target over every sequence, shortest first, each chunk padded only to its
        longest member (rounded up to `bucket`): padding to the full length wasted ~40%."""
        order = np.argsort(np.asarray(lengths), kind="stable")
        prog = Progress("features", self.n, unit="seq")
        prog.update(self.done)
        while self.done < self.n:
            hi = min(self.n, self.done + chunk)
            rows = order[self.done:hi]
            width = min(self.feats.shape[1], -(-max(int(lengths[i]) for i in rows) // bucket) * bucket)
            tok = np.stack([examples[i][:width] for i in rows])
            pad = chunk - tok.shape[0]
            tok = np.concatenate([tok, np.zeros((pad, tok.shape[1]), tok.dtype)]) if pad else tok
            f, last = ts.compute_target_outputs(target.graphdef, target.state, jnp.asarray(tok),
                                                feature_layers=feature_layers)
            # Positions past a sequence's end are never read (no anchor reaches them), but a
            # row is written whole so that a reused file never mixes two datasets.
            f, last = np.asarray(f[: len(rows)]), np.asarray(last[: len(rows)])
            for j, i in enumerate(rows):
                self.feats[i] = 0
                self.last[i] = 0
                self.feats[i, :width] = f[j]
                self.last[i, :width] = last[j]
            self.feats.flush()
            self.last.flush()
            self.done = hi
            with open(self.done_path, "w") as fh:
                json.dump({"rows": hi, **self.meta}, fh)
            prog.update(hi)

    def get(self, idx):
        return np.asarray(self.feats[idx]), np.asarray(self.last[idx])


def train(cfg: TrainConfig, workdir: str) -> None:
    import orbax.checkpoint as ocp

    target = load_target(cfg)
    dcfg = drafter_config(cfg, target)
    dcfg.check_compatible(target.cfg)
    data_dir = os.path.join(workdir, "data", "train")
    n_seq = len(records.data_source(data_dir))
    steps_per_epoch = n_seq // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{n_seq} training sequences is fewer than one batch of {cfg.batch_size}")
    total = steps_per_epoch * cfg.num_epochs
    if cfg.max_steps > 0:
        total = min(total, cfg.max_steps)
    opt = ts.OptimConfig(cfg.learning_rate, cfg.warmup_fraction, total, cfg.weight_decay, cfg.clip_norm)
    tx = opt.optimizer()
    mesh = distributed.training_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
    if mesh is not None:
        target.state = shard_state(target.state, mesh, TRAINING_RULES)
        print(f"[train] mesh {dict(mesh.shape)} over {jax.device_count()} devices, "
              f"{jax.process_count()} process(es)", file=sys.stderr)
    dgraph, state, rest = ts.init_sharded(lambda: _init_drafter(cfg, dcfg, workdir), tx, mesh)
    pipeline = batches.dataset(data_dir, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                               num_anchors=cfg.num_anchors, block_size=cfg.block_size, seed=cfg.seed,
                               num_epochs=cfg.num_epochs)
    it = iter(pipeline)
    mgr = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "ckpt")),
                                options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints))
    if mgr.latest_step() is None and cfg.init_from:
        state = state.replace(params=_warm_start(cfg, dcfg, workdir, state))
    if mgr.latest_step() is not None:
        step = mgr.latest_step()
        restored = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state)),
            data=ocp.args.JsonRestore()))
        state = restored["state"]
        it.set_state(restored["data"])
        print(f"[train] resumed from step {step}", file=sys.stderr)

    cache = None
    if cfg.feature_cache:
        examples, lengths = {}, []
        src = records.data_source(data_dir)
        for i in range(n_seq):
            t, _ = records.decode(src[i])
            row = np.zeros(cfg.seq_len, np.int32)
            row[: min(t.size, cfg.seq_len)] = t[: cfg.seq_len]
            examples[i] = row
            lengths.append(min(t.size, cfg.seq_len))
        L = len(dcfg.target_layer_ids)
        cache = _FeatureCache(workdir, n_seq, cfg.seq_len, L * target.cfg.hidden_size, target.cfg.hidden_size)
        cache.fill(target, examples, lengths, dcfg.target_layer_ids, cfg.batch_size)

    def save(step):
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=ocp.args.JsonSave(it.get_state())), force=True)
        mgr.wait_until_finished()

    stop = {"flag": False}
    old = signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    log = MetricsLog(os.path.join(workdir, "metrics.jsonl"))
    prog = Progress("train", total, unit="step")
    step = int(state.step)
    prog.update(step)
    kw = dict(tx=tx, dgraph=dgraph, tgraph=target.graphdef, loss=cfg.loss())
    t_last, tok_since = time.perf_counter(), 0
    t_start = t_last
    try:
        while step < total:
            batch = next(it)
            dev = {k: distributed.global_array(np.asarray(batch[k]), mesh) for k in ("tokens", "anchors", "block_mask")}
            if cache is not None:
                feats, last = (distributed.global_array(a, mesh) for a in cache.get(np.asarray(batch["index"])))
                new, m = ts.train_step_cached(state, rest, target.state, dev, feats, last, **kw)
            else:
                new, m = ts.train_step_online(state, rest, target.state, dev,
                                              feature_layers=dcfg.target_layer_ids, **kw)
            loss = float(m["loss"])
            if not np.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at step {step + 1}; stopping. The last good checkpoint "
                    f"(step {mgr.latest_step()}) is kept in {workdir}/ckpt")
            state, step = new, step + 1
            tok_since += int(np.asarray(batch["block_mask"]).sum())
            if step % cfg.log_every == 0 or step == total:
                now = time.perf_counter()
                rec = {"step": step, "epoch": (step - 1) // steps_per_epoch,
                       **{k: np.asarray(v).tolist() for k, v in m.items()},
                       "supervised_tokens_per_s": tok_since / max(now - t_last, 1e-9),
                       "wall_s": round(now - t_start, 3)}
                log.write(rec)
                t_last, tok_since = now, 0
            prog.update(step, loss=loss, tau=float(m["expected_tau"]))
            timed_out = cfg.max_train_seconds > 0 and time.perf_counter() - t_start > cfg.max_train_seconds
            if step % cfg.checkpoint_every == 0 or step == total or stop["flag"] or timed_out:
                save(step)
            if timed_out and not stop["flag"]:
                print(f"[train] max_train_seconds={cfg.max_train_seconds:.0f} spent: saved step {step} of {total}; "
                      "rerun the same command to resume", file=sys.stderr)
                return
            if stop["flag"]:
                print(f"[train] SIGTERM: saved step {step}; rerun the same command to resume", file=sys.stderr)
                raise SystemExit(143)
    finally:
        signal.signal(signal.SIGTERM, old)
        mgr.close()


def restore_params(cfg: TrainConfig, workdir: str, target):
    """The trained Drafter from the workdir's latest checkpoint; a workdir without one, whose
    `init_from` names an exported drafter (one trained on another machine and brought back as
    its export, say), gives that drafter, for the calibrate and export stages."""
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "ckpt")))
    step = mgr.latest_step()
    if step is None and cfg.init_from and not os.path.isdir(os.path.join(cfg.init_from, "ckpt")):
        from dspark_jax.io import drafter_io

        mgr.close()
        drafter = drafter_io.load_drafter(cfg.init_from)
        drafter.cfg.check_compatible(target.cfg)
        print(f"[{workdir}] no checkpoint: the exported drafter init_from={cfg.init_from!r}", file=sys.stderr)
        return drafter
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}/ckpt: run the train stage first")
    dcfg = drafter_config(cfg, target)
    model = _init_drafter(cfg, dcfg, workdir)
    dgraph, params, rest = ts.split_drafter(model)
    tx = ts.OptimConfig().optimizer()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, ts.init_state(params, tx))
    restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    mgr.close()
    _, state = nnx.split(nnx.merge(dgraph, restored["state"].params, rest))
    return ds.Drafter(dcfg, dgraph, state)


def calibrate(cfg: TrainConfig, workdir: str) -> None:
    from dspark_jax.training import calibration, sts

    target = load_target(cfg)
    drafter = restore_params(cfg, workdir, target).bind(target)
    held = records.read_all(os.path.join(workdir, "data", "heldout"))
    prompts = [t[m == 0].tolist() for t, m in held][: cfg.calib_prompts]
    if not prompts:
        raise ValueError("no held-out prompts to calibrate on: run the data stage first")
    # Two fits of the same confidences: at temperature 1 (the confidence head's label is the
    # acceptance probability under sampling, 1 − TV) and at temperature 0 (survival is an argmax
    # match); the drafter uses the fit that matches each request.
    out = os.path.join(workdir, "calibration")
    os.makedirs(out, exist_ok=True)
    reps = {}
    for name, temp in (("sampled", 1.0), ("greedy", 0.0)):
        sp = ds.SamplingParams(temperature=temp, max_new_tokens=cfg.calib_max_new_tokens, seed=cfg.seed)
        conf, acc, ver = calibration.collect_cycles(target, drafter, prompts,
                                                    max_new_tokens=cfg.calib_max_new_tokens, sampling=sp)
        png = "reliability.png" if name == "sampled" else "reliability_greedy.png"
        reps[name] = sts.fit_and_report(conf, acc, ver, drafter.cfg.block_size, png_path=os.path.join(out, png))
        print(f"[calibrate] {name} (T = {temp}): temperatures {reps[name]['temperatures']}", file=sys.stderr)
    rep = {**reps["sampled"], "greedy": reps["greedy"]}
    with open(os.path.join(out, "sts.json"), "w") as f:
        json.dump(rep, f, indent=1, default=float)


def export(cfg: TrainConfig, workdir: str) -> None:
    target = load_target(cfg)
    drafter = restore_params(cfg, workdir, target)
    sts_json = os.path.join(workdir, "calibration", "sts.json")
    if os.path.exists(sts_json):
        from dspark_jax.training.calibration import with_temperatures

        rep = json.load(open(sts_json))
        greedy = rep.get("greedy", {})
        drafter = with_temperatures(drafter, rep["temperatures"], greedy.get("temperatures"),
                                    survival=rep.get("survival_rate_per_position"),
                                    survival_greedy=greedy.get("survival_rate_per_position"))
    out = os.path.join(workdir, "export")
    ds.save_drafter(drafter, out, dtype="bfloat16")
    print(f"[export] wrote {out}", file=sys.stderr)
