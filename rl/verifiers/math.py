"""Math answers: final-answer extraction, equivalence by value, and a time-bounded pool.

Owns what counts as a correct final answer (the conventions below) and how a check is bounded
in time. It does not own prompts or datasets (rl/tasks/math.py) or rewards (rl/rewards.py).
tests/test_math_verifier.py pins every convention; bench/verifiers.py scores them against
math-verify on pairs from its and Qwen2.5-Math's test suites.

Extraction (`extract_answer`), from the text after the last `</think>` (an opened, never closed
think block is a truncated response: no answer) and before a chat template's end of turn
(`<|im_end|>`, `<|im_start|>`, `<|endoftext|>`, `<|eot_id|>`):
- boxes: the last `\\boxed{}` / `\\fbox{}`; several boxes with different answers are one
  list, so `\\boxed{1} and \\boxed{2}` answers "1, 2" and `\\boxed{3} or \\boxed{4}` never equals 3;
- else an answer phrase ("final answer", "answer is", "Answer:", 答案是): the first line after the
  last one, its first sentence; when that is not a formula ("The largest $n$ is 34"), its
  answer-like span as below;
- else prose: the last sentence (Minerva's closing "I hope it is correct." aside) when it is a
  bare formula, else its last math span (`$..$`, `$$..$$`, `\\(..\\)`, `\\[..\\]`), bare LaTeX
  run or number, whichever is later. A bare LaTeX run (a formula with a command or an
  environment but no $ or box: `\\frac{1}{2}`, `x \\le 3`, a matrix, also over several lines)
  is read whole or not at all, never as a number inside it (a bare pmatrix ending in 4 is not
  4). A number or span listed after another ("3 or 4", "$5$, $6$") is a hedge and no answer; a
  negated one ("7, not 8") is passed over.
An answer written as code (`lambda: 42`, `def f(): return 42`, `print(42)`, `f() = 42`, also
inside \\text{} or a prose sentence) is no answer: what a program would print is not the answer.
A gold with a box, a closed think block or an answer phrase is a worked solution: its answer
is extracted the same way (`gold_answer`).

Equivalence (`is_equivalent`), by value, convention by convention:
- value: 2/4 = 1/2, 2^{10} = 1024, 3\\frac{1}{2} = 7/2, \\binom{5}{2} = 10, \\log_2 8 = 3,
  a ratio 7:32 = 7/32, a \\begin{vmatrix} is its determinant. Exact forms are equal when
  they agree to 40 digits (\\sqrt{2}+\\sqrt{3} = \\sqrt{5+2\\sqrt{6}}; 10^{20} != 10^{20}+1).
- decimals: two terminating decimals (integers included) compare exactly: 1.0000001 != 1,
  1e-7 != 2e-7. A decimal answer for a value with no finite expansion agrees within 1e-6
  relative (0.3333333 = 1/3, 0.33 != 1/3). A decimal gold written to 3 or more significant
  digits accepts the exact value it rounds (33.3 for 100/3, 0.333 for 1/3; 0.3 is not 1/3).
- number formats: thousands separators 1,000 / 1{,}000 / 1,\\!000 / 1\\,000 / 1 000 000; a
  decimal comma 1,5 = 1.5 and 0,111 = 0.111 (a lone d,dd is read both ways, as a number and
  as a list); currency (\\$, USD, EUR, €, £, ¥, ₹) and units (\\text{ cm}, \\text{ m}^2, words)
  around a number are dropped, never converted; scientific notation 1.5e-3, 2E3,
  1.5\\times 10^{-3}; repeating decimals 0.\\overline{3} = 1/3, 0.1\\overline{6} = 1/6,
  0.\\dot{3}. Two numbers side by side ("2 3") are not a product.
- LaTeX: \\frac13, \\dfrac, \\tfrac, \\cfrac, \\left \\right, \\displaystyle, spacing commands,
  \\text{} / \\mathrm{} / \\mathbf{} (their content is a unit beside a number, else the
  answer), \\mathrm{i} and \\mathrm{e}, `$..$` and `\\(..\\)` without a box, a LaTeX group {..},
  backslashes escaped twice (\\\\frac, as hand-written JSON has them).
- percent: a gold of X% accepts X, X% and X/100; a bare gold X accepts X and X% but never
  100X nor X/100 ("28 percent" is 28%); a gold written as a fraction is a ratio, so X% for it
  means X/100 only (12.5% = 1/8, \\frac{1}{8}% != 1/8).
- equations: x = 3 equals 3, and so does any equation whose left side names the quantity
  without a number (f(x) = 1, AB = 4, (p, q) = (3, 2), a_3 = 2), but not 2x = 6; a chain
  x = 5+5+1 = 11 is graded by its ends; a true equality of numbers is its value
  (2 \\cdot 3 = 6 equals 6; 3 = 4 equals nothing); `\\approx` keeps the exact part
  (x = 1/3 \\approx 0.33) or reads as = (x \\approx 11); y = 2x+1 equals 2x-y+1 = 0 (one a
  non-zero multiple of the other); x = 2 != y = 2.
- intervals and relations: brackets must match ((1,2] != [1,2)); a solved bound equals its
  interval or union (x > 3, 3 < x, -2 \\le x \\le 7, x \\in [-2, 7], \\mathbb{R}, x \\neq 2,
  |x| < 2, 1 \\le |z| \\le 2 for real z, \\{x \\mid x > 2\\}), and so does a bound on a named
  quantity (0 < f(x) < 1 is (0, 1)) or on its negative (-x > -1 is x < 1); an unsolved one
  does not (2x - 1 > 5 != (3, \\infty), nor x > 3); two bounds must bound the same quantity
  (x > 3 != y > 3); "x < -2 or x > 3" is a union; unions ignore order.
- sets and tuples: sets and bare lists ignore order and repeats ({1,2} = {2,1,2};
  \\emptyset = \\varnothing = \\{\\}; a union of finite sets is one set); tuples keep order, and a
  bare list equals the tuple with its items in order (1, 3 for (1, 3)); a set is neither a tuple
  nor an interval; a \\pm b is the list a+b, a-b; `;` separates like `,`. NuminaMath's
  assignments list tuples: p=5, q=2; p=7, q=2 is the list (5, 2), (7, 2).
- variables: expressions in variables are equal when they agree at 6 rational points, every
  variable taken as a positive real (\\sqrt{1/n} = 1/\\sqrt{n}, \\sqrt{x^2} = x,
  \\sin^2 x + \\cos^2 x = 1), at negative points too where an absolute value is taken
  (|x| != x); different variables differ (2y+1 != 2x+1).
- matrices and vectors: pmatrix, bmatrix, matrix, smallmatrix and array (also inside ( ) or
  [ ]) compare entry by entry with their shape (a transpose differs, and so do a row and a
  column); a one-column or one-row matrix equals the tuple of its entries ((1, 2)), not an
  interval [1, 2]. Matrix arithmetic is evaluated: sums, scalar multiples, products in their
  order, small integer powers, the inverse M^{-1} and the transpose M^T.
- complex numbers: i is the imaginary unit (i^2 = -1, 2e^{i\\pi/3} = 1+\\sqrt{3}i,
  \\sqrt{-4} = 2i); \\overline{z} is the conjugate.
- text: compares case-insensitively without spaces ((B) = B, \\text{Yes} = yes); a choice
  given with its value, as AMC solutions do (\\textbf{(D)}\\ 12), is its letter.

Model text is never evaluated: a small recursive-descent parser builds sympy objects
directly, refuses numbers too large to build (9^{9^{9}}, (10^{100})!) and nesting deeper than
`_MAX_DEPTH`. `MathVerifier` runs checks in worker processes and kills one that passes its time
limit, so an adversarial answer costs at most `timeout` seconds and never stalls the loop.
"""

import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import re
import time
from typing import Any, Sequence

import sympy

