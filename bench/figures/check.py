"""The check: a figure rendered from its results file and looked for in its doc, and a covered
doc scanned for numbers that look measured and stand in no registered quote. It holds no
registry (each doc's module of this package does)."""

import dataclasses
import difflib
import json
import os
import re
from typing import Any, Callable

@dataclasses.dataclass(frozen=True)
class Figure:
  """`quote` as it reads in `doc`, one `{}` per key of `keys`: the value at that key path in
  `source`, formatted by `fmt` (a format string or a function, or a tuple of them, one per
  key). A path joins with "/" dict keys, list indices and `field=value,...` (the one record of
  a list with those fields), and may end on a whole subtree when `fmt` derives the figure from
  it ("" is the whole file)."""
  doc: str
  quote: str
  source: str
  keys: tuple[str, ...]
  fmt: str | Callable[[Any], str] | tuple[str | Callable[[Any], str], ...] = "{}"


@dataclasses.dataclass(frozen=True)
class NotMeasured:
  """Numbers in `quote` (as it reads in `doc`) that look measured and are not, or whose
  measurement was never recorded and the doc says so, and why."""
  doc: str
  quote: str
  why: str


@dataclasses.dataclass(frozen=True)
class Generated:
  """A doc that `write(root)` writes from results files, so its figures need no registering:
  each line `write` returns stands in `doc`, in its order. Lines the doc adds were written by
  hand, and a covered doc's are scanned like any other."""
  doc: str
  write: Callable[[str], str]


# A decimal that is not part of a version (0.5.23) or a name (Qwen2.5, k1.5), or a number with a
# unit that measurements carry.
MEASURED = re.compile(r"""(?<![\w.])(?:
    \d[\d,]*(?:\.\d+)?(?:x|×)(?!\w)
  | \d[\d,]*(?:\.\d+)?\s?(?:%|ms|s|min|minutes?|seconds?|hours?|[KMGT]i?B|Gi|tokens?(?:/s)?
                          |passed|failed|xfailed|skipped|points?)(?!\w)
  | \d+\.\d+(?![\w.]*\d|\w)
)""", re.X)
PYTHON_BLOCK = re.compile(r"```python .*?```")


def _text(doc: str, root: str) -> str:
  """The doc with every run of whitespace one space."""
  with open(os.path.join(root, doc)) as f:
    return " ".join(f.read().split())


def _generated_places(entry: Generated, root: str) -> tuple[list[str], list[tuple[int, int]]]:
  """What of `entry.write`'s lines `entry.doc` lacks or changes (one line each), and where
  (start, end) in the doc's `_text` the lines it does have stand."""
  with open(os.path.join(root, entry.doc)) as f:
    lines = f.read().split("\n")
  written = entry.write(root).split("\n")
  spans, start = [], 0  # each line's (start, end) in the doc's text
  for line in lines:
    words = " ".join(line.split())
    spans.append((start, start + len(words)))
    start += len(words) + 1 if words else 0
  found, places = [], []
  matcher = difflib.SequenceMatcher(None, lines, written, autojunk=False)
  for tag, doc_from, doc_to, from_, to in matcher.get_opcodes():
    # A line that differs is reported once, here: the doc's text in its place is not scanned.
    if tag in ("equal", "replace"):
      places.append((spans[doc_from][0], spans[doc_to - 1][1]))
    if tag in ("replace", "insert"):  # lines the doc lacks or changes; lines it adds are by hand
      found.append(f"{entry.doc}: {entry.write.__name__} writes {written[from_]!r}"
                   + (f" and {to - from_ - 1} more lines" if to - from_ > 1 else "")
                   + ", which the doc does not say: write it again from its results")
  return found, places


