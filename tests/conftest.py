"""Shared test setup: CPU, float32, and the embedded SmolLM2 loaded once per session."""

import os

# Before jax is imported anywhere: tests run on CPU in fp32 (the reference numerics).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402



@pytest.fixture(scope="session")
def smollm2():
    """Our loader on the embedded SmolLM2-135M-Instruct GGUF (~5 s)."""
    import dspark_jax as ds

    return ds.load_target("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_path():
    from dspark_jax.io.loading import embedded_path

    return embedded_path("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own GGUF loading of the same file (the parity reference, ~40 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    d, f = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)
