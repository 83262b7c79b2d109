"""The research notebooks execute end to end with a real notebook runner (nbclient), the 8B one
in small mode, failing on any cell error; and what is committed is the output of a clean run."""

import nbformat
import pytest

from experiments import run_notebooks

# Pictures each notebook must draw: methods, the tree, margins, the cost curve.
FIGURES = {"quickstart": 4, "qwen3_8b": 4}


def _outputs(nb, kind):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
          if o.output_type == kind]


def _figures(nb):
  return [o for o in _outputs(nb, "display_data") if "image/png" in o.get("data", {})]


@pytest.mark.parametrize("name", list(run_notebooks.NOTEBOOKS))
def test_notebook_executes_without_errors(name):
  nb, seconds = run_notebooks.execute(name)  # raises CellExecutionError on a failing cell
  assert not _outputs(nb, "error")
  assert len(_figures(nb)) >= FIGURES[name]
  print(f"{name}: {seconds:.0f} s")


@pytest.mark.parametrize("name", list(run_notebooks.NOTEBOOKS))
def test_committed_notebook_holds_a_clean_run(name):
  """Every code cell ran, in order, without an error, and the figures are stored (so the
  notebook renders on GitHub with its results)."""
  nb = nbformat.read(run_notebooks.NOTEBOOKS[name], as_version=4)
  cells = [c for c in nb.cells if c.cell_type == "code"]
  assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
  assert not _outputs(nb, "error")
  assert len(_figures(nb)) >= FIGURES[name]
  streams = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
  assert "/root/" not in streams and "/home/" not in streams  # no machine paths stored
