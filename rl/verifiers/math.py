"""Math answers: final-answer extraction, equivalence by value, and a time-bounded pool.

Owns what counts as a correct final answer (the conventions below) and how a check is bounded
in time. It does not own prompts or datasets (rl/tasks/math.py) or rewards (rl/rewards.py).

Extraction (`extract_answer`): the text after the last `</think>` (an opened, never closed
think block is a truncated response: no answer); there, the last `\\boxed{}` / `\\fbox{}`, and
if several boxes hold different answers the response hedges and scores false; without a box,
the text after the last "final answer" / "answer is" / "Answer:".

Equivalence (`is_equivalent`), by value: 2/4 = 1/2, 2^{10} = 1024, 3\\frac{1}{2} = 7/2,
i^2 = -1. When either side is written as a decimal the two agree within 1e-6 relative to
max(1, |gold|); exact values compare exactly however large or small (10^{20} != 10^{20}+1).
`x=2` equals `2` but not `y=2`; equations equal when one is a non-zero multiple of the other;
intervals need the same endpoints and brackets; sets, bare lists and unions ignore order,
tuples keep it; a solved bound (`x > 3`, `1 < x \\le 2`) equals its interval, an unsolved
inequality does not. A gold of X% accepts X, X% and X/100; a bare gold X never accepts 100X
(though it accepts X%). Units and `\\text{}` are dropped, never converted; text compares
case-insensitively; `1,000` is a thousand and `1,5` a decimal comma.

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
_MAX_DIGITS = 5000  # exact integers beyond this many digits are refused, not built
_REL_TOL = 1e-6

# --------------------------------------------------------------------------- extraction


@dataclasses.dataclass(frozen=True)
class Extracted:
  answer: str | None
  reason: str  # "boxed", "phrase", "no answer", "hedged", "truncated", "unbalanced"


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
_PHRASE = re.compile(r"(?:final answer|answer is|answer:)", re.IGNORECASE)


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


def extract_answer(response: str) -> Extracted:
  if "</think>" in response:
    response = response[response.rindex("</think>") + len("</think>"):]
  elif "<think>" in response:
    return Extracted(None, "truncated")
  boxes = _boxes(response)
  if boxes is None:
    return Extracted(None, "unbalanced")
  if boxes:
    distinct = list(dict.fromkeys(normalize(b) for b in boxes))
    if any(not is_equivalent(other, distinct[-1]) for other in distinct[:-1]):
      return Extracted(None, "hedged")
    return Extracted(boxes[-1], "boxed")
  phrases = list(_PHRASE.finditer(response))
  if not phrases:
    return Extracted(None, "no answer")
  tail = response[phrases[-1].end():].strip().lstrip(":").strip()
  tail = re.sub(r"^is\b", "", tail).strip().lstrip(":").strip()
  line = tail.split("\n", 1)[0].strip()
  line = re.sub(r"\.\s.*$", "", line)  # first sentence only
  line = line.strip().rstrip(".").strip().strip("$").strip()
  return Extracted(line or None, "phrase" if line else "no answer")


# --------------------------------------------------------------------------- normalization

_DROP = [r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad",
         r"\(", r"\)", r"\[", r"\]", r"\$", "$", "~"]
_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|operatorname|mbox|rm)\s*\{")
_UNIT_WORD = re.compile(r"(?<=[\d}).])\s*(?:[a-zA-Z]{2,}|[a-zA-Z]{2,}\^\{?\d\}?)\.?\s*$")


def _unwrap(text: str, keep: bool) -> str:
  """Replace \\text{..}-style groups with their content (keep) or drop them."""
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
    out.append(f" {group[0]} " if keep else " ")
    i = group[1]


def normalize(text: str) -> str:
  text = text.strip()
  for token in _DROP:
    text = text.replace(token, " " if token.startswith("\\") and token[1:].isalpha() else "")
  text = re.sub(r"\\[dt]frac", r"\\frac", text)
  text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", text)
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
  while True:
    shorter = _UNIT_WORD.sub("", text).strip()
    if shorter == text or not shorter:
      break
    text = shorter
  if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
    text = text.replace(",", "")
  elif re.fullmatch(r"-?\d+,(?:\d{1,2}|\d{4,})", text):
    text = text.replace(",", ".")
  return text


# --------------------------------------------------------------------------- parsing


class _Refused(Exception):
  """The answer cannot be parsed or would be too costly to build."""


@dataclasses.dataclass(frozen=True)
class _Value:
  expr: Any  # sympy.Expr
  approx: bool  # written with a decimal point somewhere


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
  | (?P<op><=|>=|!=|\*\*|[-+*/^!=<>(),\[\]{}|])
  | (?P<name>[a-zA-Z])
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
  if base.is_Integer and exponent.is_Integer:
    if abs(int(exponent)) > _MAX_DIGITS * 4 or _int_digits(base) * abs(int(exponent)) > _MAX_DIGITS:
      raise _Refused("power too large")
  elif base.is_number and exponent.is_number and exponent.is_Integer is False:
    if exponent.is_Rational and abs(exponent) > _MAX_DIGITS:
      raise _Refused("power too large")
  if exponent.is_Integer and abs(int(exponent)) > _MAX_DIGITS * 4 and base.is_number:
    raise _Refused("power too large")
  return sympy.Pow(base, exponent)


def _factorial(x):
  if x.is_Integer and int(x) > 1000:
    raise _Refused("factorial too large")
  if x.is_number and not x.is_Integer:
    raise _Refused("factorial of a non-integer")
  return sympy.factorial(x)


class _Parser:
  """Recursive descent over the tokens: relations, then + -, then * / and juxtaposition,
  then unary minus, then ^ and !, then atoms (numbers, letters, \\frac, \\sqrt, groups)."""

  def __init__(self, tokens):
    self.tokens, self.i, self.depth, self.approx = tokens, 0, 0, False

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
    return (kind in ("num", "name", "func") or value in ("(", "[", "{", "|")
            or (kind == "cmd" and (value in (r"\frac", r"\sqrt", r"\pi", r"\infty")
                                   or value[1:] in _GREEK)))

  def term(self):
    value = self.unary()
    while True:
      kind, op = self.peek()
      if op in ("*", "/") or op in _MUL_CMDS or op == r"\div":
        self.take()
        rhs = self.unary()
        if op in ("/", r"\div"):
          if rhs == 0:
            raise _Refused("division by zero")
          value = value / rhs
        else:
          value = value * rhs
      elif self.starts_atom() and op != "|":
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
    if kind == "name":
      if value == "i":
        return sympy.I
      if value == "e":
        return sympy.E
      return sympy.Symbol(value)
    if kind == "func":  # \sin(x)^2 and \sin^2 x square the sine; \sin x^2 does not
      exponent = None
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
    if kind == "cmd" and value[1:] in _GREEK:
      return sympy.Symbol(value[1:])
    raise _Refused(f"unexpected {value!r}")

  def fraction(self):
    # \frac{a}{b}, or \frac12 with single-character arguments
    parts = []
    for _ in range(2):
      if self.peek()[1] == "{":
        self.take()
        parts.append(self.group("}"))
      elif self.peek()[0] == "num":
        digits = self.take()[1]
        parts.append(sympy.Integer(digits[0]))
        if len(digits) > 1:
          self.tokens.insert(self.i, ("num", digits[1:]))
      else:
        parts.append(self.atom())
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
  parser = _Parser(_tokenize(text))
  value = parser.relation()
  if parser.i != len(parser.tokens):
    raise _Refused(f"trailing {parser.peek()[1]!r}")
  return value if isinstance(value, _Relation) else _Value(value, parser.approx)


def _parse(text: str):
  """A normalized answer as _Value, _Relation or _Group; raises _Refused."""
  text = text.strip()
  if not text:
    raise _Refused("empty")
  unions = _split_top(text, r"\cup")
  if len(unions) > 1:
    return _Group("union", tuple(_parse(u) for u in unions))
  if text.startswith(r"\{") and text.endswith(r"\}"):
    inner = text[2:-2]
    return _Group("set", tuple(_parse_item(p) for p in _split_top(inner, ",")))
  if text[0] in "([" and text[-1] in ")]" and _closing(text, 0) == len(text) - 1:
    parts = _split_top(text[1:-1], ",")
    if len(parts) > 1:
      return _Group("bracket", tuple(_parse_item(p) for p in parts), text[0], text[-1])
  parts = _split_top(text, ",")
  if len(parts) > 1:
    return _Group("list", tuple(_parse(p) for p in parts))
  return _parse_item(text)


# --------------------------------------------------------------------------- comparison


def _numbers_equal(p, g, approx: bool) -> bool:
  if p.has(sympy.oo, -sympy.oo, sympy.zoo) or g.has(sympy.oo, -sympy.oo, sympy.zoo):
    return p == g
  if approx:
    pv, gv = complex(sympy.N(p, 30)), complex(sympy.N(g, 30))
    return abs(pv - gv) <= _REL_TOL * max(1.0, abs(gv))
  if p == g:
    return True
  if p.is_Rational and g.is_Rational:
    return False
  difference = sympy.N(p - g, 50)
  if difference != 0 and abs(complex(difference)) > 1e-30 * max(1, abs(complex(sympy.N(g, 30)))):
    return False
  return sympy.simplify(p - g) == 0


def _differ_at_sample_points(pe, ge) -> bool:
  """Cheap rejection before sympy.simplify: the two differ at some rational point."""
  symbols = sorted(pe.free_symbols | ge.free_symbols, key=str)
  for trial in range(3):
    point = {s: sympy.Rational(37 + 11 * k + 5 * trial, 23 + 3 * trial)
             for k, s in enumerate(symbols)}
    try:
      pv, gv = complex(sympy.N(pe.subs(point), 30)), complex(sympy.N(ge.subs(point), 30))
    except (TypeError, ValueError, ZeroDivisionError):
      continue
    if abs(pv - gv) > 1e-9 * max(1.0, abs(gv)):
      return True
  return False


def _values_equal(p: _Value, g: _Value) -> bool:
  pe, ge = p.expr, g.expr
  if pe.is_number and ge.is_number:
    return _numbers_equal(pe, ge, p.approx or g.approx)
  if pe == ge:
    return True
  if _differ_at_sample_points(pe, ge):
    return False
  return sympy.simplify(pe - ge) == 0


def _lone_symbol(value: _Value) -> bool:
  return isinstance(value.expr, sympy.Symbol)


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _as_interval(rel: _Relation) -> _Group | None:
  """A solved bound as an interval group: x > 3, 3 < x, 1 < x <= 2 (else None)."""
  sides, ops = rel.sides, rel.ops
  if any(op not in _FLIP for op in ops):
    return None
  inf, neg_inf = _Value(sympy.oo, False), _Value(-sympy.oo, False)
  if len(sides) == 2:
    if _lone_symbol(sides[0]) and sides[1].expr.is_number:
      op, bound = ops[0], sides[1]
    elif _lone_symbol(sides[1]) and sides[0].expr.is_number:
      op, bound = _FLIP[ops[0]], sides[0]
    else:
      return None
    if op in (">", ">="):
      return _Group("bracket", (bound, inf), "(" if op == ">" else "[", ")")
    return _Group("bracket", (neg_inf, bound), "(", ")" if op == "<" else "]")
  if len(sides) == 3 and _lone_symbol(sides[1]) and sides[0].expr.is_number \
      and sides[2].expr.is_number and ops[0][0] == ops[1][0] == "<":
    return _Group("bracket", (sides[0], sides[2]), "(" if ops[0] == "<" else "[",
                  ")" if ops[1] == "<" else "]")
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


def _equal(p, g) -> bool:
  if isinstance(p, _Relation) and isinstance(g, _Relation):
    pi, gi = _as_interval(p), _as_interval(g)
    if pi is not None and gi is not None:
      return _equal(pi, gi)
    if p.ops == g.ops == ("=",):
      if _lone_symbol(p.sides[0]) and _lone_symbol(g.sides[0]):
        return p.sides[0].expr == g.sides[0].expr and _values_equal(p.sides[1], g.sides[1])
      pd = p.sides[0].expr - p.sides[1].expr
      gd = g.sides[0].expr - g.sides[1].expr
      if gd == 0 or pd.free_symbols != gd.free_symbols:
        return False
      ratio = sympy.simplify(pd / gd)
      return bool(ratio.is_number and ratio != 0)
    return False
  if isinstance(p, _Relation):
    interval = _as_interval(p)
    if interval is not None:
      return _equal(interval, g)
    if p.ops == ("=",) and _lone_symbol(p.sides[0]) and not isinstance(g, _Relation):
      return _equal(p.sides[1], g)
    return False
  if isinstance(g, _Relation):
    interval = _as_interval(g)
    if interval is not None:
      return _equal(p, interval)
    if g.ops == ("=",) and _lone_symbol(g.sides[0]):
      return _equal(p, g.sides[1])
    return False
  if isinstance(p, _Group) and isinstance(g, _Group):
    if p.kind == g.kind == "bracket":
      return (p.left == g.left and p.right == g.right and len(p.items) == len(g.items)
              and all(_equal(a, b) for a, b in zip(p.items, g.items)))
    unordered = {"list", "set"}
    if (p.kind in unordered and g.kind in unordered) or p.kind == g.kind == "union":
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
  answer, gold = normalize(answer), normalize(gold)
  if not answer:
    return False
  if _text_key(answer) == _text_key(gold):
    return True
  answer, answer_pct = _percent(answer)
  gold, gold_pct = _percent(gold)
  try:
    p, g = _parse(answer), _parse(gold)
  except (_Refused, RecursionError, ValueError, TypeError, ZeroDivisionError, OverflowError):
    return False
  try:
    if _equal(p, g):
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


def verify(response: str, gold: str) -> Verdict:
  """Extract the final answer from a whole response and compare it with `gold`."""
  extracted = extract_answer(response)
  if extracted.answer is None:
    return Verdict(False, extracted.reason)
  correct = is_equivalent(extracted.answer, gold)
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
