"""Every notebook runs top to bottom without an error, and the committed outputs that depend on
nothing but the code still match what the code prints.

The heavy cells read the model from MSGRPO_NOTEBOOK_MODEL; here it is the tiny random model, so the
whole file takes a minute or two on 2 CPU cores. Each notebook is executed as an in-memory copy: the
committed files, with their outputs from the real model, are never rewritten.
"""

import difflib
import functools
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Notebooks that use no model and no clock: the same code prints the same text every time, so their
# committed outputs must be what the code prints now (01: the games' text; 05: the result tables).
DETERMINISTIC = ["01_text_games.ipynb", "05_baselines_and_generalisation.ipynb"]
REPORT_PREFIX = "import sys; print(sys.prefix)"


@functools.cache
def executed(path):
    """The notebook at `path`, run top to bottom in memory, with one extra cell at the end that
    reports which interpreter ran it."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_PREFIX))
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute(env={**os.environ, "MSGRPO_NOTEBOOK_MODEL": "tiny"})
    return nb


def printed_text(cell):
    """What a code cell printed or displayed as text, in order; images are left out."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/markdown") or output.data.get("text/plain", ""))
    return "".join(parts)


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3
    assert all((NOTEBOOK_DIR / name).exists() for name in DETERMINISTIC)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs_top_to_bottom(path):
    nb = executed(path)
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.prefix  # this venv's interpreter


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_committed_outputs_are_what_the_code_prints(name):
    """A committed output that the code no longer prints (a game's text changed, a result file was
    replaced) fails here: execute the notebook again, in place (the command is in the message)."""
    committed = [cell for cell in nbformat.read(NOTEBOOK_DIR / name, as_version=4).cells
                 if cell.cell_type == "code"]
    now = [cell for cell in executed(NOTEBOOK_DIR / name).cells if cell.cell_type == "code"][:-1]
    assert [cell.source for cell in committed] == [cell.source for cell in now]
    rerun = f"cd notebooks && jupyter nbconvert --to notebook --execute --inplace {name}"
    for number, (old, new) in enumerate(zip(committed, now), start=1):
        was, is_now = printed_text(old), printed_text(new)
        if was != is_now:
            diff = difflib.unified_diff(was.splitlines(), is_now.splitlines(), "committed",
                                        "printed now", lineterm="", n=1)
            pytest.fail(f"{name}, code cell {number}: the committed output is not what the code "
                        f"prints now; run: {rerun}\n" + "\n".join(diff))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_committed_notebook_holds_its_outputs_and_no_errors(path):
    """The committed notebooks read well on a web page: executed in order, no tracebacks, small."""
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    in_order = list(range(1, len(code) + 1))
    assert [cell.execution_count for cell in code] == in_order, "execute it top to bottom"
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert path.stat().st_size < 1_000_000, "keep outputs small"
