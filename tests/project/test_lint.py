"""ruff (configured in pyproject.toml) is part of the test suite, so CI enforces it."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_clean():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.fail("ruff is not installed; it is part of the [test] extra")
    r = subprocess.run([ruff, "check", "dspark_jax", "serve", "benchmarks", "configs", "train", "tests"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
