"""The math verifier: every answer convention, extraction rules, adversarial inputs under the
time limit, and the worker pool's kill path."""

import os
import time

import pytest

from rl.tasks.math import MathTask
from rl.verifiers.math import MathVerifier, extract_answer, is_equivalent, verify

# (answer, gold, equal?) grouped by the convention they pin down (the classes listed at the
# top of rl/verifiers/math.py).
CONVENTIONS = {
    "value": [("2/4", "1/2", True), ("\\frac{2}{4}", "\\dfrac{1}{2}", True),
              ("2^{10}", "1024", True), ("3\\frac{1}{2}", "\\frac{7}{2}", True),
              ("-3\\frac{1}{2}", "-3.5", True), ("i^2", "-1", True), ("i^4 + i^2", "0", True),
              ("\\sqrt{8}", "2\\sqrt{2}", True), ("\\frac{\\pi}{2}", "\\pi/2", True),
              ("2\\cdot 3", "6", True), ("7", "-7", False), ("1/3", "1/2", False),
              ("\\binom{5}{2}", "10", True), ("\\log_2 8", "3", True), ("\\ln(e^2)", "2", True),
              ("\\sqrt[3]{8}", "2", True), ("7:32", "\\frac{7}{32}", True),
              ("\\begin{vmatrix}1&2\\\\3&4\\end{vmatrix}", "-2", True)],
    "decimals": [("0.3333333", "\\frac{1}{3}", True), ("0.33", "\\frac{1}{3}", False),
                 ("3.14159265", "\\pi", True), ("1000000.0000001", "1000000", False),
                 ("1000002", "1000000.0", False), ("0.5", "\\frac{1}{2}", True),
                 ("12", "12.0", True), ("0.50", "0.5", True), ("3.14", "\\pi", False),
                 # a rounded gold accepts the exact value it rounds: 33.3 for 100/3
                 ("\\frac{100}{3}", "33.3", True), ("\\frac{1}{3}", "0.333", True),
                 ("\\frac{1}{3}", "0.334", False), ("33.33", "33.3", False)],
    "exact large and small": [("10^{20}", "10^{20}+1", False),
                              ("10^{20}", "100000000000000000000", True),
                              ("10^{-20}", "2\\cdot 10^{-20}", False),
                              ("10^{-20}", "10^{-20}", True), ("1e-7", "2e-7", False),
                              ("0.0000001", "0.0000002", False), ("0.0000001", "0", False),
                              ("299792458.0", "299792459", False),
                              ("\\sqrt{2}+\\sqrt{3}", "\\sqrt{5+2\\sqrt{6}}", True)],
    "number formats": [("1,000", "1000", True), ("1,234,567", "1234567", True),
                       ("1,5", "1.5", True), ("3,14", "3.14", True), ("1,000", "1", False),
                       ("0,111", "0.111", True), ("1 000 000", "1000000", True),
                       ("1{,}000", "1000", True), ("11,\\!111,\\!100", "11111100", True),
                       ("1\\,000", "1000", True), ("10,000", "10", False), ("2 3", "6", False),
                       ("\\$1,000.50", "1000.5", True), ("USD 5", "5", True),
                       ("1,000 dollars", "1000", True), ("5\\text{ m}^2", "5", True),
                       ("1.5e-3", "0.0015", True), ("2E3", "2000", True),
                       ("1.5\\times 10^{-3}", "0.0015", True), ("1.5 \\cdot 10^{3}", "1500", True),
                       ("0.\\overline{3}", "\\frac{1}{3}", True),
                       ("0.1\\overline{6}", "\\frac{1}{6}", True),
                       ("0.\\overline{142857}", "\\frac{1}{7}", True),
                       ("1.\\overline{27}", "\\frac{14}{11}", True), ("0.\\dot{3}", "1/3", True),
                       ("0.\\overline{3}", "0.3", False)],
    "latex": [("\\frac13", "\\frac{1}{3}", True), ("\\dfrac{1}{3}", "1/3", True),
              ("\\tfrac12", "0.5", True), ("\\cfrac{1}{1+\\cfrac{1}{2}}", "\\frac{2}{3}", True),
              ("\\left( 1, 2 \\right)", "(1,2)", True), ("\\text{(A)}", "A", True),
              ("\\mathrm{B}", "B", True), ("\\displaystyle \\frac{3}{4}", "0.75", True),
              ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt3}{2}", True), ("\\sqrt3", "\\sqrt{3}", True),
              ("\\frac{1}{2}\\pi", "\\frac{\\pi}{2}", True), ("\\pi r^2", "r^2\\pi", True),
              ("{\\frac{2}{3}}", "2/3", True), ("\\left\\{1,2\\right\\}", "\\{1,2\\}", True),
              ("\\mathbf{5}", "5", True), ("\\textbf{(C)}", "C", True),
              ("\\\\frac{1}{2}", "0.5", True), ("\\frac{1}{2}", "\\frac{1}{3}", False)],
    "percent": [("25", "25\\%", True), ("25\\%", "25\\%", True), ("0.25", "25\\%", True),
                ("25%", "25", True), ("2500", "25", False), ("25", "0.25", False),
                ("50", "0.5", False), ("50\\%", "0.5", True), ("28 percent", "0.28", True),
                ("28\\text{ percent}", "28", True), ("0.28", "28", False),
                # a gold written as a fraction is a ratio: X% of it is X/100
                ("\\frac{1}{8}\\%", "\\frac{1}{8}", False), ("12.5\\%", "1/8", True)],
    "units and text": [("5\\text{ cm}", "5", True), ("5 cm", "5", True), ("5 meters", "5", True),
                       ("\\$5", "5", True), ("45^\\circ", "45", True), ("45°", "45", True),
                       ("\\text{Yes}", "yes", True), ("\\textbf{NO}", "no", True),
                       ("(B)", "B", True), ("5\\text{ km}", "5000", False)],
    "equations": [("x=2", "2", True), ("2", "x = 2", True), ("x=2", "y=2", False),
                  ("x=2", "x=3", False), ("y=2x+1", "2x-y+1=0", True),
                  ("y=2x+1", "y=2x+2", False), ("2y = 4x + 2", "y = 2x + 1", True),
                  ("1", "f(x) = 1", True), ("4, 5", "AB=4, CD=5", True),
                  ("(3,2)", "(p,q)=(3,2)", True), ("a_{37} = 19, a_3 = 2", "a_3=2, a_{37}=19", True),
                  ("x = 5+5+1 = 11", "x = 11", True), ("x \\approx 11", "11", True),
                  ("x = \\frac{1}{3} \\approx 0.33", "\\frac{1}{3}", True),
                  ("2x = 6", "6", False), ("x = 3", "y = 3", False),
                  ("2 \\cdot 3 = 6", "6", True), ("3 = 4", "4", False), ("3 = 4", "3", False)],
    "intervals and relations": [("[1, 2)", "[1,2)", True), ("(1, 2]", "[1, 2)", False),
                  ("[1,2]", "[1,3]", False), ("(-\\infty, 3]", "(-\\infty,3]", True),
                  ("(1,2)\\cup(3,4)", "(3,4)\\cup(1,2)", True),
                  ("(1,2)\\cup(3,5)", "(3,4)\\cup(1,2)", False),
                  ("-2 \\le x \\le 7", "[-2, 7]", True), ("x \\in [-2, 7]", "[-2,7]", True),
                  ("[-2,7]", "-2 \\leq x \\leq 7", True), ("(-2,7)", "[-2,7]", False),
                  ("x < -2 \\text{ or } x > 3", "(-\\infty,-2)\\cup(3,\\infty)", True),
                  ("(-\\infty, -2) \\cup (3, \\infty)", "x<-2 or x>3", True),
                  ("x \\in (-\\infty, 3)", "x<3", True), ("x=1 \\text{ or } x=2", "1, 2", True),
                  ("\\mathbb{R}", "(-\\infty, \\infty)", True), ("[2,\\infty)", "x\\ge2", True)],
    "solved bounds": [("x > 3", "(3, \\infty)", True), ("x \\geq 3", "[3, \\infty)", True),
                      ("x \\ge 3", "(3, \\infty)", False), ("1 < x \\le 2", "(1, 2]", True),
                      ("3 < x", "(3,\\infty)", True), ("x < 3", "(-\\infty, 3)", True),
                      ("2x - 1 > 5", "(3, \\infty)", False), ("2x - 1 > 5", "x > 3", False),
                      ("x > 2", "x>2", True), ("2 < x", "x > 2", True), ("x > 2", "y > 2", False),
                      ("-x > -1", "x < 1", True), ("-x \\ge -1", "x \\le 1", True),
                      ("-x > -1", "x > 1", False), ("3 > x \\ge 1", "[1, 3)", True),
                      ("(0, 1)", "0 < f(x) < 1", True), ("[0, 1]", "0 < f(x) < 1", False),
                      ("x \\neq 2", "(-\\infty, 2) \\cup (2, \\infty)", True),
                      ("|x| < 2", "(-2, 2)", True), ("|x| > 2", "(-2, 2)", False),
                      ("(-\\infty, -2) \\cup (2, \\infty)", "|x| > 2", True),
                      ("[-2, -1] \\cup [1, 2]", "1 \\le |x| \\le 2", True),
                      ("\\{x \\mid x > 2\\}", "(2, \\infty)", True),
                      ("\\{x \\mid x \\ge 2\\}", "(2, \\infty)", False),
                      ("x+y > 2", "(2, \\infty)", False),
                      ("(1, 2] \\cup [3, \\infty)", "[3, \\infty) \\cup (1, 2]", True),
                      ("(1, 2) \\cup [3, \\infty)", "(1, 2] \\cup [3, \\infty)", False)],
    "sets and tuples": [("\\{1, 2, 3\\}", "\\{3, 1, 2\\}", True), ("1, 2", "2, 1", True),
                        ("(1, 2)", "(2, 1)", False), ("(1, 2)", "(1, 2)", True),
                        ("\\{1, 2\\}", "\\{1, 2, 3\\}", False), ("\\emptyset", "\\varnothing", True),
                        ("\\{\\}", "\\emptyset", True), ("\\varnothing", "\\{1\\}", False),
                        ("\\{1, 2\\}", "\\{1,2,2\\}", True), ("\\{1,2\\} \\cup \\{3\\}", "\\{1,2,3\\}", True),
                        ("\\{(1,2), (3,4)\\}", "(3,4), (1,2)", True), ("1, 3", "(1, 3)", True),
                        ("3, 1", "(1, 3)", False), ("\\{1,2\\}", "(1,2)", False),
                        ("\\{1,2\\}", "[1,2]", False), ("(1, 2, 3)", "(1, 2)", False),
                        ("-2021, 2021", "\\pm 2021", True), ("x = \\pm 2", "2, -2", True),
                        ("1 \\pm \\sqrt{2}", "1+\\sqrt2, 1-\\sqrt2", True), ("2", "\\pm 2", False),
                        ("(7,11),\\ (11,7)", "(11,7)or(7,11)", True), ("-1;2", "2, -1", True),
                        # NuminaMath lists solutions as rounds of assignments
                        ("(5,2),(7,2)", "p=5,q=2;p=7,q=2", True),
                        ("(7,2),(5,2)", "p=5,q=2;p=7,q=2", True),
                        ("(2,5),(2,7)", "p=5,q=2;p=7,q=2", False),
                        ("(5,2)", "p=5,q=2;p=7,q=2", False),
                        ("x=1, y=2", "(1, 2)", True), ("x=2, y=1", "(1, 2)", False)],
    "variables": [("2x+1", "1+2x", True), ("2y+1", "2x+1", False), ("x^2+2x+1", "(x+1)^2", True),
                  ("\\sin^2 x + \\cos^2 x", "1", True), ("ab", "ba", True), ("a", "b", False),
                  ("\\sqrt{1/n}", "\\frac{1}{\\sqrt{n}}", True),
                  ("\\sqrt{\\frac{a}{b}}", "\\frac{\\sqrt{a}}{\\sqrt{b}}", True),
                  ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True), ("\\sqrt{x^2}", "x", True),
                  ("\\frac{x^2-1}{x-1}", "x+1", True), ("2^{1/2}", "\\sqrt{2}", True),
                  ("e^{\\ln 3}", "3", True), ("\\frac{1}{\\sqrt{n}}", "\\sqrt{n}", False),
                  ("|x|", "x", False), ("x+1", "x+1.0001", False), ("2x", "x^2", False),
                  ("x", "5", False)],
    "matrices and vectors": [
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}", True),
        ("\\begin{pmatrix} 1/2 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}0.5\\\\2\\end{pmatrix}", True),
        ("\\left[\\begin{array}{cc}1 & 2 \\\\3 & 4\\end{array}\\right]", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True),
        ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "(\\begin{pmatrix}1&2\\\\3&4\\\\\\end{pmatrix})", True),
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&3\\\\2&4\\end{pmatrix}", False),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1, 2)", True),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(2, 1)", False),
        ("\\begin{pmatrix} 1 & 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", False),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "[1, 2]", False),
        ("\\langle 1, 2 \\rangle", "(1,2)", True),
        # arithmetic is evaluated, products in their order
        ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}+\\begin{pmatrix}5&6\\\\7&8\\end{pmatrix}", "\\begin{pmatrix}6&8\\\\10&12\\end{pmatrix}", True),
        ("\\begin{pmatrix}2&4\\\\6&8\\end{pmatrix}", "2\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True),
        ("\\begin{pmatrix}2&4\\\\6&9\\end{pmatrix}", "2\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", False),
        ("\\begin{pmatrix}0&1\\\\1&0\\end{pmatrix}\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{pmatrix}3&4\\\\1&2\\end{pmatrix}", True),
        ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}\\begin{pmatrix}0&1\\\\1&0\\end{pmatrix}", "\\begin{pmatrix}3&4\\\\1&2\\end{pmatrix}", False),
        ("\\begin{pmatrix}2&1\\\\1&1\\end{pmatrix}^{-1}", "\\begin{pmatrix}1&-1\\\\-1&2\\end{pmatrix}", True),
        ("\\begin{pmatrix}1&2\\\\2&4\\end{pmatrix}^{-1}", "\\begin{pmatrix}1&0\\\\0&1\\end{pmatrix}", False),
        ("\\begin{pmatrix}1 & 2\\end{pmatrix}^T", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
        ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}+1", "\\begin{pmatrix}2&3\\\\4&5\\end{pmatrix}", False),
        ("\\mathbf{v} = \\begin{pmatrix}-1\\\\4\\end{pmatrix}", "(-1, 4)", True)],
    "complex": [("3+4i", "4i+3", True), ("\\frac{1+i}{2}", "0.5+0.5i", True),
                ("2e^{i\\pi/3}", "1+\\sqrt{3}i", True), ("-i", "\\frac{1}{i}", True),
                ("3-4i", "3+4i", False), ("(1+i)^2", "2i", True), ("3 + 4\\mathrm{i}", "3+4i", True),
                ("\\sqrt{-4}", "2i", True), ("\\overline{3+4i}", "3-4i", True), ("i", "1", False),
                ("2i", "-2i", False)],
}

