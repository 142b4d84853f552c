"""SmolLM2-135M-Instruct (the embedded CPU default): a DSpark drafter trained on this CPU.

    python -m train.main --config configs/smollm2_135m.py --workdir runs/smollm2

Target: 30 layers, D = 576, vocab 49,152. Drafter: γ = 7, 2 draft layers (the paper's
2-layer DSpark already beats 5-layer DFlash), taps layers (1, 8, 14, 20, 27), Markov head
r = 128, an 8,192-token draft vocabulary (the most frequent response tokens), trained from
W2 = 0 (i.e. starting as the parallel DFlash drafter) with DeepSpec's loss (0.1·CE + 0.9·TV
+ 1.0·BCE, λ = 4) on ShareGPT prompts answered by the target itself (T 0.7, top-p 0.8,
top-k 20). The feature cache (offline mode) runs the target once per sequence.

Time and result on 2 CPU cores: see BENCHMARKS.md ("Trained SmolLM2 drafter") for the
measured stage times, τ per dataset and the speedup; the shipped drafter
(`ds.load_drafter("smollm2-135m-dspark", target)`) is this preset's export.
For the DFlash baseline: `--set head_type=none`.
"""

from train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        target="smollm2-135m", prompt_sources=("sharegpt",), max_prompts=4000, max_heldout_prompts=64,
        max_prompt_tokens=256, regen_batch_size=32, regen_max_new_tokens=256,
        block_size=7, num_draft_layers=2, num_feature_layers=5, head_type="markov", markov_rank=128,
        draft_vocab_size=8192, seq_len=512, num_anchors=32, batch_size=8, num_epochs=4,
        learning_rate=6e-4, feature_cache=True, checkpoint_every=25, log_every=5,
        calib_prompts=32, calib_max_new_tokens=96,
    )
