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
    """transformers' own GGUF loading of the same file (the parity reference, ~40 s).
    Skips the test when the `parity` extra (torch, transformers) is not installed."""
    torch = pytest.importorskip("torch")
    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM

    # One intra-op thread: on 2 shared cores torch's 2-thread barriers stall whenever another
    # process holds a core (3x slower generation measured); 1 thread degrades gracefully.
    torch.set_num_threads(1)
    d, f = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    pytest.importorskip("torch")  # the parity extra comes as a whole
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    d, f = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


# --------------------------------------------------------------------------- tiny random models


def randomize_state(state, seed: int):
    """Redraws every parameter: norm scales 1 + 0.2·N, embeddings 0.3·N, the rest 0.1·N.

    `Target.random` draws 0.02·N and unit norms, which gives near-uniform attention and
    logits of std ~0.1; these scales give peaked attention and logits of std ~2-3, so a
    wrong position, mask or cache entry shows up far above float32 noise.
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    rng = np.random.default_rng(seed)
    out = []
    for path, var in nnx.to_flat_state(state):
        name = "/".join(str(p) for p in path)
        shape, dtype = var[...].shape, var[...].dtype
        if "norm" in name:
            v = 1.0 + 0.2 * rng.standard_normal(shape)
        elif "embed" in name or "lm_head" in name:
            v = 0.3 * rng.standard_normal(shape)
        else:
            v = 0.1 * rng.standard_normal(shape)
        out.append((path, var.replace(jnp.asarray(v, dtype))))
    return nnx.from_flat_state(out)


@pytest.fixture(scope="session")
def tiny_target():
    """Factory: a tiny random `Target` (ModelConfig.tiny) with informative weight scales."""
    import dspark_jax as ds

    def make(family: str = "llama", seed: int = 0, **cfg_kw):
        t = ds.Target.random(ds.ModelConfig.tiny(family, **cfg_kw), seed=seed)
        t.state = randomize_state(t.state, seed)
        return t

    return make


# --------------------------------------------------------------------------- test tiers

# `pytest -m "not slow"` is the inner-loop tier (tiny random models, pure functions, a few
# end-to-end decoding checks; ~1.5 minutes serial on 2 cores); the README's command runs everything. Slow, marked
# where it is defined (`pytestmark` for a module, `@pytest.mark.slow` for a test): a program
# in a subprocess (training, CLI, server, notebooks), a large statistical sample, a test that
# compiles many programs (over ~2 s on 2 cores). Whatever loads the real SmolLM2 or HF
# transformers is marked here, by its fixtures.
REAL_MODEL_FIXTURES = {"smollm2", "smollm2_path", "hf_smollm2", "hf_smollm2_tokenizer"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# --------------------------------------------------------------------------- JIT code mappings

# XLA:CPU loads every compiled kernel as its own few memory mappings (code, rodata, data) and
# keeps them while the executable lives in JAX's caches. A suite compiles thousands of
# programs in one process; past the kernel's `vm.max_map_count` (65,530 by default) the next
# mmap fails and the compiler segfaults. When a test leaves the process above half the
# limit, the compilation caches are dropped (the mappings go with them); later tests
# recompile what they need.


def _count_mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to bound
        return 0


def _mapping_budget() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return 32_000


_MAPPING_BUDGET = _mapping_budget()


@pytest.fixture(autouse=True)
def _bound_jit_code_mappings():
    yield
    if _count_mappings() > _MAPPING_BUDGET:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


# The training gates run in their own process (tests/training/test_gates_isolated.py): they train
# and compile the most programs of any module, and alone they cost what they cost.
collect_ignore = [] if os.environ.get("DSPARK_GATES_SUBPROCESS") else ["training/test_training_gates.py"]
