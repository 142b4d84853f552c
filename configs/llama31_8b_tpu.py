"""Llama-3.1-8B DSpark drafter on a TPU slice: DeepSpec's recipe (γ = 7, 5 draft layers, Markov
r = 256, full vocabulary, 0.1·CE + 0.9·TV + 1.0·BCE, λ = 4, AdamW 6e-4, 4% warmup, cosine,
bf16 target). Not run by this project (no TPU was available); sized with

    python -m train.dry_run --config configs/llama31_8b_tpu.py --mesh 1,16,4

For a real run set `--set target=/path/to/Llama-3.1-8B` (an HF directory) and launch one process
per host with DSPARK_COORDINATOR / DSPARK_NUM_PROCESSES / DSPARK_PROCESS_ID.
"""

from train.config import TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        target_dtype="bfloat16",
        target="llama-3.1-8b", prompt_sources=("sharegpt",), max_prompts=1_000_000, max_prompt_tokens=1024,
        regen_max_new_tokens=4096, block_size=7, num_draft_layers=5, num_feature_layers=5, head_type="markov",
        markov_rank=256, draft_vocab_size=0, seq_len=4096, num_anchors=512, batch_size=512, num_epochs=10,
        learning_rate=6e-4, feature_cache=False, mesh_data=-1, mesh_fsdp=16, mesh_tensor=4, checkpoint_every=500,
    )