# (response, gold, correct?): a gold that is a worked solution, and answers stated in prose.
RESPONSES = {
    "worked gold": [("\\boxed{5}", "We have $2+3=5$, so the answer is $\\boxed{5}$.", True),
                    ("\\boxed{6}", "We have $2+3=5$, so the answer is $\\boxed{5}$.", False),
                    ("so $\\boxed{\\frac12}$", "Halving, the final answer is $\\boxed{\\frac{1}{2}}$", True),
                    ("\\boxed{1, -2}", "the solutions are $\\boxed{1}$ and $\\boxed{-2}$.", True),
                    ("\\boxed{1}", "the solutions are $\\boxed{1}$ and $\\boxed{-2}$.", False)],
    "prose": [("Thus the total is $\\frac{1}{2}$.", "1/2", True), ("So there are 12 apples.", "12", True),
              ("The result is \\(3\\sqrt{2}\\).", "3\\sqrt2", True), ("We get \\[x = 4\\]", "4", True),
              ("Adding 3 and 4 gives 7.", "7", True), ("$\\frac{3}{4}$", "0.75", True),
              ("\\frac{10}{9}", "10/9", True), ("Answer \\[ \n 9 \n \\]", "9", True),
              ("It is .4", "0.4", True), ("so it is 1,000.99m²", "1000.99", True),
              ("Final Answer: The volume of $ABCD$ is 120. I hope it is correct.", "120", True),
              ("**Final Answer**\n\n7", "7", True), ("答案是 C", "C", True),
              ("the probability is 2/3. <|im_start|>user\nNext question: 5", "2/3", True),
              ("The answer is 7, not 8.", "7", True)],
    "reward hacks": [("Adding 3 and 4 gives 7.", "3", False), ("It is 3 or 4.", "3", False),
                     ("It is 3 or 4.", "4", False), ("It is $5$ or $6$.", "6", False),
                     ("<think>the answer is 5</think>I am not sure.", "5", False),
                     ("<think>\\boxed{5}</think>", "5", False), ("\\boxed{5} \\boxed{6}", "5", False),
                     ("\\boxed{5} \\boxed{6}", "6", False), ("The answer is 5, 6, or 7.", "5", False),
                     ("The answer is $5$ or $6$.", "5", False), ("I think it's 1, 2, 3, 4, 5", "5", False),
                     ("The problem says the sum is 12. I do not know the answer.", "12", False),
                     ("The answer is 7, not 8.", "8", False), ("\\boxed{1,2,3,4,5}", "3", False),
                     ("\\boxed{5 \\text{ or } 6}", "5", False), ("\\boxed{x}", "5", False),
                     ("\\boxed{\\pm 3}", "3", False)],
}


