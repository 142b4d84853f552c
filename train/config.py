"""`TrainConfig`: every setting of `python -m train.main`, one frozen dataclass.

Presets live in `configs/*.py` (`get_config()` returns a TrainConfig); `--set key=value`
overrides any field from the command line (values parsed as Python literals).
"""

from __future__ import annotations

import ast
import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # Target and data.
    target: str = "smollm2-135m"  # embedded name, HF directory or .gguf path; "tiny-random" for tests
    # Named sources (prompts.iter_prompts: sharegpt, pystdlib, pystdlib-more, pypackages, pytests,
    # pycode-alt, pyexercises, mathgen, chatgen, humaneval) or JSONL paths; "name@N" takes a seeded sample of N
    # prompts of that source, "name@A:B" items A..B-1 of the same seeded order (disjoint from "name@A"
    # under the same seed).
    prompt_sources: tuple[str, ...] = ("sharegpt",)
    max_prompts: int = 4000
    heldout_fraction: float = 0.05
    max_heldout_prompts: int = 64
    max_prompt_tokens: int = 256
    # Regeneration (on-policy answers), DeepSpec's sampling recipe.
    regen_batch_size: int = 32
    regen_max_new_tokens: int = 256
    regen_temperature: float = 0.7
    regen_top_p: float = 0.8
    regen_top_k: int = 20
    max_regen_batches: int = 0  # stop regenerating after this many batches (0 = all prompts)
    max_regen_seconds: float = 0.0  # start no batch after this many seconds of the stage (0 = no limit)
    # Off-policy supplement: this many ShareGPT prompts with the dataset's own answers (no
    # regeneration cost; only ShareGPT has answers). 0 = on-policy data only.
    original_answers: int = 0
    # Drafter.
    block_size: int = 7
    num_draft_layers: int = 2
    num_feature_layers: int = 5
    head_type: str = "markov"  # markov | gated | rnn | none (DFlash baseline)
    markov_rank: int = 128
    draft_vocab_size: int = 8192  # 0 = full vocabulary
    loss_decay: float = 4.0  # λ
    # Loss mix (dspark_jax.training.losses.LossConfig): DeepSpec's DSpark mix is (0.1, 0.9, 1.0, 0)
    # with labels from the data; "target" labels are the target's argmax at each position.
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    alpha_kl: float = 0.0
    loss_labels: str = "data"  # data | target
    loss_target_over_proposal: bool = False  # the target's distribution over the draft vocabulary only
    # Optimisation.
    seq_len: int = 512
    num_anchors: int = 32
    batch_size: int = 8
    num_epochs: int = 4
    max_steps: int = 0  # cap on the total steps (0 = num_epochs full epochs); the LR schedule spans it
    # Wall-clock cap on this run of the train stage (0 = none): it saves a checkpoint and ends as
    # SIGTERM does (rerunning resumes). For time-boxed machines; size max_steps to fit it.
    max_train_seconds: float = 0.0
    learning_rate: float = 6e-4
    warmup_fraction: float = 0.04
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    # Warm start: the drafter's parameters from the latest checkpoint of this workdir, or from an
    # exported drafter (a directory, or a shipped drafter's name such as "smollm2-135m-dspark"),
    # with a fresh optimizer, schedule and data iterator, e.g. to fine-tune on new data.
    # "" = from scratch.
    init_from: str = ""
    feature_cache: bool = True  # offline mode: one target forward per sequence, reused every epoch
    # The target as the data, train and calibrate stages run it: in `target_dtype` ("bfloat16"
    # on TPU/GPU: half the memory of a frozen 8B target; float32 on CPU), weights stored as
    # `target_weight_dtype` ("bfloat16" under float32 activations), each activation multiplied
    # as `target_weight_terms` bf16 terms (ModelConfig.weight_terms; 1 = rounded to bf16, the
    # accelerators' convention — on a CPU with AVX512-BF16 about twice the float32 model's speed
    # for regeneration and the feature cache, at bf16's precision). None: the float32 model.
    target_dtype: str = "float32"
    target_weight_dtype: str | None = None
    target_weight_terms: int = 3
    seed: int = 0
    # Device mesh (data, fsdp, tensor); -1 = all devices the others leave. One device: no mesh.
    mesh_data: int = -1
    mesh_fsdp: int = 1
    mesh_tensor: int = 1
    # Checkpoints and logging.
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    log_every: int = 10
    # Calibration.
    calib_prompts: int = 32
    calib_max_new_tokens: int = 96

    def loss(self):
        from dspark_jax.training.losses import LossConfig

        return LossConfig(decay=self.loss_decay, alpha_ce=self.alpha_ce, alpha_tv=self.alpha_tv,
                          alpha_conf=self.alpha_conf, alpha_kl=self.alpha_kl, labels=self.loss_labels,
                          target_over_proposal=self.loss_target_over_proposal)

    def replace(self, **kw) -> TrainConfig:
        return dataclasses.replace(self, **kw)

    def with_overrides(self, items: list[str]) -> TrainConfig:
        """Applies `key=value` strings; the value is a Python literal (strings may be bare)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        kw = {}
        for item in items:
            if "=" not in item:
                raise ValueError(f"--set expects key=value, got {item!r}")
            k, v = item.split("=", 1)
            if k not in fields:
                raise ValueError(f"--set {k}: no such setting; known: {', '.join(sorted(fields))}")
            try:
                val = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                val = v
            cur = getattr(self, k)
            if isinstance(cur, tuple) and isinstance(val, str | list):
                val = tuple(val) if isinstance(val, list) else (val,)
            if isinstance(cur, bool) != isinstance(val, bool) or (
                    isinstance(cur, int | float) and not isinstance(val, int | float)):
                raise ValueError(f"--set {k}={v}: expected a value like {cur!r}")
            if isinstance(cur, float) and isinstance(val, int):
                val = float(val)
            kw[k] = val
        return self.replace(**kw)
