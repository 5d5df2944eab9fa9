"""The quickstart notebook runs headless on a tiny config."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quickstart_notebook_runs(monkeypatch):
  monkeypatch.setenv("LONGRL_NOTEBOOK_TINY", "1")
  path = os.path.join(ROOT, "experiments/notebooks/quickstart.ipynb")
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "sft_accuracy=" in text and "rl_accuracy=" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the inline plot
