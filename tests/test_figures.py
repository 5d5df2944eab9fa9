"""The docs' figures agree with the results files they come from, and a covered doc quotes no
measured-looking number that bench/figures/ does not account for. Pure file reading."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ is scripts with no __init__.py: the registry is bench.figures from the repository root,
# whose experiments/ it imports too.
sys.path.insert(0, ROOT)
from bench import figures  # noqa: E402


def test_every_figure_agrees_with_its_file():
  listed = figures.problems()
  assert not listed, "\n".join(listed)


DOC = """# Demo

It took 1 min 41 s and reached 0.91 (`lr = 0.5`).
"""
RESULTS = {"run": {"seconds": 101, "accuracy": 0.912}}


@pytest.mark.parametrize("change, expected", [
    ({}, []),
    ({"results": {"run": {"seconds": 102, "accuracy": 0.912}}},
     ["results.json gives 'took 1 min 42 s and', which the doc does not say"]),
    ({"doc": DOC.replace("0.91", "0.90")},
     ["results.json gives 'reached 0.91 (', which the doc does not say"]),
    ({"results": {"run": {"accuracy": 0.912}}}, ["no 'seconds' on the path 'run/seconds'"]),
    ({"doc": DOC + "A new figure: 3.5x.\n"}, ["'3.5x' in "]),
    ({"doc": DOC.replace("`lr = 0.5`", "`lr = 0.1`")},
     ["'`lr = 0.5`', listed as not measured, is not in it", "'0.1' in"]),
])
def test_the_check_reports_each_kind_of_disagreement(tmp_path, change, expected):
  (tmp_path / "doc.md").write_text(change.get("doc", DOC))
  (tmp_path / "results.json").write_text(json.dumps(change.get("results", RESULTS)))
  registered = (
      figures.Figure("doc.md", "took {} and", "results.json", ("run/seconds",),
                     figures.common.min_s),
      figures.Figure("doc.md", "reached {} (", "results.json", ("run/accuracy",), "{:.2f}"),
  )
  listed = figures.problems(registered, (figures.NotMeasured("doc.md", "`lr = 0.5`", "a setting"),),
                            generated=(), covered=("doc.md",), root=str(tmp_path))
  assert len(listed) == len(expected) and all(
      part in line for part, line in zip(expected, listed)), listed


def write_table(root: str) -> str:
  """A generated doc: a table of results.json's accuracy."""
  with open(os.path.join(root, "results.json")) as f:
    return f"| accuracy |\n|---|\n| {json.load(f)['run']['accuracy']:.2f} |\n"


@pytest.mark.parametrize("doc, expected", [
    ("| accuracy |\n|---|\n| 0.91 |\n", []),
    # A paragraph written in by hand is scanned like any covered doc's.
    ("| accuracy |\n|---|\n| 0.91 |\n\nBy hand: it took 1.5 s.\n", ["'1.5 s' in"]),
    ("| accuracy |\n|---|\n| 0.90 |\n", ["write_table writes '| 0.91 |', which the doc"]),
    ("| accuracy |\n|---|\n", ["write_table writes '| 0.91 |', which the doc"]),
])
def test_a_generated_doc_is_what_its_results_write(tmp_path, doc, expected):
  (tmp_path / "table.md").write_text(doc)
  (tmp_path / "results.json").write_text(json.dumps(RESULTS))
  listed = figures.problems((), (), (figures.Generated("table.md", write_table),), ("table.md",),
                            str(tmp_path))
  assert len(listed) == len(expected) and all(
      part in line for part, line in zip(expected, listed)), listed