_MAX_ANSWER_CHARS = 1000
_MAX_DEPTH = 60
_MAX_BOXES = 32
_MAX_DIGITS = 5000  # exact integers beyond this many digits are refused, not built
_REL_TOL = 1e-6  # a decimal answer's error, relative to the gold
_EXACT_TOL = 1e-40  # exact forms equal when they agree to this (evaluated to _DIGITS digits)
_DIGITS = 60
_ZERO_TOL = 1e-12  # against a gold of 0
_ROUNDED_GOLD = 0.005  # a decimal gold's half unit, relative to it, at 3 significant digits
_SAMPLE_POINTS = 6
_MAX_MATRICES = 8  # in one expression (A + B + ...)
_MAX_MATRIX_POWER = 8  # M^8; also M^{-1}
_MAX_MATRIX_SIDE = 6  # of a matrix raised to a power

# --------------------------------------------------------------------------- extraction


@dataclasses.dataclass(frozen=True)
class Extracted:
  answer: str | None
  reason: str  # "boxed", "boxes", "phrase", "prose", "no answer", "hedged", "truncated",
  # "unbalanced", "code"


def _braced(text: str, open_at: int) -> tuple[str, int] | None:
  """(content, index after the closing brace) of the group opening at text[open_at] == '{'."""
  depth = 0
  for i in range(open_at, len(text)):
    c = text[i]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[open_at + 1:i], i + 1
  return None


_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_PHRASE = re.compile(r"(?:final answer|answer is|answer:|答案是|答案为|答案：)", re.IGNORECASE)
# A chat template's end of turn: what follows is not the response.
_END_OF_TURN = re.compile(r"<\|(?:im_end|im_start|endoftext|end_of_text|eot_id)\|>")
# Inline and display math: $$..$$, $..$, \[..\], \(..\).
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$(.+?)(?<!\\)\$|\\\[(.+?)\\\]|\\\((.+?)\\\)",
                        re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])-?(?:(?:\d{1,3}(?:[ ,]\d{3})+|\d+)(?:[.,]\d+)?|\.\d+)(?:/\d+)?")
# Between two candidates: a list or an alternative ("3 or 4", "$5$, $6$"): a hedge.
_LISTING = re.compile(r"\s*(?:,|\bor\b|\band\b)\s*")
_SPAN_MARK = "\x00"
_NEGATED = re.compile(r"\b(?:not|no|never|instead of|rather than)\s*$", re.IGNORECASE)
# Python around a number: a lambda with its colon (\lambda is the Greek letter), def, return,
# print, a call without arguments. The parser rejects most of it only by accident, and \text{}
# (dropped beside a number as a unit) or prose extraction (the last number) would strip it.
_CODE = re.compile(r"(?<!\\)\blambda\b[\w\s,*]*:|\b(?:def|return|print)\b|[A-Za-z_]\w*\s*\(\s*\)")


def _boxes(text: str) -> list[str] | None:
  """Contents of every \\boxed{..} / \\fbox{..} in order; None if one never closes."""
  found = []
  for m in _BOX.finditer(text):
    start = m.end()
    if start < len(text) and text[start] == "{":
      group = _braced(text, start)
      if group is None:
        return None
      found.append(group[0])
    elif start < len(text):  # \boxed 5
      found.append(re.match(r"\S*", text[start:]).group(0).rstrip("$.,"))
  return found


def last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{..} in `text` (a MATH solution's answer); None if none."""
  boxes = _boxes(text)
  return boxes[-1].strip() if boxes else None


def _parses(text: str) -> bool:
  if len(text) > _MAX_ANSWER_CHARS:
    return False
  try:
    _parse(normalize(text))
    return True
  except (_Refused, RecursionError, ValueError, TypeError, ZeroDivisionError, OverflowError):
    return False


def _brace_pairs(text: str) -> dict[int, int]:
  """Index of each '{' -> index after its matching '}', in one pass (unmatched ones left out),
  so that scanning a sentence full of '{' stays linear."""
  pairs, stack = {}, []
  for i, c in enumerate(text):
    if c == "{" and (i == 0 or text[i - 1] != "\\"):
      stack.append(i)
    elif c == "}" and stack and (i == 0 or text[i - 1] != "\\"):
      pairs[stack.pop()] = i + 1
  return pairs


def _latex_runs(sentence: str) -> list[tuple[int, int, str]]:
  """(start, end, text) of each run of bare LaTeX in a prose sentence: formula written without
  $ or a box that holds a math command or environment (\\frac{1}{2}, x \\le 3, a matrix).
  Such a run is one answer, read whole or not at all: its numbers are no candidates of their
  own, else `\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}` would answer 4. \\text{..} with words is
  prose and ends a run; a math span hidden by _prose_answer ends it too."""
  braces, runs, i, start, latex = _brace_pairs(sentence), [], 0, None, False

  def close(end: int):
    if start is not None and latex:
      text = _trim_run(sentence[start:end])
      if text:
        offset = start + sentence[start:end].index(text)
        runs.append((offset, offset + len(text), text))

  while i < len(sentence):
    wrapper = _WRAPPERS.match(sentence, i)
    if wrapper and wrapper.end() - 1 in braces \
        and re.search(r"[a-zA-Z]{2,}", sentence[wrapper.end():braces[wrapper.end() - 1]]):
      close(i)  # \text{so the answer is}: prose
      start, latex, i = None, False, braces[wrapper.end() - 1]
      continue
    m = _RUN_UNIT.match(sentence, i)
    end, command = None, False
    if sentence[i] == "{" and i in braces:
      end = braces[i]
    elif m is not None:
      end = m.end()
      command = m.group(0).startswith("\\") and m.group(0)[1:2].isalpha()
    if end is None:
      close(i)
      start, latex, i = None, False, i + 1
      continue
    if start is None:
      start = i
    latex = latex or command
    i = end
  close(len(sentence))
  return runs


# One unit of a bare formula: an environment, a command, an escaped character, a digit or an
# operator, a one-letter variable, space ('{..}' groups are matched by _brace_pairs).
_RUN_UNIT = re.compile(r"""
    \\begin\{(\w+\*?)\}.*?\\end\{\1\}
  | \\[a-zA-Z]+\*?
  | \\[^a-zA-Z\x00]
  | [\d.,:;!'&|+\-*/^_=<>()\[\]]
  | (?<![a-zA-Z])[a-zA-Z](?![a-zA-Z])
  | [ \t\n]+
  """, re.VERBOSE | re.DOTALL)


def _trim_run(run: str) -> str:
  """A run without the punctuation and English around it: "a \\frac12." -> \\frac12; but
  "x \\le 3" keeps its variable."""
  run = run.strip().rstrip(".,;:").strip()
  m = re.match(r"[a-zA-Z]\s+(?![=<>+\-*/^]|\\(?:le|ge|leq|geq|ne|neq|in|approx|lt|gt)\b)", run)
  return run[m.end():].strip() if m else run


_ENVIRONMENT = re.compile(r"\\begin\{(\w+\*?)\}.*?\\end\{\1\}", re.DOTALL)


def _one_line(environment: re.Match) -> str:
  """A LaTeX environment on one line, so that splitting into lines cannot cut a matrix."""
  return " ".join(environment.group(0).split("\n"))


def _prose_answer(text: str, reason: str = "prose") -> Extracted:
  """The answer-like span of the text's last sentence (Minerva's closing "I hope it is
  correct." aside): the sentence itself when it is a bare formula, else its last math span,
  bare LaTeX run (read whole: `_latex_runs`) or number, whichever is later, leaving out one
  that is negated ("7, not 8"). A candidate listed after another ("3 or 4", "$5$, $6$") is a
  hedge."""
  # The last sentence lies at the end: a longer one is no answer (answers over
  # _MAX_ANSWER_CHARS are refused), and the scan stays linear in the window.
  text = re.sub(r"\s*I hope it is correct\.?\s*$", "", text[-4 * _MAX_ANSWER_CHARS:].strip())
  spans = []

  def hide(m: re.Match) -> str:
    spans.append(next(g for g in m.groups() if g is not None).strip())
    return f"{_SPAN_MARK}{chr(0xE000 + len(spans) - 1)}{_SPAN_MARK}"

  hidden = _ENVIRONMENT.sub(_one_line, _MATH_SPAN.sub(hide, text))
  sentences = [s.strip() for s in re.split(r"\n+|(?<=[.!?])\s+|(?<=。)", hidden)]
  sentences = [s for s in sentences if s.strip(" .!?。*")]
  if not sentences:
    return Extracted(None, "no answer")
  sentence = sentences[-1]
  marks = rf"{_SPAN_MARK}(.){_SPAN_MARK}"

  def shown(m: re.Match) -> str:
    return spans[ord(m.group(1)) - 0xE000]

  if _CODE.search(re.sub(marks, shown, sentence)):  # its math spans too: $\text{print}(42)$
    return Extracted(None, "code")
  words = re.sub(r"\\[a-zA-Z]+", " ", sentence)
  if _SPAN_MARK not in sentence and not re.search(r"[a-zA-Z]{2,}", words):
    bare = sentence.strip().rstrip(".").strip()
    if _parses(bare):
      return Extracted(bare, reason)
  candidates = [(m.start(), m.end(), shown(m)) for m in re.finditer(marks, sentence)]
  runs = _latex_runs(sentence)
  candidates += runs
  candidates += [(m.start(), m.end(), m.group(0)) for m in _NUMBER.finditer(sentence)
                 if not any(start <= m.start() < end for start, end, _ in runs)]
  candidates = sorted(c for c in candidates if c[2] and not _NEGATED.search(sentence[:c[0]]))
  if not candidates:
    return Extracted(None, "no answer")
  if len(candidates) > 1 and _LISTING.fullmatch(sentence[candidates[-2][1]:candidates[-1][0]]):
    if not is_equivalent(candidates[-2][2], candidates[-1][2]):
      return Extracted(None, "hedged")
  return Extracted(candidates[-1][2], reason)


def extract_answer(response: str) -> Extracted:
  end = _END_OF_TURN.search(response)
  if end is not None:
    response = response[:end.start()]
  if "</think>" in response:
    response = response[response.rindex("</think>") + len("</think>"):]
  elif "<think>" in response:
    return Extracted(None, "truncated")
  boxes = _boxes(response)
  if boxes is None:
    return Extracted(None, "unbalanced")
  if len(boxes) > _MAX_BOXES:  # a flood of boxes is no answer (and costs quadratic checks)
    return Extracted(None, "hedged")
  if boxes:
    if any(_CODE.search(box) for box in boxes):
      return Extracted(None, "code")
    distinct = []
    for box in boxes:
      if not any(is_equivalent(box, seen) for seen in distinct):
        distinct.append(box)
    if len(distinct) > 1:  # one answer in several boxes ("\boxed{1} and \boxed{2}"): a list
      return Extracted(", ".join(distinct), "boxes")
    return Extracted(boxes[-1], "boxed")
  phrases = list(_PHRASE.finditer(response))
  if not phrases:
    return _prose_answer(response)
  tail = response[phrases[-1].end():][:4 * _MAX_ANSWER_CHARS].strip().lstrip(":：*").strip()
  tail = re.sub(r"^is\b", "", tail).strip().lstrip(":").strip()
  tail = _ENVIRONMENT.sub(_one_line, tail)  # a matrix over several lines is one answer
  line = next((l.strip(" *") for l in tail.split("\n") if l.strip(" *")), "")
  line = re.sub(r"\.\s.*$", "", line)  # first sentence only
  line = line.strip().rstrip(".").strip()
  if not line:
    return Extracted(None, "no answer")
  if _CODE.search(line):
    return Extracted(None, "code")
  bare = line.strip("$").strip()
  if _parses(bare):
    return Extracted(bare, "phrase")
  return _prose_answer(line, "phrase")  # The largest $n$ is 34


# --------------------------------------------------------------------------- normalization

_DROP = [r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad",
         r"\(", r"\)", r"\[", r"\]", r"\$", "$", "~"]
_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mathsf|"
                       r"boldsymbol|operatorname|mbox|rm)\s*\{")
