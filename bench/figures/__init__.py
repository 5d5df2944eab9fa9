"""Where every figure the docs quote comes from: each tied to the results file that holds it,
and the numbers that only look measured (settings, thresholds, citations) listed with why.

A figure is registered here rather than marked in the Markdown, so that the docs stay plain
to read and edit, and one table answers "where does this number come from?". A `Figure` is the
doc's own words around the figure with `{}` where it stands, the results file, a key path into
it and a format that turns the stored value into the doc's text. `problems()` renders each
quote from its file and looks for it in its doc (whitespace runs read as one space, since
Markdown wraps lines anywhere), and scans each doc of `COVERED` for numbers that look measured
(a decimal, or a number with a unit: %, 20x, s, min, GiB, tokens, passed, points...) outside
every registered quote and every `NotMeasured` one. tests/test_figures.py holds it to none;
`python -m bench.figures` prints the same list.

A doc that a script writes from its results files is `Generated` instead: its figures need no
registering, since the check writes it again from the committed results, with the script's
own code (experiments/findings_report.py, experiments/compare.py), and finds every line it
writes in the doc. Only what was written into it by hand is scanned and registered:
docs/findings/report.md (from each finding's results.json) and docs/ahead/compare.md (from
compare.json) are such docs.

Each doc's module holds its `FIGURES`, `NOT_MEASURED` and `GENERATED`; `check` is the check
itself and `common` what the docs share (results files, formats, reasons). It does not produce
results: bench/*.py and the experiments write them, and bench/results/commands.json records
the commands the docs time by hand. Nor can the scan tell a bare integer ("5 seeds", "3 against
15") from prose: those are registered where they are measured, with nothing to force it.
Blocks of Python are code: not scanned, not quoted.

`COVERED` lists the docs covered: README.md, bench/README.md and every doc of docs/.
"""

import os

from . import ahead, architecture, bench_readme, check, distillation, findings, moe, objectives
from . import readme, sglang
from .check import Figure, Generated, NotMeasured

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COVERED = ("README.md", "docs/architecture.md", "docs/objectives.md", "docs/findings/report.md",
           "docs/ahead/compare.md", "docs/ahead/README.md", "docs/sglang.md", "docs/moe/README.md",
           "docs/distillation/README.md", bench_readme.COVERED)
_DOCS = (readme, architecture, objectives, findings, ahead, sglang, moe, distillation,
         bench_readme)
FIGURES = tuple(figure for doc in _DOCS for figure in doc.FIGURES)
NOT_MEASURED = tuple(entry for doc in _DOCS for entry in doc.NOT_MEASURED)
GENERATED = tuple(entry for doc in _DOCS for entry in doc.GENERATED)


def problems(figures: tuple[Figure, ...] = FIGURES,
             not_measured: tuple[NotMeasured, ...] = NOT_MEASURED,
             generated: tuple[Generated, ...] = GENERATED,
             covered: tuple[str, ...] = COVERED, root: str = ROOT) -> list[str]:
  """`check.problems` of the registry, or of what is given."""
  return check.problems(figures, not_measured, generated, covered, root)
