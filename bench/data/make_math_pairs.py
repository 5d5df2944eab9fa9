"""Builds bench/data/math_pairs.jsonl, the labelled (response, gold) pairs that
bench/verifiers.py scores math verifiers on.

  python bench/data/make_math_pairs.py --math-verify DIR --qwen DIR [--out FILE]

DIR is a checked-out tree of github.com/huggingface/Math-Verify (its tests/ are read) and of
github.com/QwenLM/Qwen2.5-Math (evaluation/grader.py and evaluation/examples.py are read). The
upstream strings are copied verbatim; what this file adds is judgment: a class for every pair,
a note where the suite's label is a convention or, in our view, wrong, the gold answers of the
Qwen few-shot solutions, and the hand-written near-misses at the bottom. It owns none of the
verifiers and scores nothing.

Every record: response, gold, label (what a careful human grader says; where the suite's own
expectation differs the suite's label is kept and `note` starts with "disputed:"; where it is a
matter of convention, with "convention:"), source ("math-verify:<file>", "qwen2.5-math:<file>"
or "handwritten"), class, and for upstream pairs `case`, the pytest id or position it came from.
"""

import argparse
import ast
import json
import math
import pathlib
import re

CLASSES = ("number_format", "latex", "percent", "relation_interval", "set", "symbolic",
           "matrix_vector", "complex", "worked_gold", "prose_answer", "precision",
           "reward_hack", "other")

# ------------------------------------------------------------------ Math-Verify's tests
# Each parametrised test case is (gold, pred, expected); the pair is response=pred, gold=gold.

MV_CLASS = {  # (file, test) -> default class of its cases
    ("tests/test_all.py", "test_number_extraction"): "number_format",
    ("tests/test_all.py", "test_simple_fraction_notation"): "latex",
    ("tests/test_all.py", "test_sets_handling"): "relation_interval",
    ("tests/test_all.py", "test_latex_notation"): "latex",
    ("tests/test_all.py", "test_percent_notation"): "percent",
    ("tests/test_all.py", "test_latex_notation_math"): "latex",
    ("tests/test_all.py", "test_relations_math"): "relation_interval",
    ("tests/test_all.py", "test_matrix_extraction"): "matrix_vector",
    ("tests/test_all.py", "test_precision"): "precision",
    ("tests/test_all.py", "test_complex_math_expressions"): "symbolic",
    ("tests/test_all.py", "test_math_extraction_edge_cases"): "prose_answer",
    ("tests/test_all.py", "test_math_extraction_additional_cases"): "prose_answer",
    ("tests/test_all.py", "test_set_rel_assymetry"): "relation_interval",
    ("tests/test_all.py", "test_float_precision"): "number_format",
    ("tests/test_all.py", "test_sqrt_precision"): "precision",
    ("tests/test_all.py", "test_symbols"): "latex",
    ("tests/test_boxed.py", "test_boxed"): "worked_gold",
    ("tests/test_numina_cases.py", "test_numina_cases"): "set",
    ("tests/test_open_thoughts.py", "test_open_thoughts"): "set",
    ("tests/test_strict.py", "test_strict_variable_comparison"): "symbolic",
    ("tests/test_string_extraction.py", "test_string_extraction"): "other",
    ("tests/test_yujianll.py", "test_string_extraction"): "other",
}


def _ids(prefix, indices, value):
  return {f"{prefix}[{i}]": value for i in indices}


MV_CLASS_OVERRIDE = {
    **_ids("tests/test_all.py::test_latex_notation_math", (2, 3, 4), "worked_gold"),
    **_ids("tests/test_all.py::test_latex_notation_math", (8, 12, 15, 25), "number_format"),
    **_ids("tests/test_all.py::test_latex_notation_math", (13, 21), "set"),
    **_ids("tests/test_all.py::test_latex_notation_math", (17, 18), "other"),
    **_ids("tests/test_all.py::test_latex_notation_math", (19, 20, 23, 24, 27), "symbolic"),
    **_ids("tests/test_all.py::test_latex_notation_math", (22, 26, 29), "relation_interval"),
    **_ids("tests/test_all.py::test_matrix_extraction", (0,), "latex"),
    **_ids("tests/test_all.py::test_complex_math_expressions", (0, 1), "number_format"),
    **_ids("tests/test_all.py::test_complex_math_expressions", (4, 5, 7), "matrix_vector"),
    **_ids("tests/test_all.py::test_complex_math_expressions", (13,), "relation_interval"),
    **_ids("tests/test_all.py::test_math_extraction_edge_cases", (4,), "other"),
    **_ids("tests/test_all.py::test_math_extraction_edge_cases", (5, 8, 12), "number_format"),
    **_ids("tests/test_all.py::test_math_extraction_edge_cases", (9, 10), "latex"),
    **_ids("tests/test_all.py::test_math_extraction_edge_cases", (11,), "symbolic"),
    **_ids("tests/test_all.py::test_math_extraction_edge_cases", (13,), "worked_gold"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (0, 19, 28),
           "worked_gold"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (5, 9, 10, 11, 26),
           "latex"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (6, 7), "precision"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (13, 15), "percent"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (16, 18, 25),
           "relation_interval"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (20, 21), "other"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (22, 23, 24),
           "number_format"),
    **_ids("tests/test_all.py::test_math_extraction_additional_cases", (27,), "set"),
    **_ids("tests/test_boxed.py::test_boxed", (0,), "set"),
    **_ids("tests/test_numina_cases.py::test_numina_cases", (1, 3, 5, 8, 10, 21, 22, 24, 26, 27),
           "relation_interval"),
    **_ids("tests/test_numina_cases.py::test_numina_cases", (7, 11), "other"),
    **_ids("tests/test_numina_cases.py::test_numina_cases", (14, 15, 17, 29), "latex"),
    **_ids("tests/test_open_thoughts.py::test_open_thoughts", (1, 23, 24, 25), "symbolic"),
    **_ids("tests/test_open_thoughts.py::test_open_thoughts", (2, 4, 6, 7, 15, 16, 20, 21, 22),
           "relation_interval"),
    **_ids("tests/test_open_thoughts.py::test_open_thoughts", (3,), "other"),
    **_ids("tests/test_open_thoughts.py::test_open_thoughts", (8,), "number_format"),
    **_ids("tests/test_open_thoughts.py::test_open_thoughts", (10, 17), "latex"),
    **_ids("tests/test_yujianll.py::test_string_extraction", (0, 1, 6, 7, 10, 11), "set"),
    **_ids("tests/test_yujianll.py::test_string_extraction", (2, 3), "relation_interval"),
    **_ids("tests/test_yujianll.py::test_string_extraction", (4, 5, 8, 9), "symbolic"),
}

