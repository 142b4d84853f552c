"""SmolLM2-135M-Instruct (the embedded CPU default) and a DSpark drafter sized for it.

Target: 30 layers, D = 576; the drafter taps layers round(1 + i·26/4) = (1, 8, 14, 20, 27),
γ = 7, 2 draft layers (the paper's 2-layer DSpark already beats 5-layer DFlash), Markov r = 256.
Generation on 2 CPU cores: ~18 tokens/s batch-1 greedy, 55 ms/token (BENCHMARKS.md; HF transformers: 101 ms).

    python -m serve.generate "Write a Python function that reverses a list"
"""

import dspark_jax as ds


def get_config() -> dict:
    target = ds.ModelConfig.smollm2_135m()
    drafter = ds.DrafterConfig.for_target(target, block_size=7, num_layers=2, markov_rank=256,
                                          head_type="markov", loss_decay=4.0)
    return {"target_name": "smollm2-135m", "target": target, "drafter": drafter}
