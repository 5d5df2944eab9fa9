"""The layering of the tree: models < rollouts < rl < experiments. No module imports one of a
higher layer, not even inside a function (an import cycle waiting to happen)."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["models", "rollouts", "rl", "experiments"]


def _imported_packages(path: str) -> set[str]:
  tree = ast.parse(open(path).read(), path)
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return names


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_module_imports_a_higher_layer(layer):
  higher = set(LAYERS[LAYERS.index(layer) + 1:])
  wrong = []
  for folder, _, files in os.walk(os.path.join(ROOT, layer)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        wrong += [f"{os.path.relpath(path, ROOT)} imports {package}"
                  for package in sorted(_imported_packages(path) & higher)]
  assert not wrong, wrong
