"""Runs tests/training/test_training_gates.py in a fresh process (see tests/conftest.py: collect_ignore)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_training_gates_in_their_own_process():
    env = {**os.environ, "DSPARK_GATES_SUBPROCESS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/training/test_training_gates.py"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-2000:]