_UNIT_WORD = re.compile(r"(?<=[\d}).])\s*(?:[a-zA-Z]{2,}|[a-zA-Z]{2,}\^\{?\d\}?)\.?\s*$")
_CURRENCY = re.compile(r"^(?:US\s*\$|USD|EUR|GBP|Rs\.?|€|£|¥|₹)\s*(?=[-\d.])")
_SCIENTIFIC = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
_REPEATING = re.compile(r"(?<!\d)(-?)(\d*)\.(\d*)\\(?:overline\s*\{(\d+)\}|dot\s*\{?(\d)\}?)")


def _unwrap(text: str, keep: bool) -> str:
  """Replace \\text{..}-style groups with their content (keep) or drop them, together with a
  unit's exponent (\\text{ m}^2). Content without letters (\\mathbf{5}) and the constants
  \\mathrm{i} and \\mathrm{e} are always kept."""
  out, i = [], 0
  while True:
    m = _WRAPPERS.search(text, i)
    if m is None:
      out.append(text[i:])
      return "".join(out)
    group = _braced(text, m.end() - 1)
    if group is None:
      out.append(text[i:])
      return "".join(out)
    out.append(text[i:m.start()])
    content, i = group
    if keep or not re.search(r"[a-zA-Z]", content) or content.strip() in ("i", "e"):
      out.append(f" {content} ")
    else:
      out.append(" ")
      exponent = re.match(r"\s*\^\s*(?:\{[^{}]*\}|\d)", text[i:])
      if exponent:
        i += exponent.end()


def _repeating(m: re.Match) -> str:
  """0.1\\overline{6} -> (\\frac{15}{90}): integer part, then digits before and in the period."""
  sign, whole, head, period = m.group(1), m.group(2) or "0", m.group(3), m.group(4) or m.group(5)
  numerator = int(head + period) - int(head or "0")
  denominator = 10 ** len(head) * (10 ** len(period) - 1)
  return f"{sign}({whole}+\\frac{{{numerator}}}{{{denominator}}})"


def normalize(text: str) -> str:
  text = text.strip()
  if r"\begin" not in text:  # LaTeX escaped twice, as in JSON written by hand: \\frac
    text = re.sub(r"\\\\(?=[a-zA-Z{}])", r"\\", text)
  text = re.sub(r"\s*\{\s*,\s*\}\s*|,\s*\\!\s*", ",", text)  # 1{,}000 and 1,\!000
  text = re.sub(r"(?<!\\)\\ ", " ", text)  # a TeX space; \\ is a matrix's row break
  text = text.replace(";", ",")
  text = re.sub(r"(?<=[)\]])\s*(?:or|and)\s*(?=[(\[])", ",", text)  # (1,2)or(2,1)
  text = re.sub(r"\\(?:text|mbox)\s*\{\s*(or|and)\s*\}", r" \1 ", text)
  text = re.sub(r"\\(?:text|mbox)\s*\{\s*(?:percent|per cent)\s*\}|\s*\b(?:percent|per cent)\b",
                r"%", text)
  for token in _DROP:
    text = text.replace(token, " " if token.startswith("\\") and token[1:].isalpha() else "")
  text = re.sub(r"\\[dtc]frac", r"\\frac", text)
  text = re.sub(r"\\[dt]binom", r"\\binom", text)
  text = _REPEATING.sub(_repeating, text)
  text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", text)
  text = re.sub(r"\\mathbb\s*\{?\s*R\s*\}?", r"(-\\infty,\\infty)", text)
  text = re.sub(r"\\(?:emptyset|varnothing)(?![a-zA-Z])|\\\{\s*\\\}", r"\\emptyset", text)
  text = re.sub(r"\\langle(?![a-zA-Z])", "(", text)
  text = re.sub(r"\\rangle(?![a-zA-Z])", ")", text)
  dropped = _unwrap(text, keep=False)
  # A \text{} next to a numeral is a unit; a wholly textual answer keeps its words.
  text = dropped if re.search(r"\d", dropped) else _unwrap(text, keep=True)
  text = re.sub(r"\\(?:le|leq|leqslant)(?![a-zA-Z])", "<=", text)
  text = re.sub(r"\\(?:ge|geq|geqslant)(?![a-zA-Z])", ">=", text)
  text = re.sub(r"\\(?:ne|neq)(?![a-zA-Z])", "!=", text)
  text = re.sub(r"\\(?:lt)(?![a-zA-Z])", "<", text)
  text = re.sub(r"\\(?:gt)(?![a-zA-Z])", ">", text)
  text = re.sub(r"\s+(?:or|and)\s+|\\(?:lor|vee)(?![a-zA-Z])", ",", text)
  text = " ".join(text.split()).strip().rstrip(".").strip()
  text = _CURRENCY.sub("", text)
  while True:
    shorter = _UNIT_WORD.sub("", text).strip()
    if shorter == text or not shorter:
      break
    text = shorter
  text = re.sub(r"^[a-zA-Z]\s*\\in(?![a-zA-Z])\s*", "", text)  # x \in [1, 2]
  if re.fullmatch(r"-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?|-?[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?", text):
    text = text.replace(",", "").replace(" ", "")
  return _SCIENTIFIC.sub(r"\1\\cdot 10^{\2}", text)


