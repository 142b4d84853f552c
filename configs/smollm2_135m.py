"""SmolLM2-135M-Instruct (the embedded CPU default): a DSpark drafter trained on this CPU.

    python -m train.main --config configs/smollm2_135m.py --workdir runs/smollm2

Target: 30 layers, D = 576, vocab 49,152. Drafter: γ = 7, 2 draft layers (the paper's
2-layer DSpark already beats 5-layer DFlash), taps layers (1, 8, 14, 20, 27), Markov head
r = 128, an 8,192-token draft vocabulary (the most frequent response tokens), trained from
W2 = 0 (i.e. starting as the parallel DFlash drafter).

The recipe is sized for 2 CPU cores (see BENCHMARKS.md, "Drafter recipe"):
- data: the target's own greedy answers (what T = 0 verification accepts) to a mix of what
  users ask — code (`pystdlib`: implement a standard-library function from its signature and
  docstring), math (`mathgen`: generated word problems) and chat (`sharegpt`) — never the
  evaluation prompts (a test checks the split); 128 new tokens per answer, regenerated in
  batches of 64 (~190 tok/s here in float32; ~270 with `--set target_weight_dtype=bfloat16
  --set target_weight_terms=1`, activations rounded to bf16, which also runs the feature cache
  1.9× faster; its float32 control gained exactly what the rounded features did, +0.05 held-out
  τ over one epoch: BENCHMARKS.md, "Stop 37" and "Stop 42"; opt-in all the same, since the
  shipped drafter was trained on float32 features);
- labels: the target's argmax at every predicted position (`loss_labels="target"`); loss CE +
  KL(p_t ‖ p_d) + confidence (DeepSpec's 0.1·CE + 0.9·TV learns far slower from scratch: its
  gradient scales with the draft's own probability), with the target's distribution over the
  draft vocabulary only (`loss_target_over_proposal`: its LM head over 8k instead of 49k
  tokens, the step's largest matmul);
- small steps, many of them: 4 sequences × 48 anchors per step (more updates per CPU-second
  than 8 × 96), lr 8e-4.
The feature cache (offline mode) runs the target once per sequence, then every step reads it.

The shipped drafter came from this project's program in eight phases (the exact commands are
in dspark_jax/drafters/smollm2-135m-dspark/README.md): ShareGPT answers, then greedy ShareGPT
answers, then — warm-started (`--set init_from=...`, the head's columns remapped to the new
draft vocabulary) — this preset's mixed greedy data, then new prompts of the same mix
(disjoint `name@A:B` slices and `pystdlib-more`), then code that uses third-party packages
(`pypackages`) with more chat and math, trained on every committed answer
(train/data/*.npz, `python -m train.tokens unpack`), then more steps on the same data, then
on one GPU (configs/smollm2_135m_gpu.py) more answers and 64-sequence steps, then here one epoch
over the answers the GPU left to this CPU. For the DFlash
baseline: `--set head_type=none`.
"""

from train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        target="smollm2-135m", prompt_sources=("pystdlib@700", "mathgen@400", "sharegpt@400"), max_prompts=4000,
        max_heldout_prompts=32, max_prompt_tokens=256, regen_batch_size=64, regen_max_new_tokens=128,
        regen_temperature=0.0, max_regen_batches=0, original_answers=0,
        block_size=7, num_draft_layers=2, num_feature_layers=5, head_type="markov", markov_rank=128,
        draft_vocab_size=8192, seq_len=512, num_anchors=48, batch_size=4, num_epochs=4,
        alpha_ce=1.0, alpha_tv=0.0, alpha_conf=1.0, alpha_kl=1.0, loss_labels="target",
        loss_target_over_proposal=True,
        learning_rate=8e-4, feature_cache=True, checkpoint_every=50, log_every=10,
        calib_prompts=32, calib_max_new_tokens=96,
    )
