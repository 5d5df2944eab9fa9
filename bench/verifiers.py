"""Verifier throughput, not a test: math checks per second vs math-verify, and sandboxed code
executions per second vs an unisolated `subprocess.run([sys.executable, "-c", src])`.

  python bench/verifiers.py [--out bench/results]

math: the same corpus (chain-of-thought responses of 0.2-8 KB ending in a boxed answer,
spanning the conventions of rl/verifiers/math.py) checked in-process, one check at a time,
by our backend and by math-verify; then adversarial inputs through each backend's
MathVerifier pool (5 s limit) for the slowest check. code: 600 small stdin/stdout programs
run with 2 at a time by the bubblewrap sandbox pool and by the baseline, then HumanEval's 164
canonical solutions in the sandbox.
"""

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl.tasks.code import humaneval, job  # noqa: E402
from rl.verifiers import code as code_verifier  # noqa: E402
from rl.verifiers import math as math_verifier  # noqa: E402

PAIRS = [  # (boxed answer, gold)
    ("\\frac{1}{2}", "0.5"), ("2/4", "\\frac{1}{2}"), ("1024", "2^{10}"), ("7/2", "3\\frac{1}{2}"),
    ("0.3333333", "\\frac{1}{3}"), ("0.33", "\\frac{1}{3}"), ("x=2", "2"), ("y=2", "x=2"),
    ("y=2x+1", "2x-y+1=0"), ("[1,2)", "[1,2)"), ("(1,2]", "[1,2)"), ("\\{3,1,2\\}", "\\{1,2,3\\}"),
    ("(2,1)", "(1,2)"), ("x>3", "(3,\\infty)"), ("2x-1>5", "(3,\\infty)"), ("25", "25\\%"),
    ("2500", "25"), ("5\\text{ cm}", "5"), ("\\text{Yes}", "yes"), ("1,000", "1000"),
    ("2\\sqrt{2}", "\\sqrt{8}"), ("x^2+2x+1", "(x+1)^2"), ("2y+1", "2x+1"), ("-1", "i^2"),
    ("42", "42"), ("41", "42"), ("\\frac{\\pi}{4}", "\\pi/4"), ("12", "12.0"), ("6", "3!"),
    ("10^{20}", "10^{20}+1"), ("\\frac{5}{6}", "\\frac{2}{3}+\\frac{1}{6}"), ("-3, 3", "3, -3"),
]
ADVERSARIAL = ["\\boxed{9^{9^{9}}}", "\\boxed{(10^{100})!}",
               "\\boxed{" + "\\frac{1}{" * 2000 + "2" + "}" * 2000 + "}",
               "\\boxed{" + "7" * 100_000 + "}", "lorem ipsum " * 30_000,
               "\\boxed{{{{3}" + "{" * 5000, "\\boxed{2^{10^{10}}}"]


def math_corpus(n, seed=0):
  rng = random.Random(seed)
  words = "so we compute the sum and then divide by two which gives us the value".split()
  corpus = []
  for i in range(n):
    answer, gold = PAIRS[i % len(PAIRS)]
    reasoning = " ".join(rng.choice(words) for _ in range(rng.randint(40, 1600)))
    corpus.append((f"<think>{reasoning}</think>\nTherefore the answer is $\\boxed{{{answer}}}$.",
                   gold))
  return corpus


def time_checks(check, corpus):
  verdicts, slowest = [], 0.0
  started = time.perf_counter()
  for response, gold in corpus:
    t = time.perf_counter()
    verdicts.append(check(response, gold).correct)
    slowest = max(slowest, time.perf_counter() - t)
  return len(corpus) / (time.perf_counter() - started), slowest, verdicts