def _decimal_comma(text: str) -> str | None:
  """1,5 -> 1.5: the other reading of a lone number with one comma (else None)."""
  if re.fullmatch(r"-?\d+,(?:\d{1,2}|\d{4,})|-?0,\d+", text):
    return text.replace(",", ".")
  return None


# --------------------------------------------------------------------------- parsing


class _Refused(Exception):
  """The answer cannot be parsed or would be too costly to build."""


@dataclasses.dataclass(frozen=True)
class _Value:
  expr: Any  # sympy.Expr
  approx: bool  # written with a decimal point somewhere
  decimals: int | None = None  # digits after the point of a lone decimal (33.3: 1)


@dataclasses.dataclass(frozen=True)
class _Relation:
  ops: tuple[str, ...]  # between consecutive sides: "=", "<", "<=", ">", ">=", "!="
  sides: tuple[_Value, ...]


@dataclasses.dataclass(frozen=True)
class _Group:
  kind: str  # "list" (bare commas, unordered), "set", "union", "bracket"
  items: tuple[Any, ...]
  left: str = ""  # for "bracket": "(" or "["
  right: str = ""


_TOKEN = re.compile(r"""
    (?P<num>\d+\.?\d*|\.\d+)
  | (?P<cmd>\\[a-zA-Z]+|\\\{|\\\}|\\\|)
  | (?P<op><=|>=|!=|\*\*|[-+*/^!=<>(),\[\]{}|_:])
  | (?P<name>[a-zA-Z])
  | (?P<matrix>[\ue100-\ue1ff])
  | (?P<space>\s+)
  """, re.VERBOSE)

_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
          "vartheta", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi",
          "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma",
          "Phi", "Psi", "Omega"}
_FUNCS = {"sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot,
          "sec": sympy.sec, "csc": sympy.csc, "ln": sympy.log, "log": sympy.log,
          "exp": sympy.exp, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan}
_MUL_CMDS = {r"\cdot", r"\times", r"\ast"}
_REL = {"=", "<", "<=", ">", ">=", "!="}


def _tokenize(text: str) -> list[tuple[str, str]]:
  tokens, i = [], 0
  while i < len(text):
    m = _TOKEN.match(text, i)
    if m is None:
      raise _Refused(f"unexpected {text[i]!r}")
    i = m.end()
    kind = m.lastgroup
    if kind == "space":
      continue
    value = m.group(kind)
    if kind == "cmd" and value[1:] in _FUNCS:
      kind = "func"
    tokens.append((kind, value))
  # sin, cos, ... written without a backslash
  merged, j = [], 0
  while j < len(tokens):
    for name in sorted(_FUNCS, key=len, reverse=True):
      n = len(name)
      if (all(k == "name" for k, _ in tokens[j:j + n]) and len(tokens[j:j + n]) == n
          and "".join(v for _, v in tokens[j:j + n]) == name):
        merged.append(("func", "\\" + name))
        j += n
        break
    else:
      merged.append(tokens[j])
      j += 1
  return merged


def _int_digits(x) -> float:
  return math.log10(abs(int(x))) if x != 0 else 0.0


def _power(base, exponent):
  if isinstance(base, sympy.MatrixBase):
    return _matrix_power(base, exponent)
  if base.is_Integer and exponent.is_Integer:
    if abs(int(exponent)) > _MAX_DIGITS * 4 or _int_digits(base) * abs(int(exponent)) > _MAX_DIGITS:
      raise _Refused("power too large")
  elif base.is_number and exponent.is_number and exponent.is_Integer is False:
    if exponent.is_Rational and abs(exponent) > _MAX_DIGITS:
      raise _Refused("power too large")
  if exponent.is_Integer and abs(int(exponent)) > _MAX_DIGITS * 4 and base.is_number:
    raise _Refused("power too large")
  return sympy.Pow(base, exponent)


def _matrix_power(base, exponent):
  """M^2, M^{-1} (the inverse), M^T and M^\\top (the transpose); small powers only."""
  if exponent == sympy.Symbol("T"):
    return base.T
  # Powers of a matrix of symbols grow without bound (a 4 x 4 inverse takes sympy 30 s).
  if not exponent.is_Integer or abs(int(exponent)) > _MAX_MATRIX_POWER \
      or not all(entry.is_number for entry in base) or max(base.shape) > _MAX_MATRIX_SIDE:
    raise _Refused("matrix power of a large or symbolic matrix")
  return base ** int(exponent)  # a singular matrix's inverse raises ValueError


def _factorial(x):
  if x.is_Integer and int(x) > 1000:
    raise _Refused("factorial too large")
  if x.is_number and not x.is_Integer:
    raise _Refused("factorial of a non-integer")
  return sympy.factorial(x)


