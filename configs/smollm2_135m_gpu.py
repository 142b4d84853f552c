"""SmolLM2-135M-Instruct on one accelerator (a GPU or a TPU chip): the CPU preset's recipe
(configs/smollm2_135m.py) at an accelerator's batch size, with the target run inside every
train step (no feature cache: the features of 20k sequences would not fit a disk, and the
target's forward costs a fraction of the step there).

    python -m train.main --config configs/smollm2_135m_gpu.py --workdir runs/gpu

Data: greedy answers (192 new tokens) to the prompts the CPU phases did not use — ShareGPT
beyond the first 1,700, math beyond the first 900, and the code functions of `pystdlib`,
`pystdlib-more` and `pypackages` under other asks (`pytests`: unit tests; `pycode-alt`: the
implementation asks rotated), regenerated in batches of 256; steps of 64 sequences × 128
anchors. `max_regen_seconds` / `max_train_seconds` time-box the two stages on a borrowed
machine (both keep what they finished; rerunning resumes).
"""

from configs.smollm2_135m import get_config as cpu_config
from train.config import TrainConfig


def get_config() -> TrainConfig:
    return cpu_config().replace(
        prompt_sources=("sharegpt@1700:11137", "mathgen@900:4000", "pytests", "pycode-alt"), max_prompts=100_000,
        regen_batch_size=256, regen_max_new_tokens=192, batch_size=64, num_anchors=128, num_epochs=50,
        learning_rate=6e-4, feature_cache=False, checkpoint_every=500, log_every=20,
    )