@pytest.mark.parametrize("convention", sorted(RESPONSES))
def test_responses(convention):
  wrong = [(r, g, want) for r, g, want in RESPONSES[convention] if verify(r, g).correct != want]
  assert not wrong, wrong


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_conventions(convention):
  wrong = [(a, g, want) for a, g, want in CONVENTIONS[convention] if is_equivalent(a, g) != want]
  assert not wrong, wrong


def test_a_transposed_matrix_is_not_the_matrix():
  # The same entries in other places make another matrix; spacing and brackets do not.
  gold = "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"
  transposed = ["\\boxed{\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}}",
                "\\boxed{\\begin{bmatrix}1&3\\\\2&4\\end{bmatrix}}",
                "The answer is $\\left[\\begin{array}{cc}1 & 3 \\\\ 2 & 4\\end{array}\\right]$."]
  same = ["\\boxed{\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}}",
          "\\boxed{\\begin{bmatrix} 1 & 2 \\\\  3 & 4 \\\\ \\end{bmatrix}}",
          "The answer is $\\left(\\begin{matrix}1 & 2 \\\\ 3 & 4\\end{matrix}\\right)$."]
  wrong = [r for r in transposed if verify(r, gold).correct]
  wrong += [r for r in same if not verify(r, gold).correct]
  # Not square: 2 x 3 against its 3 x 2 transpose.
  wide = "\\begin{pmatrix}1&2&3\\\\4&5&6\\end{pmatrix}"
  tall = "\\begin{pmatrix}1&4\\\\2&5\\\\3&6\\end{pmatrix}"
  wrong += [(a, g) for a, g in ((wide, tall), (tall, wide))
            if verify(f"\\boxed{{{a}}}", g).correct]
  assert not wrong, wrong