class _Parser:
  """Recursive descent over the tokens: relations, then + -, then * / and juxtaposition,
  then unary minus, then ^ and !, then atoms (numbers, letters, \\frac, \\sqrt, groups)."""

  def __init__(self, tokens, matrices=()):
    self.tokens, self.i, self.depth, self.approx = tokens, 0, 0, False
    self.matrices = matrices  # (sympy matrix, approx) for each placeholder token

  def peek(self, offset=0):
    j = self.i + offset
    return self.tokens[j] if j < len(self.tokens) else ("end", "")

  def take(self, value=None):
    token = self.peek()
    if value is not None and token[1] != value:
      raise _Refused(f"expected {value!r}, got {token[1]!r}")
    self.i += 1
    return token

  def deeper(self):
    self.depth += 1
    if self.depth > _MAX_DEPTH:
      raise _Refused("nested too deeply")

  def relation(self):
    sides, ops = [self.expr()], []
    while self.peek()[1] in _REL:
      ops.append(self.take()[1])
      sides.append(self.expr())
    if not ops:
      return sides[0]
    if any(isinstance(side, sympy.MatrixBase) for side in sides):
      raise _Refused("a relation between matrices")  # A = (..): _parse_item reads its value
    return _Relation(tuple(ops), tuple(_Value(s, self.approx) for s in sides))

  def expr(self):
    self.deeper()
    value = self.term()
    while self.peek()[1] in ("+", "-") or self.peek()[1] == r"\pm":
      op = self.take()[1]
      if op == r"\pm":
        raise _Refused("plus-minus")
      rhs = self.term()
      value = value + rhs if op == "+" else value - rhs
    self.depth -= 1
    return value

  def starts_atom(self):
    kind, value = self.peek()
    return (kind in ("num", "name", "func", "matrix") or value in ("(", "[", "{", "|")
            or (kind == "cmd" and (value in (r"\frac", r"\sqrt", r"\pi", r"\infty")
                                   or value[1:] in _GREEK)))

  def term(self):
    value = self.unary()
    while True:
      kind, op = self.peek()
      if op in ("*", "/", ":") or op in _MUL_CMDS or op == r"\div":
        self.take()
        rhs = self.unary()
        if op in ("/", ":", r"\div"):  # a ratio 7:32 is its quotient
          if rhs == 0:
            raise _Refused("division by zero")
          value = value / rhs
        else:
          value = value * rhs
      elif self.starts_atom() and op != "|":
        if kind == "num":  # "2 3" is not 6, and "1 000" was not a thousand here
          raise _Refused("two numbers side by side")
        value = value * self.power()
      else:
        return value

  def unary(self):
    op = self.peek()[1]
    if op in ("-", "+"):
      self.take()
      inner = self.unary()
      return -inner if op == "-" else inner
    return self.power()

  def power(self):
    base = self.postfix()
    if self.peek()[1] in ("^", "**"):
      self.take()
      self.deeper()
      exponent = self.unary() if self.peek()[1] != "{" else self.atom()
      self.depth -= 1
      return _power(base, exponent)
    return base

  def postfix(self):
    value = self.atom()
    while self.peek()[1] == "!":
      self.take()
      value = _factorial(value)
    return value

  def group(self, close):
    self.deeper()
    value = self.expr()
    self.take(close)
    self.depth -= 1
    return value

  def atom(self):
    kind, value = self.take()
    if kind == "num":
      if "." in value:
        self.approx = True
        number = sympy.Rational(value)
      else:
        if len(value) > _MAX_DIGITS:
          raise _Refused("number too long")
        number = sympy.Integer(value)
      if self.peek()[1] == r"\frac" and "." not in value:  # mixed number 3\frac{1}{2}
        self.take()
        frac = self.fraction()
        return number + frac
      return number
    if kind == "matrix":
      matrix, approx = self.matrices[ord(value) - 0xE100]
      self.approx = self.approx or approx
      return matrix
    if kind == "name":
      if self.peek()[1] == "_":  # a_3, x_{12}: one symbol
        self.take()
        return sympy.Symbol(f"{value}_{self.subscript()}")
      if value == "i":
        return sympy.I
      if value == "e":
        return sympy.E
      return sympy.Symbol(value)
    if kind == "func":  # \sin(x)^2 and \sin^2 x square the sine; \sin x^2 does not
      exponent = None
      if value == r"\log" and self.peek()[1] == "_":  # \log_2 8, \log_{b} x
        self.take()
        base = self.single()
        argument = self.atom() if self.peek()[1] == "(" else self.power()
        return sympy.log(argument, base)
      if self.peek()[1] == "^":
        self.take()
        exponent = self.atom()
      argument = self.atom() if self.peek()[1] == "(" else self.power()
      result = _FUNCS[value[1:]](argument)
      return result if exponent is None else _power(result, exponent)
    if value == "(":
      return self.group(")")
    if value == "[":
      return self.group("]")
    if value == "{":
      return self.group("}")
    if value == "|":
      return sympy.Abs(self.group("|"))
    if value == r"\frac":
      return self.fraction()
    if value == r"\overline":  # a complex conjugate (repeating decimals are read before)
      return sympy.conjugate(self.single())
    if value == r"\binom":
      n, k = self.single(), self.single()
      if not (n.is_Integer and k.is_Integer) or int(n) > 10_000:
        raise _Refused("binomial of a non-integer or too large")
      return sympy.binomial(n, k)
    if value == r"\sqrt":
      index = 2
      if self.peek()[1] == "[":
        self.take()
        index = self.group("]")
      radicand = self.atom()
      return sympy.root(radicand, index)
    if value == r"\pi":
      return sympy.pi
    if value == r"\infty":
      return sympy.oo
    if value in (r"\top", r"\intercal"):  # M^\top: the transpose
      return sympy.Symbol("T")
    if kind == "cmd" and value[1:] in _GREEK:
      return sympy.Symbol(value[1:])
    raise _Refused(f"unexpected {value!r}")

  def subscript(self) -> str:
    if self.peek()[1] != "{":
      return self.take()[1]
    self.take()
    parts = []
    while self.peek()[1] != "}":
      if self.peek()[0] == "end" or self.peek()[1] == "{":
        raise _Refused("subscript")
      parts.append(self.take()[1])
    self.take()
    return "".join(parts)

  def single(self):
    """A LaTeX argument: {..}, one digit of a number (\frac12) or one atom."""
    if self.peek()[1] == "{":
      self.take()
      return self.group("}")
    if self.peek()[0] == "num":
      digits = self.take()[1]
      if len(digits) > 1:
        self.tokens.insert(self.i, ("num", digits[1:]))
      return sympy.Integer(digits[0]) if digits[0].isdigit() else self.refuse(digits)
    return self.atom()

  @staticmethod
  def refuse(text):
    raise _Refused(f"unexpected {text!r}")

  def fraction(self):
    # \frac{a}{b}, or \frac12 with single-character arguments
    parts = [self.single(), self.single()]
    if parts[1] == 0:
      raise _Refused("division by zero")
    return parts[0] / parts[1]


def _split_top(text: str, sep: str) -> list[str]:
  parts, depth, start, i = [], 0, 0, 0
  while i < len(text):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif depth == 0 and text.startswith(sep, i):
      parts.append(text[start:i])
      start = i + len(sep)
      i = start
      continue
    i += 1
  parts.append(text[start:])
  return parts


