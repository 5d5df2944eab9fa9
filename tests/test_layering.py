"""The house's floors, held by a test: models < rollouts < rl < experiments. A module imports
only from its own floor or below (an import inside a function counts: it runs up a floor just
the same), and no modules import each other round in a circle (docs/architecture.md). Read from
the source with ast, nothing imported."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ("models", "rollouts", "rl", "experiments")


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every module of the four packages."""
  found = {}
  for package in FLOORS:
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          found[dotted.removesuffix(".__init__")] = path
  return found


def _imports(path: str, modules: dict[str, str]) -> list[tuple[str, int]]:
  """(project module, line) of every import in `path`, at any depth: `from a.b import c`
  names a.b.c when that is a module, else a.b."""
  out = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] in FLOORS]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
        node.module.split(".")[0] in FLOORS:
      out += [(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
               else node.module, node.lineno) for a in node.names]
  return out


def test_no_module_imports_from_a_floor_above_its_own():
  modules = _modules()
  upward = [f"{os.path.relpath(path, ROOT)}:{line} imports {target}"
            for name, path in modules.items() for target, line in _imports(path, modules)
            if FLOORS.index(target.split(".")[0]) > FLOORS.index(name.split(".")[0])]
  assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
  """A package's __init__ importing its own modules is no circle of concepts."""
  modules = _modules()
  graph = {name: {t for t, _ in _imports(path, modules) if t in modules and t != name}
           for name, path in modules.items()}
  circles = []
  for start in graph:  # a path from start back to itself, if any
    seen, stack = set(), [(start, [start])]
    while stack:
      name, path = stack.pop()
      for nxt in graph[name]:
        if nxt == start:
          members = path
          if not all(m.startswith(min(members, key=len)) for m in members):
            circles.append(" -> ".join(path + [start]))
        elif nxt not in seen:
          seen.add(nxt)
          stack.append((nxt, path + [nxt]))
  assert not circles, "import circles:\n" + "\n".join(sorted(set(circles))[:10])


def test_the_walk_sees_the_floors_and_their_imports():
  """The two tests above read real imports: rl.trainer reaches models and rollouts."""
  modules = _modules()
  assert {"models.transformer", "rollouts.sglang", "rl.trainer", "experiments.run"} <= set(
      modules)
  targets = {t.split(".")[0] for t, _ in _imports(modules["rl.trainer"], modules)}
  assert {"models", "rollouts", "rl"} <= targets