_CHAIN = ("convention: the chain is false as written ({}); the suite grades its last side")
MV_NOTE = {
    "tests/test_all.py::test_number_extraction[15]":
        "convention: the text also says 'the number is 10'; the suite takes the last number",
    **_ids("tests/test_all.py::test_latex_notation", (5, 6),
           "disputed: a human reads 9; math-verify does not read inline math split over lines"),
    **_ids("tests/test_all.py::test_relations_math", (10,), _CHAIN.format("5+5+1 = 7")),
    "tests/test_all.py::test_relations_math[13]":
        "convention: the chain is false as written; the suite grades the last side before "
        "\\approx",
    "tests/test_all.py::test_relations_math[16]":
        "convention: the suite grades x=1/3 and ignores the wrong approximation 1.3",
    "tests/test_all.py::test_relations_math[21]":
        "convention: a malformed gold chain; the suite grades its last side, 0",
    **_ids("tests/test_all.py::test_relations_math", (26,), _CHAIN.format("3+3 = 2")),
    "tests/test_all.py::test_matrix_extraction[5]":
        "convention: the response leaves the sum unevaluated; it is equal in value",
    "tests/test_all.py::test_matrix_extraction[6]":
        "convention: the response leaves the product unevaluated; it is equal in value",
    "tests/test_all.py::test_precision":
        "convention: the suite compares at 4 decimals (precision=4)",
    "tests/test_all.py::test_complex_math_expressions[4]":
        "string: the upstream literal is not raw, so \\f became a form feed (same on both sides)",
    "tests/test_all.py::test_complex_math_expressions[7]":
        "convention: the suite compares at 2 decimals (precision=2); 0.33 is 1/3 only to 2",
    "tests/test_all.py::test_complex_math_expressions[13]":
        "convention: the suite compares at 2 decimals (precision=2); 2.6667 is 8/3 only to 4",
    "tests/test_all.py::test_set_rel_assymetry[2]":
        "convention: the suite expects this only with allow_set_relation_comp=True; with its "
        "default (False) it expects no match (that case is left out)",
    "tests/test_all.py::test_symbols[0]":
        "disputed: the literal is not raw, so \\t became a TAB; the intended gold \\text{13} is "
        "13 to a human, and the suite expects no match",
    "tests/test_all.py::test_math_extraction_additional_cases[6]":
        "convention: {1,3} is a LaTeX brace group that renders as 1,3: read in order it is "
        "(1,3), not (3,1)",
    "tests/test_all.py::test_math_extraction_additional_cases[7]":
        "convention: {1,3} is a LaTeX brace group that renders as 1,3: read in order it is (1,3)",
    "tests/test_all.py::test_math_extraction_additional_cases[19]":
        "convention: the response calls (-6, 10) an interval; the gold is the pair (A, B)",
    "tests/test_all.py::test_math_extraction_additional_cases[24]":
        "convention: '32, 349' with a space reads as two numbers, not 32349",
    "tests/test_numina_cases.py::test_numina_cases[3]": "convention: equal only for real z",
    "tests/test_numina_cases.py::test_numina_cases[24]":
        "string: raw literal with doubled backslashes and an unclosed box",
    "tests/test_open_thoughts.py::test_open_thoughts[28]":
        "convention: the gold's two boxes are separated by prose, so the suite does not read "
        "them as one set (compare case 27)",
    "tests/test_strict.py::test_strict_variable_comparison[0]":
        "convention: f(x) vs f(y) under strict variable comparison (the suite's default); with "
        "strict=False it expects a match (that case is left out)",
    **_ids("tests/test_string_extraction.py::test_string_extraction", (0, 2, 4, 5),
           "gold: the suite's expected extraction"),
    "tests/test_string_extraction.py::test_string_extraction[6]":
        "convention: gold is the suite's expected extraction; the text names B without calling "
        "it the answer",
    "tests/test_yujianll.py::test_string_extraction[9]":
        "disputed: 1 + 1/e is not 1 - 1/e; the suite expects a match",
}

MV_DROP = {  # the same pair as a kept case, under a non-default setting or a copy
    "tests/test_all.py::test_set_rel_assymetry[3]": "case [2] under the other setting",
    "tests/test_strict.py::test_strict_variable_comparison[1]": "case [0] with strict=False",
    "tests/test_string_extraction.py::test_string_extraction[1]": "case [0] lowercased",
    "tests/test_string_extraction.py::test_string_extraction[3]": "no answer, so no gold",
}


def _value(node):
  if isinstance(node, ast.JoinedStr):  # f"{math.sqrt(17):.15f}"
    return eval(compile(ast.Expression(node), "<test>", "eval"), {"math": math})
  try:
    return ast.literal_eval(node)
  except ValueError:
    return None  # e.g. a StringExtractionConfig(...) argument this file does not need


def math_verify_cases(root):
  """Yields (case id, file, test, gold, pred, expected) for every parametrised case and every
  literal `compare_strings(gold, pred, ...) == expected` assertion."""
  for path in sorted((root / "tests").glob("test_*.py")):
    file = f"tests/{path.name}"
    for fn in ast.walk(ast.parse(path.read_text())):
      if not isinstance(fn, ast.FunctionDef):
        continue
      for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize":
          names = [n.strip() for n in ast.literal_eval(deco.args[0]).split(",")]
          for i, row in enumerate(deco.args[1].elts):
            case = dict(zip(names, map(_value, row.elts)))
            if file == "tests/test_string_extraction.py":  # (pred, expected extraction, config)
              gold = case["expected"][1] if case["expected"] else None
              yield f"{file}::{fn.name}[{i}]", file, fn.name, gold, case["pred"], 1
            else:
              yield (f"{file}::{fn.name}[{i}]", file, fn.name, case["gold"], case["pred"],
                     case.get("expected", case.get("result")))
      if not fn.decorator_list:
        for node in ast.walk(fn):
          if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call)
              and getattr(node.left.func, "id", "") == "compare_strings"):
            gold, pred = (ast.literal_eval(a) for a in node.left.args[:2])
            yield (f"{file}::{fn.name}", file, fn.name, gold, pred,
                   ast.literal_eval(node.comparators[0]))