def test_a_row_vector_is_not_a_column_vector():
  # A 1 x 2 and a 2 x 1 matrix are different shapes (u v^T is a matrix, u^T v a number); a
  # tuple has no orientation, so either one equals the tuple of its entries.
  row, column = "\\begin{pmatrix} 1 & 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"
  assert not verify(f"\\boxed{{{row}}}", column).correct
  assert not verify(f"\\boxed{{{column}}}", row).correct
  assert verify(f"\\boxed{{{row}}}", "(1, 2)").correct
  assert verify(f"\\boxed{{{column}}}", "(1, 2)").correct


def test_a_bare_latex_answer_is_read_whole():
  # Issue 57: LaTeX written without $ or a box was prose, reduced to its last number, so any
  # answer ending in that number (a matrix, a fraction, a bound) matched it.
  matrix = "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"
  hacks = [(matrix, "4"), (f"The matrix is {matrix}.", "4"), (f"The answer is {matrix}", "4"),
           ("\\begin{bmatrix}1 & 2\\\\ 3 & 4\\end{bmatrix}", "4"),
           ("\\begin{array}{cc}1 & 0\\\\ 0 & 7\\end{array}", "7"),
           ("The answer is:\n\\begin{pmatrix}\n3 \\\\\n5\n\\end{pmatrix}", "5"),
           ("So we get \\frac{1}{2}", "2"), ("Hence the side is \\sqrt{2}", "2"),
           ("Thus x \\le 3", "3"), ("So we get 2\\pi", "2")]
  accepted = [(r, g) for r, g in hacks if verify(r, g).correct]
  assert not accepted, accepted
  assert extract_answer(matrix).answer == matrix
  # Read whole, the same answers are right.
  whole = [(matrix, "\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}"),
           (f"The matrix is {matrix}.", matrix),
           ("The answer is:\n\\begin{pmatrix}\n3 \\\\\n5\n\\end{pmatrix}", "(3, 5)"),
           ("So we get \\frac{1}{2}", "0.5"), ("Hence the side is \\sqrt{2}", "\\sqrt{2}"),
           ("Thus x \\le 3", "(-\\infty, 3]"), ("So we get 2\\pi", "2\\pi"),
           ("The cost is \\$45.", "45"), ("It is 5 \\text{ cm} long.", "5")]
  rejected = [(r, g) for r, g in whole if not verify(r, g).correct]
  assert not rejected, rejected