def _closing(text: str, open_at: int) -> int | None:
  depth = 0
  for i in range(open_at, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if depth == 0:
        return i
  return None


def _parse_item(text: str):
  try:
    return _parse_expression(text)
  except _Refused:
    sides = re.split(r"(?<![<>!])=", text)
    if len(sides) < 2 or re.search(r"\d", sides[0]):
      raise
    return _parse(sides[-1])  # a named quantity, (p,q) = (3,2): its value


def _parse_expression(text: str):
  text, matrices = _matrix_operands(text)
  parser = _Parser(_tokenize(text), matrices)
  value = parser.relation()
  if parser.i != len(parser.tokens):
    raise _Refused(f"trailing {parser.peek()[1]!r}")
  if isinstance(value, _Relation):
    return value
  if isinstance(value, sympy.MatrixBase):  # 2A, A + B, AB evaluated
    return _Group("matrix", tuple(_Group("row", tuple(_Value(e, parser.approx) for e in row))
                                  for row in value.tolist()))
  lone = [v for k, v in parser.tokens if v not in "+-"]
  decimals = len(lone[0].split(".")[1]) if len(lone) == 1 and "." in lone[0] else None
  return _Value(value, parser.approx, decimals)


_MATRIX = re.compile(r"\\begin\{([pbBv]?matrix|smallmatrix|array)\}(.*)\\end\{\1\}", re.DOTALL)


def _matrix_operands(text: str) -> tuple[str, list]:
  """An expression with each matrix in it (2\\begin{pmatrix}..\\end{pmatrix}, a sum, a product)
  replaced by a placeholder character, and the (sympy matrix, approx) each stands for."""
  matrices = []

  def operand(m: re.Match) -> str:
    parsed = _matrix(m.group(0))
    if parsed is None or len(matrices) >= _MAX_MATRICES:
      raise _Refused(f"not a matrix: {m.group(0)[:40]!r}")
    if isinstance(parsed, _Value):  # a determinant
      matrices.append((parsed.expr, parsed.approx))
    else:
      rows = [[cell.expr for cell in row.items] for row in parsed.items]
      if any(not isinstance(cell, _Value) for row in parsed.items for cell in row.items) \
          or len({len(row) for row in rows}) != 1:
        raise _Refused("a matrix with ragged rows or non-number entries")
      matrices.append((sympy.ImmutableMatrix(rows),
                       any(cell.approx for row in parsed.items for cell in row.items)))
    return chr(0xE100 + len(matrices) - 1)

  return _ENVIRONMENT.sub(operand, text), matrices


def _matrix(text: str) -> "_Group | _Value | None":
  """\\begin{pmatrix} a & b \\\\ c & d \\end{pmatrix} (also bmatrix, matrix, array) as a
  "matrix" group of "row" groups; None if the text is not one whole matrix."""
  m = _MATRIX.fullmatch(text)
  if m is None or m.group(1) == "Bmatrix" or f"\\end{{{m.group(1)}}}" in m.group(2):
    return None  # not one matrix: A + B
  body = m.group(2)
  if m.group(1) == "array":  # its column spec: \\begin{array}{cc}
    body = re.sub(r"^\s*\{[^{}]*\}", "", body)
  rows = [r for r in re.split(r"\\\\", body) if r.strip()]
  matrix = _Group("matrix", tuple(_Group("row", tuple(_parse_item(c) for c in r.split("&")))
                                  for r in rows))
  if m.group(1) == "vmatrix":  # a determinant
    entries = [[cell.expr for cell in row.items] for row in matrix.items]
    if len({len(r) for r in entries}) != 1 or len(entries) != len(entries[0]) or len(entries) > 6:
      raise _Refused("determinant of a non-square or large matrix")
    return _Value(sympy.Matrix(entries).det(), any(c.approx for r in matrix.items for c in r.items))
  return matrix


def _parse(text: str):
  """A normalized answer as _Value, _Relation or _Group; raises _Refused."""
  text = text.strip()
  if not text:
    raise _Refused("empty")
  if text == r"\emptyset":
    return _Group("set", ())
  if text[0] == "{" and (_braced(text, 0) or ("", 0))[1] == len(text):  # a LaTeX group {1,3}
    return _parse(text[1:-1])
  m = re.fullmatch(r"[(\[]\s*(\\begin\{(\w+)\}.*\\end\{\2\})\s*[)\]]", text, re.DOTALL)
  if m:  # (\begin{pmatrix}..\end{pmatrix}), [\begin{array}..\end{array}]
    return _parse(m.group(1))
  approximations = _split_top(text, r"\approx")
  if len(approximations) > 1:  # x = 1/3 \approx 0.33: the exact value; x \approx 11: x = 11
    head = approximations[0].strip()
    return _parse(head if not re.fullmatch(r"[a-zA-Z]", head) else f"{head} = {approximations[-1]}")
  plus_minus = _split_top(text, r"\pm")
  if len(plus_minus) == 2:  # a \pm b: both
    left, right = plus_minus[0].strip(), plus_minus[1].strip()
    return _Group("list", (_parse_item(f"{left}+({right})"), _parse_item(f"{left}-({right})")))
  matrix = _matrix(text)
  if matrix is not None:
    return matrix
  unions = _split_top(text, r"\cup")
  if len(unions) > 1:
    return _union(tuple(_parse(u) for u in unions))
  builder = _SET_BUILDER.fullmatch(text)
  if builder:  # \{x \mid x > 2\}: the condition, which compares as a bound
    return _parse(builder.group(1))
  if text.startswith(r"\{") and text.endswith(r"\}"):
    inner = text[2:-2]
    return _Group("set", tuple(_parse(p) for p in _split_top(inner, ",")))
  if text[0] in "([" and text[-1] in ")]" and _closing(text, 0) == len(text) - 1:
    parts = _split_top(text[1:-1], ",")
    if len(parts) > 1:
      return _Group("bracket", tuple(_parse_item(p) for p in parts), text[0], text[-1])
  parts = _split_top(text, ",")
  if len(parts) > 1:
    items = tuple(_parse(p) for p in parts if p.strip())
    intervals = [_as_interval(i) if isinstance(i, _Relation) else None for i in items]
    if all(intervals):  # x < -2, x > 3 (from "x < -2 or x > 3")
      return _union(tuple(intervals))
    return _assignments(items) or _Group("list", items)
  return _parse_item(text)


def _assignments(items: tuple) -> _Group | None:
  """p = 5, q = 2; p = 7, q = 2 (NuminaMath's way of listing solutions) as the list of tuples
  (5, 2), (7, 2): the same names assigned in the same order, round after round. None for
  anything else (x = 1, x = 2 stays a list of values)."""
  names = [i.sides[0].expr if isinstance(i, _Relation) and i.ops == ("=",)
           and isinstance(i.sides[0].expr, sympy.Symbol) else None for i in items]
  if None in names:
    return None
  width = len(set(names))
  rounds = len(names) // width
  if width < 2 or rounds < 2 or names != names[:width] * rounds:
    return None
  return _Group("list", tuple(
      _Group("bracket", tuple(i.sides[1] for i in items[k:k + width]), "(", ")")
      for k in range(0, len(items), width)))


_SET_BUILDER = re.compile(r"\\\{\s*[a-zA-Z]\s*(?:\\mid|\||:)\s*(.+)\\\}", re.DOTALL)


def _union(items: tuple) -> _Group:
  """A union, flat; of finite sets only, the one set of all their elements."""
  if all(isinstance(i, _Group) and i.kind == "set" for i in items):
    return _Group("set", tuple(e for i in items for e in i.items))
  return _Group("union", tuple(e for i in items
                               for e in (i.items if isinstance(i, _Group) and i.kind == "union"
                                         else (i,))))


# --------------------------------------------------------------------------- comparison


def _terminates(x) -> bool:
  """Whether the rational x has a finite decimal expansion (its denominator is 2^a 5^b)."""
  q = int(x.q)
  for prime in (2, 5):
    while q % prime == 0:
      q //= prime
  return q == 1


def _numbers_equal(p: _Value, g: _Value) -> bool:
  pe, ge = p.expr, g.expr
  if pe.has(sympy.oo, -sympy.oo, sympy.zoo) or ge.has(sympy.oo, -sympy.oo, sympy.zoo):
    return pe == ge
  if pe == ge:
    return True
  exact_decimals = [x.is_Rational and _terminates(x) for x in (pe, ge)]
  if all(exact_decimals):  # 1.0000001 != 1, 1e-7 != 2e-7
    return False
  half_unit = None if g.decimals is None else 0.5 * 10.0 ** -g.decimals
  if half_unit is not None and not exact_decimals[0] and half_unit <= _ROUNDED_GOLD * abs(ge):
    # a gold rounded to 3 or more significant digits: 33.3 for 100/3 (but 0.3 is not 1/3)
    return abs(complex(sympy.N(pe - ge, 30))) <= half_unit * (1 + 1e-9)
  if p.approx or g.approx:  # a decimal for a value without a finite expansion: 0.3333333
    pv, gv = complex(sympy.N(pe, 30)), complex(sympy.N(ge, 30))
    return abs(pv - gv) <= (_REL_TOL * abs(gv) if gv != 0 else _ZERO_TOL)
  if pe.is_Rational and ge.is_Rational:
    return False
  difference = abs(complex(sympy.N(pe - ge, _DIGITS)))
  return difference <= _EXACT_TOL * max(abs(complex(sympy.N(ge, _DIGITS))), 1e-300)


def _positive(expr):
  """`expr` with each of its symbols a positive real (the convention for variables), unless
  it takes an absolute value or a sign, which a positive variable would hide."""
  if expr.has(sympy.Abs, sympy.sign):
    return expr
  return expr.subs({s: sympy.Symbol(s.name, positive=True) for s in expr.free_symbols})


def _at_sample_points(exprs, approx: bool) -> list[tuple[complex, ...]]:
  """The values of `exprs` at _SAMPLE_POINTS rational points of their symbols, positive ones
  and, where an absolute value or sign could tell them apart, negative ones too. Points where
  one is undefined are left out."""
  names = sorted({s.name for e in exprs for s in e.free_symbols})
  negatives = any(e.has(sympy.Abs, sympy.sign) for e in exprs)
  values = []
  for trial in range(_SAMPLE_POINTS):
    sign = -1 if negatives and trial % 2 else 1
    point = {name: sign * sympy.Rational(37 + 11 * k + 5 * trial, 23 + 3 * trial)
             for k, name in enumerate(names)}
    try:
      row = tuple(complex(sympy.N(e.subs({s: point[s.name] for s in e.free_symbols}),
                                  30 if approx else _DIGITS)) for e in exprs)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
      continue
    if all(math.isfinite(abs(v)) for v in row):
      values.append(row)
  return values


def _close(a: complex, b: complex, approx: bool) -> bool:
  tolerance = _REL_TOL if approx else _EXACT_TOL
  return abs(a - b) <= tolerance * abs(b) if b != 0 else abs(a) <= _ZERO_TOL


def _values_equal(p: _Value, g: _Value) -> bool:
  """Numbers by value; expressions in variables when they agree at every sample point (taken
  positive, so \\sqrt{1/n} = 1/\\sqrt{n} and \\sqrt{x^2} = x, but |x| != x)."""
  pe, ge = p.expr, g.expr
  approx = p.approx or g.approx
  if pe.is_number and ge.is_number:
    return _numbers_equal(p, g)
  if pe == ge:
    return True
  values = _at_sample_points((_positive(pe), _positive(ge)), approx)
  return len(values) >= _SAMPLE_POINTS // 2 and all(_close(a, b, approx) for a, b in values)


def _proportional(pd, gd) -> bool:
  """Whether pd = c gd for one non-zero constant c (both sides of an equation moved left)."""
  if gd == 0:
    return False
  values = _at_sample_points((_positive(pd), _positive(gd)), False)
  ratios = [a / b for a, b in values if b != 0]
  return (len(ratios) >= _SAMPLE_POINTS // 2 and ratios[0] != 0
          and all(_close(r, ratios[0], False) for r in ratios))


def _lone_symbol(value: _Value) -> bool:
  return isinstance(value.expr, sympy.Symbol)


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _bound_subject(side: _Value):
  """(quantity, sign, absolute) when a side of a bound names a quantity up to sign: x, -x,
  f(x) (read f*x), AB, |z|; else None. Anything with another number in it (2x - 1 > 5) is an
  unsolved inequality, not a bound."""
  coefficient, rest = side.expr.as_coeff_Mul()
  absolute = isinstance(rest, sympy.Abs)
  if absolute:
    rest = rest.args[0]
  factors = rest.args if isinstance(rest, sympy.Mul) else (rest,)
  if coefficient not in (1, -1) or not all(isinstance(f, sympy.Symbol) for f in factors):
    return None
  return rest, int(coefficient), absolute


def _real(side: _Value) -> bool:
  return bool(side.expr.is_number and side.expr.is_real is not False)


def _interval(low: _Value, high: _Value, closed_low: bool, closed_high: bool) -> _Group:
  return _Group("bracket", (low, high), "[" if closed_low else "(", "]" if closed_high else ")")


def _negated(value: _Value) -> _Value:
  return _Value(-value.expr, value.approx)


_INF, _NEG_INF = _Value(sympy.oo, False), _Value(-sympy.oo, False)


def _solved(rel: _Relation):
  """(quantity, interval or union) of a solved bound: x > 3, 3 < x, -x > -1 (x < 1), x != 2,
  1 < x <= 2, 0 < f(x) < 1, |x| < 2, 1 <= |z| <= 3/2; else None."""
  sides, ops = rel.sides, rel.ops
  if len(sides) == 2 and ops != ("=",):
    if _bound_subject(sides[1]) and _real(sides[0]):  # 3 < x is x > 3
      sides, ops = sides[::-1], (_FLIP.get(ops[0], ops[0]),)
    if not (_bound_subject(sides[0]) and _real(sides[1])):
      return None
    (subject, sign, absolute), op, bound = _bound_subject(sides[0]), ops[0], sides[1]
    if sign < 0:  # -x > -1 is x < 1
      op, bound = _FLIP.get(op, op), _negated(bound)
    if op == "!=" and not absolute:
      return subject, _Group("union", (_interval(_NEG_INF, bound, False, False),
                                       _interval(bound, _INF, False, False)))
    if op not in _FLIP:
      return None
    low, high = (bound, None) if op[0] == ">" else (None, bound)
    return subject, _bounded(low, high, op == ">=", op == "<=", absolute)
  if len(sides) == 3 and _bound_subject(sides[1]) and _real(sides[0]) and _real(sides[2]) \
      and ops[0] in _FLIP and ops[1] in _FLIP and ops[0][0] == ops[1][0]:
    subject, sign, absolute = _bound_subject(sides[1])
    low, high, closed_low, closed_high = sides[0], sides[2], ops[0][-1] == "=", ops[1][-1] == "="
    if ops[0][0] == ">":  # 3 > x > 1
      low, high, closed_low, closed_high = high, low, closed_high, closed_low
    if sign < 0:  # 1 < -x < 3 is -3 < x < -1
      low, high, closed_low, closed_high = (_negated(high), _negated(low), closed_high,
                                            closed_low)
    return subject, _bounded(low, high, closed_low, closed_high, absolute)
  return None


def _bounded(low, high, closed_low: bool, closed_high: bool, absolute: bool) -> _Group:
  """The values of x with low < x < high (either end may be None: unbounded), or with
  low < |x| < high when `absolute`."""
  if not absolute:
    return _interval(low or _NEG_INF, high or _INF, closed_low and low is not None,
                     closed_high and high is not None)
  if low is None or low.expr < 0 or (low.expr == 0 and closed_low):  # |x| < 2: one interval
    if high is None:
      return _interval(_NEG_INF, _INF, False, False)
    return _interval(_negated(high), high, closed_high, closed_high)
  if high is None:  # |x| > 2
    return _Group("union", (_interval(_NEG_INF, _negated(low), False, closed_low),
                            _interval(low, _INF, closed_low, False)))
  return _Group("union", (_interval(_negated(high), _negated(low), closed_high, closed_low),
                          _interval(low, high, closed_low, closed_high)))


def _as_interval(rel: _Relation) -> _Group | None:
  """A solved bound as its interval or union (else None)."""
  solved = _solved(rel)
  return None if solved is None else solved[1]


def _same_elements(ps, gs) -> bool:
  """Set equality: repeated elements count once."""
  return (all(any(_equal(p, g) for g in gs) for p in ps)
          and all(any(_equal(p, g) for p in ps) for g in gs))


def _vector(group: _Group) -> tuple | None:
  """The entries of a one-column or one-row matrix (else None)."""
  if group.kind != "matrix":
    return None
  if len(group.items) == 1:
    return group.items[0].items
  if all(len(row.items) == 1 for row in group.items):
    return tuple(row.items[0] for row in group.items)
  return None


def _unordered_equal(ps, gs) -> bool:
  if len(ps) != len(gs):
    return False
  unused = list(gs)
  for p in ps:
    match = next((k for k, g in enumerate(unused) if _equal(p, g)), None)
    if match is None:
      return False
    unused.pop(match)
  return True


def _chain_ends(value):
  """x = 5+5+1 = 11 as x = 11: a chain of equalities is graded by its ends. A true equality of
  numbers (2 \\cdot 3 = 6, as a worked line ends) is its value; a false one (3 = 4) stays a
  relation, which no number equals."""
  if not isinstance(value, _Relation) or set(value.ops) != {"="}:
    return value
  if all(side.expr.is_number for side in value.sides) \
      and all(_values_equal(side, value.sides[-1]) for side in value.sides[:-1]):
    return value.sides[-1]
  if len(value.sides) > 2:
    return _Relation(("=",), (value.sides[0], value.sides[-1]))
  return value


def _named(side: _Value) -> bool:
  """A left side that names the quantity (x, f(x), AB, a_3), with no number in it."""
  expr = side.expr
  return bool(expr.free_symbols) and all(abs(n) == 1 for n in expr.atoms(sympy.Number))


def _equal(p, g) -> bool:
  p, g = _chain_ends(p), _chain_ends(g)
  if isinstance(p, _Relation) and isinstance(g, _Relation):
    ps, gs = _solved(p), _solved(g)
    if ps is not None and gs is not None:  # x > 3 is not y > 3
      return ps[0] == gs[0] and _equal(ps[1], gs[1])
    if p.ops == g.ops == ("=",):
      if _lone_symbol(p.sides[0]) and _lone_symbol(g.sides[0]):
        return p.sides[0].expr == g.sides[0].expr and _values_equal(p.sides[1], g.sides[1])
      return _proportional(p.sides[0].expr - p.sides[1].expr, g.sides[0].expr - g.sides[1].expr)
    return False
  if isinstance(p, _Relation):
    interval = _as_interval(p)
    if interval is not None:
      return _equal(interval, g)
    if p.ops == ("=",) and _named(p.sides[0]):
      return _equal(p.sides[1], g)
    return False
  if isinstance(g, _Relation):
    interval = _as_interval(g)
    if interval is not None:
      return _equal(p, interval)
    if g.ops == ("=",) and _named(g.sides[0]):
      return _equal(p, g.sides[1])
    return False
  if isinstance(p, _Group) and isinstance(g, _Group):
    if p.kind == g.kind and p.kind in ("matrix", "row"):
      return len(p.items) == len(g.items) and all(_equal(a, b) for a, b in zip(p.items, g.items))
    if "matrix" in (p.kind, g.kind):  # a column or row vector against a tuple
      matrix, other = (p, g) if p.kind == "matrix" else (g, p)
      entries = _vector(matrix)
      if entries is None or (other.kind, other.left, other.right) != ("bracket", "(", ")") \
          or len(entries) != len(other.items):
        return False
      pairs = zip(entries, other.items) if matrix is p else zip(other.items, entries)
      return all(_equal(a, b) for a, b in pairs)
    unordered = {"list", "set"}
    if p.kind in unordered and g.kind in unordered:
      return _same_elements(p.items, g.items)
    tuple_kinds = {p.kind, g.kind} == {"list", "bracket"}
    if tuple_kinds and (g.left, g.right) in (("", ""), ("(", ")")) \
        and (p.left, p.right) in (("", ""), ("(", ")")):  # 1, 3 for the pair (1, 3)
      return len(p.items) == len(g.items) and all(_equal(a, b) for a, b in zip(p.items, g.items))
    if p.kind == g.kind == "bracket":
      return (p.left == g.left and p.right == g.right and len(p.items) == len(g.items)
              and all(_equal(a, b) for a, b in zip(p.items, g.items)))
    if p.kind == g.kind == "union":
      return _unordered_equal(p.items, g.items)
    return False
  if isinstance(p, _Group) or isinstance(g, _Group):
    single = p if isinstance(g, _Group) else g
    group = g if isinstance(g, _Group) else p
    if group.kind in ("set", "list", "union") and len(group.items) == 1:
      return _equal(single, group.items[0]) if group is g else _equal(group.items[0], single)
    return False
  return _values_equal(p, g)


def _percent(text: str) -> tuple[str, bool]:
  stripped = re.sub(r"\\?%$", "", text.strip()).strip()
  return stripped, stripped != text.strip()


def _text_key(text: str) -> str:
  key = re.sub(r"\s+", "", text).lower().strip(".")
  m = re.fullmatch(r"\(([a-z])\)", key)
  return m.group(1) if m else key


def is_equivalent(answer: str, gold: str) -> bool:
  """Whether an extracted answer equals the gold answer (both raw strings)."""
  if len(answer) > _MAX_ANSWER_CHARS:
    return False
  choice = _CHOICE.match(answer)
  answer, gold = normalize(answer), normalize(gold)
  if not answer:
    return False
  if choice and choice.group(1).lower() == _text_key(gold):  # \textbf{(D)}\ 12 for D
    return True
  return any(_normalized_equal(a, g) for a in _readings(answer) for g in _readings(gold))


# A multiple-choice letter in parentheses opening an answer, as AMC solutions give the choice
# with its value: \textbf{(D)}\ 12, (D) 12.
_CHOICE = re.compile(r"\s*(?:\\text\w*\s*\{\s*)?\(([A-E])\)")


def _readings(text: str) -> list[str]:
  """A normalized answer and, for 1,5, its decimal-comma reading beside the list's."""
  decimal = _decimal_comma(text)
  return [text] if decimal is None else [text, decimal]


def _normalized_equal(answer: str, gold: str) -> bool:
  if _text_key(answer) == _text_key(gold):
    return True
  answer, answer_pct = _percent(answer)
  gold, gold_pct = _percent(gold)
  try:
    p, g = _parse(answer), _parse(gold)
  except (_Refused, RecursionError, ValueError, TypeError, ZeroDivisionError, OverflowError):
    return False
  # A gold written as a fraction is a ratio (a probability, a share), and X% of it means X/100:
  # 12.5\% is 1/8, \frac{1}{8}\% is not. A bare whole or decimal gold may be the percentage.
  ratio_gold = answer_pct and not gold_pct and re.search(r"\\frac|/", gold)
  try:
    if not ratio_gold and _equal(p, g):
      return True
    if (gold_pct or answer_pct) and isinstance(p, _Value) and isinstance(g, _Value):
      scaled = g.expr / 100 if gold_pct else g.expr * 100
      return _values_equal(p, _Value(scaled, g.approx))
  except (_Refused, RecursionError, ValueError, TypeError, ZeroDivisionError, OverflowError,
          AttributeError):
    return False
  return False


@dataclasses.dataclass(frozen=True)
class Verdict:
  correct: bool
  reason: str  # extraction reason, "wrong", "correct", "timeout" or "error: ..."


def gold_answer(gold: str) -> str:
  """The gold's final answer: a worked solution (with a box, a closed think block or an
  answer phrase) gives its answer as a response would; any other gold is the answer."""
  if _BOX.search(gold) or "</think>" in gold or _PHRASE.search(gold):
    extracted = extract_answer(gold)
    if extracted.answer is not None:
      return extracted.answer
  return gold


def verify(response: str, gold: str) -> Verdict:
  """Extract the final answer from a whole response and compare it with `gold`."""
  extracted = extract_answer(response)
  if extracted.answer is None:
    return Verdict(False, extracted.reason)
  correct = is_equivalent(extracted.answer, gold_answer(gold))
  return Verdict(correct, "correct" if correct else "wrong")


def _math_verify_check(response: str, gold: str) -> Verdict:
  import logging

  import math_verify  # optional backend: pip install 'math-verify[antlr4_13_2]'
  # Its own signal-based timeouts are off: the pool's process kill bounds every check.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  gold_parsed = math_verify.parse(f"${gold}$" if "$" not in gold else gold,
                                  parsing_timeout=None)
  answer = math_verify.parse(response, parsing_timeout=None)
  correct = bool(math_verify.verify(gold_parsed, answer, timeout_seconds=None))
  return Verdict(correct, "correct" if correct else "wrong")