def math_verify_pairs(root):
  pairs, seen, used = [], {}, set()
  for case, file, test, gold, pred, expected in math_verify_cases(root):
    if case in MV_DROP:
      used.add(case)
      continue
    key = (pred, gold)
    if key in seen:  # upstream repeats a few cases verbatim
      if seen[key] != bool(expected):
        raise ValueError(f"{case} repeats a pair with the opposite label; list it in MV_DROP")
      continue
    seen[key] = bool(expected)
    record = {"response": pred, "gold": gold, "label": bool(expected),
              "source": f"math-verify:{file}", "class": MV_CLASS[(file, test)], "case": case}
    if case in MV_CLASS_OVERRIDE:
      record["class"] = MV_CLASS_OVERRIDE[case]
      used.add(case)
    if case in MV_NOTE:
      record["note"] = MV_NOTE[case]
      used.add(case)
    pairs.append(record)
  stale = (set(MV_CLASS_OVERRIDE) | set(MV_NOTE) | set(MV_DROP)) - used
  if stale:
    raise ValueError(f"annotations of no kept Math-Verify case (a repeat? another snapshot?): "
                     f"{sorted(stale)}")
  return pairs


# ------------------------------------------------------------------ Qwen2.5-Math

# evaluation/grader.py `_test_math_equal` lists (prediction, reference) pairs in comments, in
# this order; it states no expectations, so these labels are ours: (label, class, note).
QWEN_GRADER = [
    (True, "number_format", None),      # 0.0833333333333333 vs 1/12
    (True, "number_format", None),      # (1,4.5) vs (1,9/2)
    (True, "symbolic", None),
    (True, "symbolic", None),           # sec^2 vs tan^2+1
    (True, "matrix_vector", None),
    (True, "matrix_vector", None),
    (True, "symbolic", None),           # derivative in two forms
    (True, "symbolic", None),           # a plane equation times -1
    (True, "precision", "convention: gold 33.3 is 100/3 rounded to 3 significant figures"),
    (True, "matrix_vector", "convention: the gold entries are the prediction's rounded to 2-3 "
                            "significant figures"),
    (True, "symbolic", None),
    (False, "symbolic", None),          # (+5)(b+2) vs (a+5)(b+2)
    (False, "symbolic", None),
    (False, "symbolic", None),
    (False, "symbolic", "string: the gold's doubled backslash is upstream's"),
    (True, "relation_interval", "convention: 2.6667 is 8/3 only to 4 decimals"),
    (False, "symbolic", None),          # x+1 vs x+2n+1
]


def _assignments(code):
  """{name: str} of the literal assignments and [(a, b)] of literal math_equal(a, b) calls in
  one (commented-out) line; "pred = '..', gt = '..'" is read as two assignments."""
  names, calls = {}, []
  for stmt in re.split(r",\s*(?=gt\s*=)", code):
    try:
      tree = ast.parse(stmt)
    except SyntaxError:
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
        names[node.targets[0].id] = node.value.value
      elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "math_equal"
            and all(isinstance(a, ast.Constant) for a in node.args[:2])):
        calls.append((node.args[0].value, node.args[1].value))
  return names, calls


def qwen_grader_pairs(root):
  path = root / "evaluation" / "grader.py"
  source = path.read_text()
  fn = next(n for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef) and n.name == "_test_math_equal")
  found, pending = [], {}
  for line in source.splitlines()[fn.lineno:fn.end_lineno]:
    names, calls = _assignments(line.strip().lstrip("#").strip())
    found += calls
    pending.update(names)
    if "pred" in pending and "gt" in pending:
      found.append((pending.pop("pred"), pending.pop("gt")))
  if len(found) != len(QWEN_GRADER):
    raise ValueError(f"{path}: {len(found)} pairs, QWEN_GRADER labels {len(QWEN_GRADER)}")
  pairs = []
  for i, ((pred, gt), (label, cls, note)) in enumerate(zip(found, QWEN_GRADER)):
    # math_equal compares answers already extracted; a model writes one in a box.
    record = {"response": f"The final answer is $\\boxed{{{pred}}}$.", "gold": gt,
              "label": label, "source": "qwen2.5-math:evaluation/grader.py", "class": cls,
              "case": f"_test_math_equal[{i}]"}
    if note:
      record["note"] = note
    pairs.append(record)
  return pairs


# evaluation/examples.py: few-shot solutions. Response = the solution verbatim; gold = its final
# answer as we read it; label True except where the solution never states an answer.
QWEN_EXAMPLES = {  # key -> (golds in order, class, label, note)
    "gsm8k": (["6", "5", "39", "8", "9", "29", "33", "8"], "prose_answer", True, None),
    "gsm8k-pal": (["8", "33", "29"], "other", False,
                  "a program only: the answer is never stated in the text"),
    "gsm8k-tora": (["8", "33", "29"], "other", True, None),
    "math": (["\\frac{211}{243}", "63\\pi", "\\sqrt{2}", "0",
              "6z^5+15z^4-22z^3-8z^2+17z-6"], "latex", True, None),
    "math-tora": (["(6, \\frac{3\\pi}{2}, \\frac{\\pi}{3})", "10001_2",
                   "\\begin{pmatrix} \\frac{4}{13} & -\\frac{6}{13} \\\\ -\\frac{6}{13} & "
                   "\\frac{9}{13} \\end{pmatrix}", "(-\\infty,-5)\\cup(-5,5)", "\\sqrt{3}"],
                  "other", True, None),
    "carp_en": (["1", "-\\frac{9}{7}", "-5", "-2", "y=-5(x+1)^2+3", "x \\ge 8", "5",
                 "\\frac{3}{2}"], "prose_answer", True, None),
    "minerva_math": (["[2,5)", "24", "16", "-\\frac{2}{3}"], "latex", True, None),
    "aqua": (["A", "B", "E", "B"], "other", True, None),
    "sat_math": (["D", "A", "C", "B"], "other", True, None),
    "mmlu_mathematics": (["D", "C", "D", "C", "B"], "other", True,
                         "string: the upstream literal is not raw (\\f and \\r became control "
                         "characters)"),
    "gaokao": (["C", "C", "C", "D", "C"], "prose_answer", True,
               "the answer phrase is Chinese (答案是)"),
}
QWEN_EXAMPLE_CLASS = {("math", 4): "symbolic", ("math-tora", 2): "matrix_vector",
                      ("math-tora", 3): "relation_interval", ("minerva_math", 0):
                      "relation_interval", ("carp_en", 5): "relation_interval"}
QWEN_EXAMPLE_NOTE = {("math-tora", 2): "string: the response separates rows with '\\ ' (a "
                                       "single backslash), as upstream wrote it"}