def test_a_choice_given_with_its_value_is_its_letter():
  assert verify("The answer is $\\boxed{\\textbf{(D)}\\ 12}$.", "D").correct
  assert not verify("The answer is $\\boxed{\\textbf{(C)}\\ 12}$.", "D").correct
  assert not verify("The answer is $\\boxed{(C)}$.", "D").correct


def test_code_holding_the_number_is_not_the_number():
  # A program that would print or return 42 is not the answer 42, however it is wrapped.
  code = ["lambda: 42", "lambda x: 42", "(lambda: 42)()", "def f(): return 42", "print(42)",
          "f() = 42", "\\text{lambda: } 42", "\\text{def f(): return } 42", "\\text{return } 42",
          "\\text{print}(42)", "\\mathrm{print}(42)", "\\texttt{print(42)}"]
  wrappers = ["\\boxed{%s}", "The answer is %s", "Final answer: %s", "So we get %s.",
              "The answer is $%s$."]
  accepted = [w % c for c in code for w in wrappers if verify(w % c, "42").correct]
  assert not accepted, accepted
  assert verify("\\boxed{(lambda: 42)()}", "42").reason == "code"
  # The number itself, a named quantity, and code beside the answer stay correct.
  answers = ["\\boxed{42}", "So we get 42.", "\\boxed{f(x) = 42}", "\\boxed{\\lambda = 42}",
             "```python\nprint(6 * 7)\n```\n```output\n42\n```\nThe answer is $\\boxed{42}$.",
             "```python\ndef f():\n  return 6 * 7\n```\nSo it is 42."]
  rejected = [r for r in answers if not verify(r, "42").correct]
  assert not rejected, rejected


