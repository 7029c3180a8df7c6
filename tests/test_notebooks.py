"""Every notebook runs top to bottom without an error.

The heavy cells read the model from MSGRPO_NOTEBOOK_MODEL; here it is the tiny random model, so the whole
file takes a minute or two on 2 CPU cores. Each notebook is executed as an in-memory copy: the committed
files, with their outputs from the real model, are never rewritten.
"""

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    # One extra cell at the end reports which interpreter ran the notebook: it must be this venv's.
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.prefix)"))
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute(env={**os.environ, "MSGRPO_NOTEBOOK_MODEL": "tiny"})
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.prefix


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_committed_notebook_holds_its_outputs_and_no_errors(path):
    """The committed notebooks read well on a web page: executed, in order, no tracebacks, not huge."""
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "execute it top to bottom"
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert path.stat().st_size < 1_000_000, "keep outputs small"