BACKENDS = {"longrl": verify, "math_verify": _math_verify_check}

# --------------------------------------------------------------------------- the pool


def _worker(connection, backend: str):
  check = BACKENDS[backend]
  connection.send("ready")  # imports done: the time limit counts checking only
  while True:
    try:
      job = connection.recv()
    except EOFError:
      return
    if job is None:
      return
    index, response, gold = job
    try:
      verdict = check(response, gold)
    except Exception as e:  # a verifier bug must cost one answer, not the pool
      verdict = Verdict(False, f"error: {type(e).__name__}: {e}"[:200])
    connection.send((index, verdict))


class MathVerifier:
  """Checks (response, gold) pairs in `workers` processes, each check bounded by `timeout`
  seconds: a worker that runs over is killed (SIGKILL) and replaced, and the check scores
  false with reason "timeout". Use as a context manager or call `close()`."""

  def __init__(self, *, workers: int = 2, timeout: float = 5.0, backend: str = "longrl"):
    if backend not in BACKENDS:
      raise ValueError(f"MathVerifier: unknown backend {backend!r}; valid: {sorted(BACKENDS)}")
    if workers < 1 or timeout <= 0:
      raise ValueError(f"MathVerifier: workers={workers}, timeout={timeout}; need >= 1 and > 0")
    self.timeout, self.backend = timeout, backend
    self._context = multiprocessing.get_context("spawn")
    self._workers = [self._start() for _ in range(workers)]

  def _start(self):
    ours, theirs = self._context.Pipe()
    process = self._context.Process(target=_worker, args=(theirs, self.backend), daemon=True)
    process.start()
    theirs.close()
    if not ours.poll(120) or ours.recv() != "ready":
      process.kill()
      raise RuntimeError(f"MathVerifier: a {self.backend} worker did not start")
    return process, ours

  def check(self, response: str, gold: str) -> Verdict:
    return self.check_batch([(response, gold)])[0]

  def check_batch(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
    verdicts: list[Verdict | None] = [None] * len(pairs)
    pending = list(enumerate(pairs))[::-1]
    busy: dict[int, tuple[int, float]] = {}  # worker slot -> (job index, deadline)
    while pending or busy:
      for slot in range(len(self._workers)):
        if slot not in busy and pending:
          index, (response, gold) = pending.pop()
          self._workers[slot][1].send((index, response, gold))
          busy[slot] = (index, time.monotonic() + self.timeout)
      connections = {self._workers[s][1]: s for s in busy}
      wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
      for connection in multiprocessing.connection.wait(list(connections), timeout=wait):
        slot = connections[connection]
        try:
          index, verdict = connection.recv()
        except (EOFError, OSError):  # the worker died (e.g. out of memory)
          index, verdict = busy[slot][0], Verdict(False, "error: worker died")
          self._replace(slot)
        verdicts[index] = verdict
        del busy[slot]
      now = time.monotonic()
      for slot, (index, deadline) in list(busy.items()):
        if now >= deadline:
          verdicts[index] = Verdict(False, "timeout")
          self._replace(slot)
          del busy[slot]
    return verdicts

  def _replace(self, slot: int):
    process, connection = self._workers[slot]
    process.kill()
    process.join()
    connection.close()
    self._workers[slot] = self._start()

  def close(self):
    for process, connection in self._workers:
      try:
        connection.send(None)
      except OSError:
        pass
      process.join(timeout=1)
      if process.is_alive():
        process.kill()
        process.join()
      connection.close()
    self._workers = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
