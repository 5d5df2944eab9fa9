"""The math verifier: every answer convention, extraction rules, adversarial inputs under the
time limit, and the worker pool's kill path."""

import os
import time

import pytest

from rl.tasks.math import MathTask
from rl.verifiers.math import MathVerifier, extract_answer, is_equivalent, verify

# (answer, gold, equal?) grouped by the convention they pin down.
CONVENTIONS = {
    "value": [("2/4", "1/2", True), ("\\frac{2}{4}", "\\dfrac{1}{2}", True),
              ("2^{10}", "1024", True), ("3\\frac{1}{2}", "\\frac{7}{2}", True),
              ("-3\\frac{1}{2}", "-3.5", True), ("i^2", "-1", True), ("i^4 + i^2", "0", True),
              ("\\sqrt{8}", "2\\sqrt{2}", True), ("\\frac{\\pi}{2}", "\\pi/2", True),
              ("2\\cdot 3", "6", True), ("7", "-7", False), ("1/3", "1/2", False)],
    "decimals": [("0.3333333", "\\frac{1}{3}", True), ("0.33", "\\frac{1}{3}", False),
                 ("3.14159265", "\\pi", True), ("1000000.0000001", "1000000", True),
                 ("1000002", "1000000.0", False), ("0.5", "\\frac{1}{2}", True)],
    "exact large and small": [("10^{20}", "10^{20}+1", False),
                              ("10^{20}", "100000000000000000000", True),
                              ("10^{-20}", "2\\cdot 10^{-20}", False),
                              ("10^{-20}", "10^{-20}", True)],
    "equations": [("x=2", "2", True), ("2", "x = 2", True), ("x=2", "y=2", False),
                  ("x=2", "x=3", False), ("y=2x+1", "2x-y+1=0", True),
                  ("y=2x+1", "y=2x+2", False),
                  ("2y = 4x + 2", "y = 2x + 1", True)],
    "intervals": [("[1, 2)", "[1,2)", True), ("(1, 2]", "[1, 2)", False),
                  ("[1,2]", "[1,3]", False),
                  ("(-\\infty, 3]", "(-\\infty,3]", True),
                  ("(1,2)\\cup(3,4)", "(3,4)\\cup(1,2)", True),
                  ("(1,2)\\cup(3,5)", "(3,4)\\cup(1,2)", False)],
    "sets and tuples": [("\\{1, 2, 3\\}", "\\{3, 1, 2\\}", True), ("1, 2", "2, 1", True),
                        ("(1, 2)", "(2, 1)", False), ("(1, 2)", "(1, 2)", True),
                        ("\\{1, 2\\}", "\\{1, 2, 3\\}", False)],
    "solved bounds": [("x > 3", "(3, \\infty)", True), ("x \\geq 3", "[3, \\infty)", True),
                      ("x \\ge 3", "(3, \\infty)", False), ("1 < x \\le 2", "(1, 2]", True),
                      ("3 < x", "(3,\\infty)", True), ("x < 3", "(-\\infty, 3)", True),
                      ("2x - 1 > 5", "(3, \\infty)", False), ("2x - 1 > 5", "x > 3", False)],
    "percent": [("25", "25\\%", True), ("25\\%", "25\\%", True), ("0.25", "25\\%", True),
                ("25%", "25", True), ("2500", "25", False), ("25", "0.25", False),
                ("50", "0.5", False), ("50\\%", "0.5", True)],
    "units and text": [("5\\text{ cm}", "5", True), ("5 cm", "5", True), ("5 meters", "5", True),
                       ("\\$5", "5", True), ("45^\\circ", "45", True), ("45°", "45", True),
                       ("\\text{Yes}", "yes", True), ("\\textbf{NO}", "no", True),
                       ("(B)", "B", True), ("5\\text{ km}", "5000", False)],
    "separators": [("1,000", "1000", True), ("1,234,567", "1234567", True), ("1,5", "1.5", True),
                   ("3,14", "3.14", True), ("1,000", "1", False)],
    "variables": [("2x+1", "1+2x", True), ("2y+1", "2x+1", False), ("x^2+2x+1", "(x+1)^2", True),
                  ("\\sin^2 x + \\cos^2 x", "1", True), ("ab", "ba", True), ("a", "b", False)],
}


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_conventions(convention):
  wrong = [(a, g, want) for a, g, want in CONVENTIONS[convention] if is_equivalent(a, g) != want]
  assert not wrong, wrong


