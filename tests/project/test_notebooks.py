"""Every notebook in notebooks/ runs headlessly, top to bottom, with small settings
(DSPARK_NOTEBOOK_SMALL=1), in a fresh kernel on CPU."""

import pathlib

import pytest

pytestmark = pytest.mark.slow  # see conftest.py, "test tiers"

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # The kernel inherits this process's environment.
    monkeypatch.setenv("DSPARK_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    if path.name in ("quickstart.ipynb", "train_drafter.ipynb"):
        assert "identical to autoregressive: True" in text