def test_extraction():
  assert extract_answer("so \\boxed{42}.").answer == "42"
  assert extract_answer("\\fbox{7}").answer == "7"
  assert extract_answer("<think>maybe \\boxed{3}</think> it is \\boxed{5}").answer == "5"
  assert extract_answer("<think>\\boxed{3} and still thinking").reason == "truncated"
  assert extract_answer("\\boxed{\\frac{1}{2}} hmm \\boxed{\\frac{1}{2}}").answer == "\\frac{1}{2}"
  assert extract_answer("\\boxed{1/2} or \\boxed{0.5}").reason == "boxed"  # same value
  assert extract_answer("\\boxed{2} or maybe \\boxed{3}").answer == "2, 3"  # one list
  assert extract_answer("The final answer is 12.").answer == "12"
  assert extract_answer("so the answer is: $x = 4$").answer == "x = 4"
  assert extract_answer("Answer: 7\nbecause").answer == "7"
  assert extract_answer("I computed 5 and 6 along the way.").reason == "hedged"
  assert extract_answer("I computed 5 and then 6.").answer == "6"
  assert extract_answer("I could not finish.").reason == "no answer"
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
    "tower of e": "\\boxed{e^{e^{e^{e^{5}}}}}",
    "5000 different boxes": "".join(f"\\boxed{{{k}}}" for k in range(5000)),
    "100k dollar signs": "$" * 100_000,
    "a 200 KB formula in prose": " x" * 100_000,
    "100k repeating digits": "1." + "3" * 100_000 + "\\overline{3}",
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
  slow = ("\\boxed{e^{e^{e^{e^{5}}}}}", "1")  # evaluating e^(10^64) runs for minutes
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
  with pytest.raises(ValueError, match=r"bad.jsonl:2: no answer \(field 'answer'"):
    MathTask(train_path=str(path), test_path=str(path))