def _value(data: Any, path: str, source: str) -> Any:
  """What `path` (see `Figure`) reads in `data`, loaded from `source`."""
  for key in path.split("/") if path else ():
    if isinstance(data, list) and "=" in key:
      fields = dict(pair.split("=", 1) for pair in key.split(","))
      records = [r for r in data if all(str(r.get(f)) == v for f, v in fields.items())]
      if len(records) != 1:
        raise KeyError(f"{source}: {len(records)} records with {key!r} on the path {path!r}")
      data = records[0]
    elif isinstance(data, list) and key.isdigit() and int(key) < len(data):
      data = data[int(key)]
    elif isinstance(data, dict) and key in data:
      data = data[key]
    else:
      raise KeyError(f"{source}: no {key!r} on the path {path!r} (there: "
                     f"{list(data) if isinstance(data, dict) else type(data).__name__})")
  return data


def render(figure: Figure, root: str) -> str:
  """The quote with the figure as its results file gives it."""
  if figure.quote.count("{}") != len(figure.keys):
    raise ValueError(f"{figure.quote.count('{}')} slots for {len(figure.keys)} keys")
  with open(os.path.join(root, figure.source)) as f:
    data = json.load(f)
  fmts = figure.fmt if isinstance(figure.fmt, tuple) else (figure.fmt,) * len(figure.keys)
  texts = [(fmt.format if isinstance(fmt, str) else fmt)(_value(data, key, figure.source))
           for fmt, key in zip(fmts, figure.keys)]
  return " ".join(figure.quote.format(*texts).split())


def _places(text: str, quote: str, slots: bool) -> list[tuple[int, int]]:
  """Where `quote` stands in `text`; with `slots`, each `{}` of it stands for up to 40
  characters, and one that ends the quote ends where its figure does."""
  parts = [re.escape(" ".join(part.split())) for part in
           (quote.split("{}") if slots else [quote])]
  pattern = ".{1,40}?".join(parts) + (r"(?![\w.])" if slots and quote.endswith("{}") else "")
  return [(m.start(), m.end()) for m in re.finditer(pattern, text)]


def problems(figures: tuple[Figure, ...], not_measured: tuple[NotMeasured, ...],
             generated: tuple[Generated, ...], covered: tuple[str, ...],
             root: str) -> list[str]:
  """One line per figure its file does not give as the doc quotes it, per `NotMeasured` quote
  the doc lacks, per line of a generated doc that its results would not write, and per number
  of a covered doc that looks measured and is none of these."""
  found = []
  texts = {doc: _text(doc, root)
           for doc in {e.doc for e in figures + not_measured + generated} | {*covered}}
  places = {doc: [] for doc in texts}  # (start, end) of every quote, in its doc's text
  for entry in generated:
    missing, written = _generated_places(entry, root)
    found += missing
    places[entry.doc] += written
  for figure in figures:
    text = texts[figure.doc]
    try:
      quote = render(figure, root)
    except (OSError, KeyError, ValueError) as error:
      found.append(f"{figure.doc}: {figure.quote!r}: {error}")
      quote = None
    if quote is not None and quote not in text:
      found.append(f"{figure.doc}: {figure.source} gives {quote!r}, which the doc does not say")
      quote = None
    # A figure that disagrees with its file is reported once, above: where its quote stands,
    # whatever the figure there says, its numbers are not reported again as unregistered.
    places[figure.doc] += (_places(text, quote, slots=False) if quote is not None else
                           _places(text, figure.quote, slots=True))
  for entry in not_measured:
    if not _places(texts[entry.doc], entry.quote, slots=False):
      found.append(f"{entry.doc}: {entry.quote!r}, listed as not measured, is not in it")
    places[entry.doc] += _places(texts[entry.doc], entry.quote, slots=False)
  for doc in covered:
    text = texts[doc]
    skipped = places[doc] + [(m.start(), m.end()) for m in PYTHON_BLOCK.finditer(text)]
    for m in MEASURED.finditer(text):
      if not any(start <= m.start() and m.end() <= end for start, end in skipped):
        found.append(f"{doc}: {m.group()!r} in {text[max(0, m.start() - 40):m.end() + 20]!r} "
                     "looks measured: register it in its doc's module of bench/figures/ "
                     "(FIGURES) or say why it is not (NOT_MEASURED)")
  return found