def bench_math():
  corpus = math_corpus(1000)
  results = {}
  for backend, check in math_verifier.BACKENDS.items():
    check(*corpus[0])  # imports and caches outside the timing
    rate, slowest, verdicts = time_checks(check, corpus)
    results[backend] = {"checks_per_second": rate, "slowest_check_s": slowest,
                        "accepted": sum(verdicts)}
    with math_verifier.MathVerifier(workers=2, timeout=5.0, backend=backend) as pool:
      started = time.perf_counter()
      adversarial = pool.check_batch([(text, "7") for text in ADVERSARIAL])
      results[backend]["adversarial_wall_s"] = time.perf_counter() - started
      results[backend]["adversarial_timeouts"] = sum(v.reason == "timeout" for v in adversarial)
      results[backend]["adversarial_true"] = sum(v.correct for v in adversarial)
      results[backend]["verdicts"] = verdicts
  ours, theirs = results["longrl"].pop("verdicts"), results["math_verify"].pop("verdicts")
  results["agreement"] = sum(a == b for a, b in zip(ours, theirs)) / len(ours)
  results["disagreements"] = sorted({PAIRS[i % len(PAIRS)] for i, (a, b)
                                     in enumerate(zip(ours, theirs)) if a != b})
  results["ratio"] = (results["longrl"]["checks_per_second"]
                      / results["math_verify"]["checks_per_second"])
  return results


def programs(n):
  return [(f"n = int(input())\nprint(sum(i * i for i in range(n)) + {i})\n", f"{i % 50}\n",
           f"{sum(j * j for j in range(i % 50)) + i}\n") for i in range(n)]


def baseline_run(program):
  src, stdin, expected = program
  out = subprocess.run([sys.executable, "-c", src], input=stdin, capture_output=True,
                       text=True, timeout=10)
  return out.stdout == expected


def bench_code(workers=2):
  cases = programs(600)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    started = time.perf_counter()
    baseline_ok = sum(pool.map(baseline_run, cases))
    baseline_rate = len(cases) / (time.perf_counter() - started)
  jobs = [code_verifier.Job(src, stdio_tests=(code_verifier.StdioTest(stdin, expected),))
          for src, stdin, expected in cases]
  with code_verifier.CodeSandbox(workers=workers) as sandbox:
    sandbox.run_batch(jobs[:4])  # start the fork servers outside the timing
    started = time.perf_counter()
    sandbox_ok = sum(r[0].passed for r in sandbox.run_batch(jobs))
    sandbox_rate = len(cases) / (time.perf_counter() - started)
    problems = humaneval().records
    started = time.perf_counter()
    passed = sum(r[0].passed for r in sandbox.run_batch(
        [job(p, p["canonical_solution"]) for p in problems]))
    humaneval_rate = len(problems) / (time.perf_counter() - started)
    isolation = sandbox.isolation
  return {"workers": workers, "isolation": isolation,
          "baseline_executions_per_second": baseline_rate, "baseline_correct": baseline_ok,
          "sandbox_executions_per_second": sandbox_rate, "sandbox_correct": sandbox_ok,
          "ratio": sandbox_rate / baseline_rate, "humaneval_canonical_passed": passed,
          "humaneval_problems_per_second": humaneval_rate}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args()
  math_results = bench_math()
  for backend in ("longrl", "math_verify"):
    r = math_results[backend]
    print(f"math {backend:>11}: {r['checks_per_second']:8.1f} checks/s, slowest "
          f"{r['slowest_check_s']:.3f} s, accepted {r['accepted']}/1000; adversarial x"
          f"{len(ADVERSARIAL)} in the pool: {r['adversarial_wall_s']:.2f} s, "
          f"{r['adversarial_timeouts']} timeouts, {r['adversarial_true']} true")
  print(f"math speed ratio longrl / math-verify = {math_results['ratio']:.2f} (target >= 1); "
        f"verdict agreement {math_results['agreement']:.1%}")
  for answer, gold in math_results["disagreements"]:
    print(f"  disagree: answer {answer!r} vs gold {gold!r}")
  code_results = bench_code()
  print(f"code, {code_results['workers']} at a time: baseline subprocess "
        f"{code_results['baseline_executions_per_second']:.1f}/s, sandbox "
        f"({code_results['isolation']}) {code_results['sandbox_executions_per_second']:.1f}/s: "
        f"ratio {code_results['ratio']:.2f} (target >= 2); both correct "
        f"{code_results['baseline_correct']}/{code_results['sandbox_correct']} of 600")
  print(f"HumanEval canonical solutions: {code_results['humaneval_canonical_passed']}/164 "
        f"passed, {code_results['humaneval_problems_per_second']:.1f} problems/s")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "verifiers.json"), "w") as f:
    json.dump({"math": math_results, "code": code_results}, f, indent=2, default=list)


if __name__ == "__main__":
  main()