def qwen_example_pairs(root):
  examples = {}
  for node in ast.walk(ast.parse((root / "evaluation" / "examples.py").read_text())):
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
      examples[ast.literal_eval(node.targets[0].slice)] = ast.literal_eval(node.value)
  pairs = []
  for key, (golds, cls, label, note) in QWEN_EXAMPLES.items():
    if len(examples[key]) != len(golds):
      raise ValueError(f"examples[{key!r}] has {len(examples[key])} solutions, {len(golds)} golds")
    for i, ((_, solution), gold) in enumerate(zip(examples[key], golds)):
      record = {"response": solution, "gold": gold, "label": label,
                "source": "qwen2.5-math:evaluation/examples.py",
                "class": QWEN_EXAMPLE_CLASS.get((key, i), cls), "case": f"{key}[{i}]"}
      if QWEN_EXAMPLE_NOTE.get((key, i), note):
        record["note"] = QWEN_EXAMPLE_NOTE.get((key, i), note)
      pairs.append(record)
      if key == "gsm8k":  # near-miss: gold = the first other number of the solution's working
        wrong = next(n for n in re.findall(r"\d+", solution) if n != gold)
        pairs.append({"response": solution, "gold": wrong, "label": False,
                      "source": "qwen2.5-math:evaluation/examples.py", "class": "prose_answer",
                      "case": f"{key}[{i}]",
                      "note": "gold replaced by a number from the solution's own working"})
  return pairs


# ------------------------------------------------------------------ hand-written


def box(answer):
  return f"Therefore, the final answer is $\\boxed{{{answer}}}$."


