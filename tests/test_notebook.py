"""The notebooks run headless on tiny configs."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(name: str, monkeypatch) -> tuple[str, list]:
  """Executes experiments/notebooks/<name> in tiny mode: (its printed text, its outputs)."""
  monkeypatch.setenv("LONGRL_NOTEBOOK_TINY", "1")
  path = os.path.join(ROOT, "experiments/notebooks", name)
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
  return "".join(o.get("text", "") for o in outputs if o.output_type == "stream"), outputs


@pytest.mark.slow
def test_quickstart_notebook_runs(monkeypatch):
  text, outputs = _run("quickstart.ipynb", monkeypatch)
  assert "sft_accuracy=" in text and "rl_accuracy=" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the inline plot


@pytest.mark.slow
def test_agentic_notebook_runs(monkeypatch):
  text, outputs = _run("agentic.ipynb", monkeypatch)
  last = text.strip().splitlines()[-1]
  assert all(f"{key}=" in last for key in ("sft_accuracy", "rl_accuracy", "sft_tool_calls_rate",
                                           "rl_tool_calls_rate")), last
  assert "[<result>" in text  # a demonstration's observation, shown out of the loss
  assert any("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.slow
def test_vision_notebook_runs(monkeypatch):
  text, outputs = _run("vision.ipynb", monkeypatch)
  last = text.strip().splitlines()[-1]
  assert all(f"rl_accuracy_{name}=" in last for name in ("rendered", "text", "scenes")), last
  assert "reward=" in text  # what the policy wrote about an image
  assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # the images, the curves


@pytest.mark.slow
def test_agent_notebook_runs(monkeypatch):
  text, outputs = _run("agent.ipynb", monkeypatch)
  last = text.strip().splitlines()[-1]
  assert all(f"{key}=" in last for key in ("before_success", "after_success",
                                           "before_tool_calls_rate", "after_tool_calls_rate"))
  assert "import openai" not in text and "def solve(" in text  # the agent's source, shown
  assert "drift {" in text  # one episode, call by call
  assert any("image/png" in o.get("data", {}) for o in outputs)