def test_extraction():
  assert extract_answer("so \\boxed{42}.").answer == "42"
  assert extract_answer("\\fbox{7}").answer == "7"
  assert extract_answer("<think>maybe \\boxed{3}</think> it is \\boxed{5}").answer == "5"
  assert extract_answer("<think>\\boxed{3} and still thinking").reason == "truncated"
  assert extract_answer("\\boxed{\\frac{1}{2}} hmm \\boxed{\\frac{1}{2}}").answer == "\\frac{1}{2}"
  assert extract_answer("\\boxed{1/2} or \\boxed{0.5}").reason == "boxed"  # same value
  assert extract_answer("\\boxed{2} or maybe \\boxed{3}").reason == "hedged"
  assert extract_answer("The final answer is 12.").answer == "12"
  assert extract_answer("so the answer is: $x = 4$").answer == "x = 4"
  assert extract_answer("Answer: 7\nbecause").answer == "7"
  assert extract_answer("I computed 5 and 6 along the way.").reason == "no answer"
  assert extract_answer("\\boxed{\\frac{1}{2}").reason == "unbalanced"
  assert verify("thus \\boxed{2} or \\boxed{3}", "2").correct is False
  assert verify("", "2").correct is False


def test_model_text_is_never_evaluated(tmp_path):
  marker = tmp_path / "pwned"
  payloads = [f"__import__('os').system('touch {marker}')",
              f"(lambda: __import__('os').system('touch {marker}'))()",
              f"exec(\"open('{marker}','w')\")", "().__class__.__base__.__subclasses__()"]
  for payload in payloads:
    assert not verify(f"\\boxed{{{payload}}}", "0").correct
    assert not is_equivalent(payload, payload + "+1")
  assert not marker.exists()


ADVERSARIAL = {
    "tower of powers": "\\boxed{9^{9^{9}}}",
    "huge factorial": "\\boxed{(10^{100})!}",
    "2000-deep fractions": "\\boxed{" + "\\frac{1}{" * 2000 + "2" + "}" * 2000 + "}",
    "100k digits": "\\boxed{" + "7" * 100_000 + "}",
    "360 KB of text": "lorem ipsum " * 30_000,
    "unbalanced braces": "\\boxed{{{{3}" + "{" * 5000,
    "huge exponent": "\\boxed{2^{10^{10}}}",
    "deep radicals": "\\boxed{" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "}",
    "long sum": "\\boxed{" + "x+" * 100_000 + "1}",
}


@pytest.fixture(scope="module")
def pool():
  with MathVerifier(workers=2, timeout=5.0) as verifier:
    yield verifier


def test_adversarial_inputs_are_false_within_the_limit(pool):
  started = time.monotonic()
  verdicts = pool.check_batch([(text, "7") for text in ADVERSARIAL.values()])
  assert not any(v.correct for v in verdicts), dict(zip(ADVERSARIAL, verdicts))
  assert time.monotonic() - started < 5.0 * len(ADVERSARIAL) / 2 + 5
  # A 280 KB response ending in the right box is true, and fast.
  started = time.monotonic()
  assert pool.check("word " * 56_000 + "so \\boxed{\\frac{1}{2}}", "0.5").correct
  assert time.monotonic() - started < 2.0


def test_a_check_over_the_limit_is_killed_and_the_pool_goes_on():
  slow = ("\\boxed{(x+1)^{200}(x-1)^{200}}", "(x^2-1)^{200}")  # seconds of sympy.simplify
  with MathVerifier(workers=1, timeout=0.3) as verifier:
    pid_before = verifier._workers[0][0].pid
    started = time.monotonic()
    verdicts = verifier.check_batch([slow, ("\\boxed{3}", "3"), slow, ("\\boxed{4}", "3")])
    assert time.monotonic() - started < 5.0
    assert [v.reason for v in verdicts] == ["timeout", "correct", "timeout", "wrong"]
    assert verifier._workers[0][0].pid != pid_before
    with pytest.raises(ProcessLookupError):
      os.kill(pid_before, 0)


def test_batch_keeps_order_and_matches_in_process(pool):
  pairs = [(f"\\boxed{{{a}}}", g) for values in CONVENTIONS.values() for a, g, _ in values]
  assert [v.correct for v in pool.check_batch(pairs)] == [verify(r, g).correct for r, g in pairs]


def test_math_verify_backend_behind_the_same_interface():
  pairs = [("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{3}", "4"), ("\\boxed{2^{10}}", "1024")]
  with MathVerifier(workers=1, backend="math_verify") as verifier:
    assert [v.correct for v in verifier.check_batch(pairs)] == [True, False, True]
  with pytest.raises(ValueError, match="unknown backend"):
    MathVerifier(backend="sympy")


def test_math_task_bundled_sample(pool):
  task = MathTask(verifier=pool)
  for record in list(task.train.records) + list(task.test.records):
    assert task.verify(task.solution(record), record), record
    assert not task.verify("\\boxed{123456789}", record)
  assert task.answer("so \\boxed{\\dfrac{1}{2}}") == task.answer("\\boxed{\\frac{1}{2}}")
  assert task.well_formed("\\boxed{1}") and not task.well_formed("no idea")


def test_math_task_names_a_bad_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "no answer"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: missing key\(s\) \['answer'\]"):
    MathTask(train_path=str(path), test_path=str(path))