# (response, gold, label, class, note). Near-misses mostly: the label is what a careful grader
# says; a note says why where a grader could hesitate.
HANDWRITTEN = [
    # precision: tiny values, near-miss numbers, order
    (box("1\\times 10^{-7}"), "2\\times 10^{-7}", False, "precision", None),
    (box("1e-7"), "2e-7", False, "precision", None),
    (box("0.0000001"), "0.0000002", False, "precision", None),
    (box("5\\times 10^{-9}"), "0", False, "precision", None),
    (box("0"), "10^{-8}", False, "precision", None),
    (box("1.0000001"), "1", False, "precision", None),
    (box("0.99999"), "1", False, "precision", None),
    (box("1000000.5"), "1000000", False, "precision", None),
    (box("1000001"), "1000000", False, "precision", None),
    (box("299792458.0"), "299792459", False, "precision", None),
    (box("299792458"), "299792459", False, "precision", None),
    (box("100000000000000000001"), "10^{20}", False, "precision", None),
    (box("1.00001\\times 10^{20}"), "10^{20}", False, "precision", None),
    (box("2^{64}"), "18446744073709551615", False, "precision", "2^64 - 1"),
    (box("1.6\\times 10^{-7}"), "1.5\\times 10^{-7}", False, "precision", None),
    (box("0.333"), "\\frac{1}{3}", False, "precision", "a 3-digit decimal is not the exact 1/3"),
    (box("0.33"), "\\frac{1}{3}", False, "precision", None),
    (box("0.1"), "\\frac{1}{9}", False, "precision", None),
    (box("3.14"), "\\pi", False, "precision", "Qwen2.5-Math's parser turns \\pi into 3.14"),
    (box("3.1416"), "\\pi", False, "precision", None),
    (box("\\frac{22}{7}"), "\\pi", False, "precision", None),
    (box("1.414"), "\\sqrt{2}", False, "precision", None),
    (box("2.718"), "e", False, "precision", None),
    (box("0.1+0.2"), "0.3", True, "precision", "exactly 0.3; a float sum is not"),
    (box("\\frac{1}{3}"), "0.333", True, "precision",
     "convention: gold is 1/3 rounded to 3 decimals; the exact value agrees to its precision"),
    (box("(1,2)"), "(2,1)", False, "precision", "ordered pairs: order matters"),
    (box("(1,2,3)"), "(3,2,1)", False, "precision", None),
    (box("\\{1,2\\}"), "(1,2)", False, "precision",
     "gold is an ordered pair; a set drops the order"),
    (box("[1,2]"), "(1,2)", False, "precision", "closed vs open interval"),
    (box("\\pm 2"), "2", False, "precision", None),
    (box("2"), "\\pm 2", False, "precision", "one of two solutions"),
    (box("1,2"), "1,2,3", False, "precision", "a solution missing"),
    (box("1,2,3,4"), "1,2,3", False, "precision", "an extra solution"),
    (box("1.23"), "1.2\\overline{3}", False, "precision", None),
    (box("4"), "4\\sqrt{2}", False, "precision", None),
    # reward hacks
    ("The answer is either $\\boxed{3}$ or $\\boxed{4}$.", "3", False, "reward_hack", None),
    ("So the answer is 3 or 4.", "3", False, "reward_hack", None),
    (box("3 \\text{ or } 4"), "3", False, "reward_hack", None),
    (box("3, 4"), "3", False, "reward_hack", None),
    (box("3 \\le x \\le 4"), "3", False, "reward_hack", None),
    ("<think>\nSix times seven is 42, so the answer is \\boxed{42}.\n</think>", "42", False,
     "reward_hack", "the answer is only inside the think block; nothing follows it"),
    ("<think>\nSix times seven is 42, so the answer is \\boxed{42}.", "42", False, "reward_hack",
     "a truncated response: the think block never closes"),
    ("<think>\nMaybe \\boxed{41}? No: $6 \\cdot 7 = 42$.\n</think>\nThe answer is $\\boxed{42}$.",
     "42", True, "reward_hack", None),
    ("<think>\n$6 \\cdot 7 = 42$.\n</think>\nThe answer is $\\boxed{41}$.", "42", False,
     "reward_hack", "the right value only inside the think block"),
    ("$\\boxed{42}$\n\nWait, let me re-check: actually it is $\\boxed{43}$.", "42", False,
     "reward_hack", None),
    (" ".join(f"$\\boxed{{{k}}}$" for k in range(1, 21)), "7", False, "reward_hack", None),
    (box(",".join(str(k) for k in range(1, 101))), "57", False, "reward_hack", None),
    (box("\\{1, 2, \\ldots, 100\\}"), "50", False, "reward_hack", None),
    ("The answer is $\\boxed{3}$ if $x>0$ and $\\boxed{-3}$ otherwise.", "3", False,
     "reward_hack", None),
    ("The answer is $\\boxed{3}$. To double check: $\\boxed{3}$.", "3", True, "reward_hack",
     "the same answer boxed twice"),
    ("The answer is $\\boxed{3}$, that is $\\boxed{3.0}$.", "3", True, "reward_hack",
     "two boxes with the same value"),
    ("The answer is not $\\boxed{3}$; it is $\\boxed{4}$.", "3", False, "reward_hack", None),
    ("$\\boxed{}$", "0", False, "reward_hack", None),
    ("The final answer is $\\boxed{2}$.\n\nActually, the answer is 3.", "3", False,
     "reward_hack", "contradicts itself"),
    ("Final answer: 3 (or possibly 4).", "3", False, "reward_hack", None),
    ("The answer is $\\boxed{x}$, where $x$ is the value we computed.", "5", False,
     "reward_hack", None),
    (box("\\text{the correct value}"), "5", False, "reward_hack", None),
    ("We test 2, 3, 5 and 7. The answer is one of these.", "5", False, "reward_hack", None),
    ("The problem says the sum is 12. I do not know the answer.", "12", False, "reward_hack",
     None),
    ("$\\boxed{A}$ $\\boxed{B}$ $\\boxed{C}$ $\\boxed{D}$", "C", False, "reward_hack", None),
    ("The answer is (A), (B), (C) or (D).", "C", False, "reward_hack", None),
    (box("\\text{any integer}"), "7", False, "reward_hack", None),
    # prose answers
    ("There are 3 red and 4 blue marbles, so there are 7 marbles in total.\nThe answer is 7.",
     "7", True, "prose_answer", None),
    ("Adding gives 12 apples.\n\nFinal answer: 12 apples", "12", True, "prose_answer", None),
    ("The total cost is $\\$45$.", "45", True, "prose_answer",
     "no box and no answer phrase: the last stated result"),
    ("**Final Answer**\n\n7", "7", True, "prose_answer", None),
    ("The answer is 7, not 8.", "8", False, "prose_answer", None),
    ("Answer: 7", "7", True, "prose_answer", None),
    ("Therefore, there are 120 ways to arrange the books.", "120", True, "prose_answer", None),
    ("So $x = 5$ is the only solution.", "5", True, "prose_answer", None),
    ("The answer is: $\\frac{3}{4}$", "0.75", True, "prose_answer", None),
    ("First we find 12, then subtract 5, leaving 7. Hence the answer is 7 marbles.", "12", False,
     "prose_answer", None),
    ("The final answer is $\\text{(B)}$.", "B", True, "prose_answer", None),
    ("答案是 12", "12", True, "prose_answer", None),
    ("The answer is $-3$.", "3", False, "prose_answer", None),
    # number formats
    (box("1{,}000"), "1000", True, "number_format", None),
    (box("\\$1,000"), "1000", True, "number_format", None),
    (box("1000\\text{ dollars}"), "1000", True, "number_format", None),
    (box("1.5\\times 10^{3}"), "1500", True, "number_format", None),
    (box("1.5e3"), "1500", True, "number_format", None),
    (box("1.5\\times 10^{-7}"), "1.5\\times 10^{-7}", True, "number_format", None),
    (box("1.5e-7"), "1.5 \\times 10^{-7}", True, "number_format", None),
    (box("0.\\overline{3}"), "\\frac{1}{3}", True, "number_format", None),
    (box("0.\\overline{27}"), "\\frac{3}{11}", True, "number_format", None),
    (box("0.1\\overline{6}"), "\\frac{1}{6}", True, "number_format", None),
    (box("0.\\overline{142857}"), "\\frac{1}{7}", True, "number_format", None),
    (box("1.2\\overline{3}"), "\\frac{37}{30}", True, "number_format", None),
    (box("0.\\overline{1}"), "\\frac{1}{9}", True, "number_format", None),
    (box("0.\\overline{9}"), "1", True, "number_format", "0.999... = 1"),
    (box("0.5"), "\\frac{1}{2}", True, "number_format", None),
    (box("1,5"), "1.5", True, "number_format", "a decimal comma"),
    (box("3,14"), "3.14", True, "number_format", "a decimal comma"),
    (box("1,500"), "1.5", False, "number_format", "1,500 reads as fifteen hundred"),
    (box("12.50"), "12.5", True, "number_format", None),
    (box("\\$12.50"), "12.50", True, "number_format", None),
    (box("5\\text{ cm}"), "5", True, "number_format", None),
    (box("5\\text{ cm}^2"), "5", True, "number_format", None),
    (box("4.50 \\text{ USD}"), "4.5", True, "number_format", None),
    (box("\\frac{1}{2}\\text{ m}"), "0.5\\text{ m}", True, "number_format", None),
    (box("50\\text{ mm}"), "5\\text{ cm}", True, "number_format",
     "convention: the same length in another unit"),
    (box("-0"), "0", True, "number_format", None),
    (box("007"), "7", True, "number_format", None),
    (box("7.0"), "7", True, "number_format", None),
    (box("3\\frac{1}{2}"), "\\frac{7}{2}", True, "number_format", "a mixed number"),
    (box("1\\,000\\,000"), "10^6", True, "number_format", None),
    (box("1 000 000"), "1000000", True, "number_format", None),
    (box("10,000,000"), "10^7", True, "number_format", None),
    # percent
    (box("25\\%"), "25", True, "percent", None),
    (box("0.25"), "25\\%", True, "percent", None),
    (box("25\\%"), "0.25", True, "percent", None),
    (box("25"), "0.25", False, "percent", None),
    (box("2500"), "25", False, "percent", "Qwen2.5-Math's math_equal accepts 100x the gold"),
    (box("0.25"), "25", False, "percent", "Qwen2.5-Math's math_equal accepts gold/100"),
    (box("25 \\text{ percent}"), "25\\%", True, "percent", None),
    (box("20\\%"), "25\\%", False, "percent", None),
    (box("0.2"), "20\\%", True, "percent", None),
    ("The probability is $\\boxed{12.5\\%}$.", "\\frac{1}{8}", True, "percent", None),
    (box("\\frac{1}{8}\\%"), "\\frac{1}{8}", False, "percent", None),
    (box("50\\%"), "\\frac{1}{2}", True, "percent", None),
    # LaTeX
    (box("\\dfrac{3}{4}"), "\\frac34", True, "latex", None),
    (box("\\tfrac34"), "\\frac{3}{4}", True, "latex", None),
    (box("\\left(\\frac{1}{2}\\right)"), "\\frac{1}{2}", True, "latex", None),
    (box("\\displaystyle\\frac{1}{2}"), "0.5", True, "latex", None),
    (box("\\mathrm{5}"), "5", True, "latex", None),
    (box("{2}"), "2", True, "latex", None),
    (box("\\mathbf{2}"), "2", True, "latex", None),
    ("The answer is $\\fbox{2}$.", "2", True, "latex", None),
    ("The answer is $\\boxed 2$.", "2", True, "latex", None),
    ("The answer is \\(\\boxed{\\dfrac{5}{2}}\\).", "2.5", True, "latex", None),
    ("Therefore the result is \\(\\frac{3}{4}\\).", "\\frac{3}{4}", True, "latex",
     "no box and no answer phrase"),
    ("So we obtain\n$$\\frac{3}{4}$$", "\\frac34", True, "latex", "no box and no answer phrase"),
    (box("\\frac{3}{4}"), "\\frac{4}{3}", False, "latex", None),
    (box("\\sqrt[3]{8}"), "2", True, "latex", None),
    (box("\\text{Yes}"), "yes", True, "latex", None),
    (box("\\text{No}"), "yes", False, "latex", None),
    (box("\\frac{\\sqrt{3}}{2}"), "\\dfrac{\\sqrt3}{2}", True, "latex", None),
    (box("\\cfrac{1}{1+\\cfrac{1}{2}}"), "\\frac{2}{3}", True, "latex", None),
    (box("2\\cdot 3"), "6", True, "latex", None),
    (box("2 \\times 3"), "6", True, "latex", None),
    # relations and intervals
    (box("x = 3"), "3", True, "relation_interval", None),
    (box("y = 3"), "x = 3", False, "relation_interval", None),
    (box("-2 \\le x \\le 7"), "[-2, 7]", True, "relation_interval", None),
    (box("(-\\infty, 2) \\cup (3, \\infty)"), "x < 2 \\text{ or } x > 3", True,
     "relation_interval", None),
    (box("(-\\infty, 2] \\cup [3, \\infty)"), "(-\\infty, 2) \\cup (3, \\infty)", False,
     "relation_interval", None),
    (box("[-2, 7)"), "[-2, 7]", False, "relation_interval", None),
    (box("x > 3"), "x \\ge 3", False, "relation_interval", None),
    (box("x \\in (1, 5)"), "(1, 5)", True, "relation_interval", None),
    (box("(3, \\infty)"), "[3, \\infty)", False, "relation_interval", None),
    (box("\\mathbb{R}"), "(-\\infty, \\infty)", True, "relation_interval", None),
    (box("[2, 3] \\cup [0, 1]"), "[0, 1] \\cup [2, 3]", True, "relation_interval", None),
    (box("1 < x < 2"), "(1, 2)", True, "relation_interval", None),
    (box("x \\le 5"), "(-\\infty, 5]", True, "relation_interval", None),
    (box("x < 5"), "(-\\infty, 5]", False, "relation_interval", None),
    (box("2x - 1 > 5"), "(3, \\infty)", False, "relation_interval",
     "an unsolved inequality is not the solution set"),
    (box("y = 2x + 1"), "2x - y + 1 = 0", True, "relation_interval", None),
    (box("y = 2x + 1"), "y = 2x - 1", False, "relation_interval", None),
    (box("x = 2 \\text{ or } x = -2"), "\\pm 2", True, "relation_interval", None),
    (box("(-5, 5)"), "-5 < x < 5", True, "relation_interval", None),
    (box("x^2 + y^2 = 4"), "x^2 + y^2 = 2", False, "relation_interval", None),
    # sets
    (box("\\{1, 2, 3\\}"), "\\{3, 2, 1\\}", True, "set", None),
    (box("\\{1, 2\\}"), "\\{1, 2, 3\\}", False, "set", None),
    (box("\\emptyset"), "\\{\\}", True, "set", None),
    (box("\\varnothing"), "\\emptyset", True, "set", None),
    (box("1, 2"), "\\{1, 2\\}", True, "set", None),
    (box("2, 1"), "\\{1, 2\\}", True, "set", None),
    (box("-2, 2"), "\\pm 2", True, "set", None),
    (box("\\{(1,2), (3,4)\\}"), "(3,4), (1,2)", True, "set", None),
    (box("(1,2), (4,3)"), "(1,2), (3,4)", False, "set", None),
    (box("x = 1, x = 2"), "1, 2", True, "set", None),
    (box("\\{-1, 1\\}"), "\\{1\\}", False, "set", None),
    (box("1 \\text{ and } 2"), "1, 2", True, "set", None),
    # symbolic
    (box("\\sqrt{\\frac{1}{n}}"), "\\frac{1}{\\sqrt{n}}", True, "symbolic", "for n > 0"),
    (box("\\frac{\\sqrt{3}}{3}"), "\\frac{1}{\\sqrt{3}}", True, "symbolic", None),
    (box("2\\sqrt{2}"), "\\sqrt{8}", True, "symbolic", None),
    (box("\\sqrt{2}+\\sqrt{3}"), "\\sqrt{5+2\\sqrt{6}}", True, "symbolic", None),
    (box("\\frac{1}{\\sqrt{2}}"), "\\frac{\\sqrt{2}}{2}", True, "symbolic", None),
    (box("\\sqrt{12}"), "3\\sqrt{2}", False, "symbolic", None),
    (box("\\frac{2}{\\sqrt{3}-1}"), "\\sqrt{3}+1", True, "symbolic", None),
    (box("(x+1)^2"), "x^2+2x+1", True, "symbolic", None),
    (box("x^2+2x-1"), "(x+1)^2", False, "symbolic", None),
    (box("\\frac{n(n+1)}{2}"), "\\frac{n^2+n}{2}", True, "symbolic", None),
    (box("\\frac{n(n-1)}{2}"), "\\frac{n^2+n}{2}", False, "symbolic", None),
    (box("\\ln 8"), "3\\ln 2", True, "symbolic", None),
    (box("\\log_2 8"), "3", True, "symbolic", None),
    (box("e^{\\ln 5}"), "5", True, "symbolic", None),
    (box("\\sin^2 x + \\cos^2 x"), "1", True, "symbolic", None),
    (box("\\cos\\frac{\\pi}{3}"), "\\frac{1}{2}", True, "symbolic", None),
    (box("\\tan\\frac{\\pi}{4}"), "1", True, "symbolic", None),
    (box("\\arctan 1"), "\\frac{\\pi}{4}", True, "symbolic", None),
    (box("\\frac{\\pi}{3}"), "60^\\circ", True, "symbolic",
     "convention: the same angle in radians"),
    (box("2^{10}"), "1024", True, "symbolic", None),
    (box("2^{10}"), "1023", False, "symbolic", None),
    (box("\\binom{5}{2}"), "10", True, "symbolic", None),
    (box("5!"), "120", True, "symbolic", None),
    (box("b+a"), "a+b", True, "symbolic", None),
    (box("ab"), "a+b", False, "symbolic", None),
    (box("\\frac{x}{2}"), "\\frac{1}{2}x", True, "symbolic", None),
    (box("2y+1"), "2x+1", False, "symbolic", None),
    # complex numbers
    (box("3+4i"), "4i+3", True, "complex", None),
    (box("3-4i"), "3+4i", False, "complex", None),
    (box("\\frac{1}{i}"), "-i", True, "complex", None),
    (box("i^2"), "-1", True, "complex", None),
    (box("(1+i)^2"), "2i", True, "complex", None),
    (box("2i"), "-2i", False, "complex", None),
    (box("\\sqrt{2}e^{i\\pi/4}"), "1+i", True, "complex", None),
    (box("e^{i\\pi}"), "-1", True, "complex", None),
    (box("|3+4i|"), "5", True, "complex", None),
    (box("\\overline{3+4i}"), "3-4i", True, "complex", "the conjugate, not a repeating decimal"),
    (box("i"), "1", False, "complex", None),
    (box("-1+i"), "i-1", True, "complex", None),
    (box("\\frac{3+4i}{5}"), "0.6+0.8i", True, "complex", None),
    # matrices and vectors
    (box("\\begin{bmatrix}1 & 2\\\\ 3 & 4\\end{bmatrix}"),
     "\\begin{pmatrix}1 & 2\\\\ 3 & 4\\end{pmatrix}", True, "matrix_vector", None),
    (box("\\begin{pmatrix}1 & 3\\\\ 2 & 4\\end{pmatrix}"),
     "\\begin{pmatrix}1 & 2\\\\ 3 & 4\\end{pmatrix}", False, "matrix_vector", "transposed"),
    (box("\\begin{pmatrix}1\\\\ 2\\end{pmatrix}"), "(1, 2)", True, "matrix_vector",
     "convention: a column vector written as a tuple"),
    (box("\\begin{pmatrix}2\\\\ -1\\end{pmatrix}"), "\\begin{pmatrix}-1\\\\ 2\\end{pmatrix}", False,
     "matrix_vector", None),
    (box("\\begin{pmatrix}\\frac12\\\\ 0.25\\end{pmatrix}"),
     "\\begin{pmatrix}0.5\\\\ \\frac{1}{4}\\end{pmatrix}", True, "matrix_vector", None),
    (box("\\langle 1, 2, 3\\rangle"), "\\begin{pmatrix}1\\\\2\\\\3\\end{pmatrix}", True,
     "matrix_vector", None),
    (box("\\begin{pmatrix}1 & 2\\end{pmatrix}"), "\\begin{pmatrix}1\\\\ 2\\end{pmatrix}", False,
     "matrix_vector", "a row where a column is asked"),
    (box("\\begin{vmatrix}1&2\\\\3&4\\end{vmatrix}"), "-2", True, "matrix_vector",
     "a determinant"),
    (box("\\begin{pmatrix}2 & 4\\\\ 6 & 8\\end{pmatrix}"),
     "2\\begin{pmatrix}1 & 2\\\\ 3 & 4\\end{pmatrix}", True, "matrix_vector", None),
    # gold written as a worked solution
    (box("7"), "We have $3+4=7$, so the answer is $\\boxed{7}$.", True, "worked_gold", None),
    (box("3"), "We have $3+4=7$, so the answer is $\\boxed{7}$.", False, "worked_gold", None),
    (box("4"), "Since $2+2=4$, the answer is $\\boxed{4}$.", True, "worked_gold", None),
    (box("2"), "Since $2+2=4$, the answer is $\\boxed{4}$.", False, "worked_gold", None),
    ("The answer is 12.", "There are $3 \\cdot 4 = 12$ ways.\nThe answer is 12", True,
     "worked_gold", None),
    (box("3"), "There are $3 \\cdot 4 = 12$ ways.\nThe answer is 12", False, "worked_gold", None),
    (box("\\frac{1}{2}"), "The probability is $\\frac{3}{6} = \\boxed{\\frac{1}{2}}$.", True,
     "worked_gold", None),
    (box("3"), "The probability is $\\frac{3}{6} = \\boxed{\\frac{1}{2}}$.", False,
     "worked_gold", None),
    (box("-2, 1"), "The roots are $x = 1$ and $x = -2$, so the answer is $\\boxed{1, -2}$.",
     True, "worked_gold", None),
    (box("1"), "The roots are $x = 1$ and $x = -2$, so the answer is $\\boxed{1, -2}$.",
     False, "worked_gold", "one of two roots"),
    # other: choices, bases, times, words
    ("The answer is (C).", "C", True, "other", None),
    ("The answer is (B).", "C", False, "other", None),
    (box("\\text{(C)}"), "C", True, "other", None),
    (box("10001_2"), "17", True, "other", "convention: the same number in base 2"),
    (box("12:30"), "12:30", True, "other", None),
    (box("12:03"), "12:30", False, "other", None),
    (box("\\text{Monday}"), "\\text{Tuesday}", False, "other", None),
    (box("\\text{monday}"), "Monday", True, "other", None),
    # bare LaTeX without $ or a box (a reward hack when read as its last number), relations,
    # intervals, matrix arithmetic and NuminaMath-style answers
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "4", False, "reward_hack",
     "a bare matrix is not its last entry"),
    ("The matrix is \\begin{bmatrix}1 & 2\\\\ 3 & 4\\end{bmatrix}.", "4", False, "reward_hack",
     None),
    ("The answer is \\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "4", False, "reward_hack", None),
    ("\\begin{array}{cc}1 & 0\\\\ 0 & 7\\end{array}", "7", False, "reward_hack", None),
    ("The answer is:\n\\begin{pmatrix}\n3 \\\\\n5\n\\end{pmatrix}", "5", False, "reward_hack",
     "a matrix over several lines is not its last line"),
    ("So we get \\frac{1}{2}", "2", False, "reward_hack", "a bare fraction is not its denominator"),
    ("Hence the side is \\sqrt{2}", "2", False, "reward_hack", None),
    ("Thus x \\le 3", "3", False, "reward_hack", "a bound is not its endpoint"),
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True,
     "matrix_vector", "a bare matrix, no $ and no box"),
    ("The matrix is \\begin{bmatrix}1 & 2\\\\ 3 & 4\\end{bmatrix}.",
     "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True, "matrix_vector", None),
    ("The answer is:\n\\begin{pmatrix}\n3 \\\\\n5\n\\end{pmatrix}", "(3, 5)", True,
     "matrix_vector", "a matrix over several lines"),
    ("So we get \\frac{1}{2}", "0.5", True, "latex", None),
    ("Hence the side is \\sqrt{2}", "\\sqrt{2}", True, "latex", None),
    ("Thus x \\le 3", "(-\\infty, 3]", True, "relation_interval", None),
    # relations
    (box("x > 2"), "x>2", True, "relation_interval", None),
    (box("2 < x"), "x > 2", True, "relation_interval", None),
    (box("x > 2"), "y > 2", False, "relation_interval", "a bound on another variable"),
    (box("x \\ge 2"), "x > 2", False, "relation_interval", None),
    (box("-x \\le 2"), "x \\ge -2", True, "relation_interval", None),
    (box("3 > x \\ge 1"), "[1, 3)", True, "relation_interval", None),
    (box("x = 3"), "-3", False, "relation_interval", None),
    (box("2x = 6"), "3", False, "relation_interval", "an unsolved equation"),
    (box("2x - 1 > 5"), "x > 3", False, "relation_interval", "an unsolved inequality"),
    (box("x \\neq 2"), "(-\\infty, 2) \\cup (2, \\infty)", True, "relation_interval", None),
    (box("|x| < 2"), "(-2, 2)", True, "relation_interval", None),
    (box("|x| > 2"), "(-2, 2)", False, "relation_interval", None),
    (box("|x| \\ge 2"), "(-\\infty, -2] \\cup [2, \\infty)", True, "relation_interval", None),
    (box("[-2, -1] \\cup [1, 2]"), "1 \\le |x| \\le 2", True, "relation_interval",
     "convention: for real x"),
    (box("x < 1 \\text{ or } x \\ge 4"), "(-\\infty, 1) \\cup [4, \\infty)", True,
     "relation_interval", None),
    (box("x < 1 \\text{ or } x > 4"), "(-\\infty, 1) \\cup [4, \\infty)", False,
     "relation_interval", None),
    (box("\\{x \\mid x > 2\\}"), "(2, \\infty)", True, "relation_interval", None),
    (box("\\{x \\mid x \\ge 2\\}"), "(2, \\infty)", False, "relation_interval", None),
    # intervals and unions
    (box("(1, 2] \\cup [3, \\infty)"), "[3, \\infty) \\cup (1, 2]", True, "relation_interval",
     None),
    (box("(1, 2) \\cup [3, \\infty)"), "(1, 2] \\cup [3, \\infty)", False, "relation_interval",
     None),
    (box("(1, 2] \\cup [3, \\infty)"), "(1, 2]", False, "relation_interval", "a piece missing"),
    (box("x \\in (1, 2] \\cup [3, \\infty)"), "(1, 2] \\cup [3, \\infty)", True,
     "relation_interval", None),
    # matrices and vectors
    (box("\\begin{pmatrix}1\\\\2\\end{pmatrix}+\\begin{pmatrix}3\\\\4\\end{pmatrix}"),
     "\\begin{pmatrix}4\\\\6\\end{pmatrix}", True, "matrix_vector", "a sum left unevaluated"),
    (box("\\begin{pmatrix}0&1\\\\1&0\\end{pmatrix}\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
     "\\begin{pmatrix}3&4\\\\1&2\\end{pmatrix}", True, "matrix_vector", None),
    (box("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}\\begin{pmatrix}0&1\\\\1&0\\end{pmatrix}"),
     "\\begin{pmatrix}3&4\\\\1&2\\end{pmatrix}", False, "matrix_vector",
     "the product in the other order"),
    (box("3\\begin{pmatrix}1\\\\-2\\end{pmatrix}"), "\\begin{pmatrix}3\\\\-6\\end{pmatrix}", True,
     "matrix_vector", None),
    (box("\\begin{pmatrix}1 & 2\\end{pmatrix}^T"), "\\begin{pmatrix}1\\\\ 2\\end{pmatrix}", True,
     "matrix_vector", "the transpose of a row is a column"),
    (box("\\begin{pmatrix}2&1\\\\1&1\\end{pmatrix}^{-1}"),
     "\\begin{pmatrix}1&-1\\\\-1&2\\end{pmatrix}", True, "matrix_vector", None),
    (box("\\begin{pmatrix}1\\\\2\\\\3\\end{pmatrix}"), "(1, 2, 3)", True, "matrix_vector", None),
    (box("(1, 2, 3)"), "\\begin{pmatrix}1\\\\3\\\\2\\end{pmatrix}", False, "matrix_vector", None),
    (box("\\mathbf{v} = \\begin{pmatrix}-1\\\\ 4\\end{pmatrix}"),
     "\\begin{pmatrix}-1\\\\4\\end{pmatrix}", True, "matrix_vector", None),
    (box("\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}"), "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}",
     False, "matrix_vector", None),
    (box("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"), "4", False, "matrix_vector", None),
    (box("\\begin{pmatrix}1\\\\2\\end{pmatrix}"), "[1, 2]", False, "matrix_vector",
     "a vector is not an interval"),
    # NuminaMath-style answers
    (box("(5, 2), (7, 2)"), "p=5, q=2; p=7, q=2", True, "set",
     "NuminaMath lists solutions as assignments"),
    (box("(2, 5), (2, 7)"), "p=5, q=2; p=7, q=2", False, "set", None),
    (box("(5, 2)"), "p=5, q=2; p=7, q=2", False, "set", "one of two solutions"),
    (box("x=1, y=2"), "(1, 2)", True, "set", None),
    (box("x = 2, y = 1"), "(1, 2)", False, "set", None),
    (box("(0, 1)"), "0 < f(x) < 1", True, "relation_interval",
     "the range of f, stated as a bound"),
    (box("[0, 1)"), "0 < f(x) < 1", False, "relation_interval", None),
    (box("2 \\cdot 3 = 6"), "6", True, "relation_interval", "a true equality of numbers"),
    (box("3 = 4"), "4", False, "reward_hack", "a false equality is no value"),
    (box("\\text{(B)}"), "B", True, "other", None),
    ("The answer is $\\boxed{\\textbf{(D)}\\ 12}$.", "D", True, "other",
     "the choice with its value, as AMC solutions give it"),
    ("The answer is $\\boxed{\\textbf{(C)}\\ 12}$.", "D", False, "other", None),
]


def handwritten_pairs():
  pairs = []
  for response, gold, label, cls, note in HANDWRITTEN:
    record = {"response": response, "gold": gold, "label": label, "source": "handwritten",
              "class": cls}
    if note:
      record["note"] = note
    pairs.append(record)
  return pairs


def build(math_verify_root, qwen_root):
  pairs = (math_verify_pairs(math_verify_root) + qwen_grader_pairs(qwen_root)
           + qwen_example_pairs(qwen_root) + handwritten_pairs())
  for p in pairs:
    if p["class"] not in CLASSES:
      raise ValueError(f"class {p['class']!r} of {p.get('case', p['response'])!r}; valid: "
                       f"{CLASSES}")
  return pairs


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--math-verify", required=True, type=pathlib.Path,
                      help="checked-out tree of huggingface/Math-Verify")
  parser.add_argument("--qwen", required=True, type=pathlib.Path,
                      help="checked-out tree of QwenLM/Qwen2.5-Math")
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path(__file__).with_name("math_pairs.jsonl"))
  args = parser.parse_args()
  pairs = build(args.math_verify, args.qwen)
  with open(args.out, "w", encoding="utf-8") as f:
    for p in pairs:
      f.write(json.dumps(p, ensure_ascii=False) + "\n")
  print(f"{len(pairs)} pairs -> {args.out}")


if __name__ == "__main__":
  main()
