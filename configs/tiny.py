"""Tiny random target + drafter: unit tests and smoke runs of the whole training program.

    python -m train.main --config configs/tiny.py --workdir /tmp/tiny

Regenerates token-id prompts with a random 4-layer target, trains a 1-layer drafter
for a few epochs and exports it; about a minute on 2 CPU cores. The target is random,
so the numbers only show that the pipeline runs and learns (loss falls, τ rises).
"""

from train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        target="tiny-random", prompt_sources=("synthetic",), max_prompts=64, heldout_fraction=0.1,
        max_heldout_prompts=8, max_prompt_tokens=16, regen_batch_size=32, regen_max_new_tokens=24,
        regen_temperature=0.0, block_size=4, num_draft_layers=1, num_feature_layers=2, markov_rank=8,
        draft_vocab_size=96, seq_len=48, num_anchors=8, batch_size=8, num_epochs=6, learning_rate=3e-3,
        feature_cache=True, checkpoint_every=10, log_every=5, calib_prompts=8, calib_max_new_tokens=16,
    )
