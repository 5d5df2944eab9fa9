"""Math verifiers scored on labelled pairs, and verifier throughput: math checks per second vs
math-verify, sandboxed code executions per second vs an unisolated
`subprocess.run([sys.executable, "-c", src])`.

  python bench/verifiers.py [--out bench/results] [--pairs-only] [--wrong FILE]

pairs: the labelled (response, gold) pairs of bench/data/math_pairs.jsonl (Math-Verify's and
Qwen2.5-Math's test cases plus near-misses; bench/data/README.md) through each backend's
MathVerifier pool (2 workers, 5 s limit): agreement with the labels, false positives, false
negatives and timeouts, overall and per class, and checks/s in the pool and in-process one at
a time. `--pairs-only` runs just this part; `--wrong FILE` writes every pair our backend gets
wrong, with what it extracted, as JSON lines. math: the same corpus (chain-of-thought responses
of 0.2-8 KB ending in a boxed answer, spanning the conventions of rl/verifiers/math.py) checked
in-process, one check at a time, by our backend and by math-verify; then adversarial inputs
through each backend's MathVerifier pool (5 s limit) for the slowest check. code: 600 small
stdin/stdout programs run with 2 at a time by the bubblewrap sandbox pool and by the baseline,
then HumanEval's 164 canonical solutions in the sandbox.
"""

import argparse
import collections
import concurrent.futures
import hashlib
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


PAIRS_FILE = os.path.join(ROOT, "bench", "data", "math_pairs.jsonl")
BACKEND_ORDER = ("longrl", "math_verify")
_CAVEATS = ("disputed:", "convention:")  # notes on labels a careful grader could dispute


def load_pairs(path=PAIRS_FILE):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def tally(pairs, verdicts):
  """Agreement of verdicts with the pairs' labels."""
  wrong = [(p, v) for p, v in zip(pairs, verdicts) if v.correct != p["label"]]
  return {"pairs": len(pairs), "accuracy": 1 - len(wrong) / len(pairs) if pairs else None,
          "false_positives": sum(v.correct for _, v in wrong),
          "false_negatives": sum(not v.correct for _, v in wrong),
          "timeouts": sum(v.reason == "timeout" for v in verdicts)}


def _grouped(pairs, verdicts, key):
  groups = {}
  for name in sorted({key(p) for p in pairs}):
    index = [i for i, p in enumerate(pairs) if key(p) == name]
    groups[name] = {"pairs": len(index), **{
        b: tally([pairs[i] for i in index], [verdicts[b][i] for i in index])
        for b in BACKEND_ORDER}}
  return dict(sorted(groups.items(), key=lambda item: -item[1]["pairs"]))


def bench_pairs(pairs):
  """Each backend on every pair: in its pool (the verdicts scored), then in-process one at a
  time for checks/s over the pairs the pool finished (an in-process check has no time limit)."""
  verdicts, results = {}, {"file": os.path.relpath(PAIRS_FILE, ROOT), "pairs": len(pairs),
                           "labels_true": sum(p["label"] for p in pairs), "backends": {}}
  uncaveated = [i for i, p in enumerate(pairs) if not p.get("note", "").startswith(_CAVEATS)]
  for backend in BACKEND_ORDER:
    with math_verifier.MathVerifier(workers=2, timeout=5.0, backend=backend) as pool:
      started = time.perf_counter()
      verdicts[backend] = pool.check_batch([(p["response"], p["gold"]) for p in pairs])
      pool_rate = len(pairs) / (time.perf_counter() - started)
    finished = [i for i, v in enumerate(verdicts[backend]) if v.reason != "timeout"]
    check = math_verifier.BACKENDS[backend]
    check(pairs[0]["response"], pairs[0]["gold"])  # imports and caches outside the timing
    rate, slowest, in_process = time_checks(
        check, [(pairs[i]["response"], pairs[i]["gold"]) for i in finished])
    r = tally(pairs, verdicts[backend])
    clean = tally([pairs[i] for i in uncaveated], [verdicts[backend][i] for i in uncaveated])
    r["accuracy_uncaveated"] = clean["accuracy"]
    r["false_positives_uncaveated"] = clean["false_positives"]
    r["errors"] = sum(v.reason.startswith("error") for v in verdicts[backend])
    r["pool_checks_per_second"] = pool_rate
    r["checks_per_second"], r["slowest_check_s"] = rate, slowest
    r["in_process_differs"] = sum(verdicts[backend][i].correct != c
                                  for i, c in zip(finished, in_process))
    r["wrong_by_reason"] = dict(collections.Counter(
        v.reason for p, v in zip(pairs, verdicts[backend]) if v.correct != p["label"]))
    r["wrong"] = [{"line": i + 1, "class": p["class"], "label": p["label"],
                   "reason": verdicts[backend][i].reason}
                  for i, p in enumerate(pairs) if verdicts[backend][i].correct != p["label"]]
    results["backends"][backend] = r
  results["uncaveated_pairs"] = len(uncaveated)
  with open(math_verifier.__file__, "rb") as f:  # ties the scores to one version of our verifier
    results["rl_verifiers_math_sha1"] = hashlib.sha1(f.read()).hexdigest()
  results["by_class"] = _grouped(pairs, verdicts, lambda p: p["class"])
  results["by_source"] = _grouped(pairs, verdicts, lambda p: p["source"])
  return results, verdicts


def _short(text, n=150):
  text = text.replace("\n", " ")
  return repr(text if len(text) <= n else "..." + text[-n:])


def print_pairs(results):
  print(f"math pairs: {results['pairs']} from {results['file']} ({results['labels_true']} "
        f"labelled true); MathVerifier pools of 2 workers, 5 s limit")
  print(f"{'backend':>12} {'accuracy':>9} {'uncaveated':>11} {'FP':>4} {'FP unc.':>7} {'FN':>4} "
        f"{'timeouts':>8} {'pool checks/s':>14} {'in-process checks/s':>20} {'slowest':>8}")
  for backend, r in results["backends"].items():
    print(f"{backend:>12} {r['accuracy']:9.1%} {r['accuracy_uncaveated']:11.1%} "
          f"{r['false_positives']:4d} {r['false_positives_uncaveated']:7d} "
          f"{r['false_negatives']:4d} {r['timeouts']:8d} "
          f"{r['pool_checks_per_second']:14.1f} {r['checks_per_second']:20.1f} "
          f"{r['slowest_check_s']:7.3f}s")
  print(f"(uncaveated: the {results['uncaveated_pairs']} pairs whose label carries no "
        f"'disputed:'/'convention:' note; rl/verifiers/math.py sha1 "
        f"{results['rl_verifiers_math_sha1'][:12]})")
  for backend, r in results["backends"].items():
    reasons = sorted(r["wrong_by_reason"].items(), key=lambda item: -item[1])
    print(f"{backend} wrong, by verdict reason: "
          + ", ".join(f"{reason} {n}" for reason, n in reasons))
  for title, groups in (("class", results["by_class"]), ("source", results["by_source"])):
    width = max(map(len, groups)) + 1
    print(f"{title:<{width}} {'pairs':>5} " + " ".join(
        f"{b + ' acc':>16} {'FP':>3} {'FN':>3}" for b in BACKEND_ORDER))
    for name, g in groups.items():
      print(f"{name:<{width}} {g['pairs']:5d} " + " ".join(
          f"{g[b]['accuracy']:16.1%} {g[b]['false_positives']:3d} {g[b]['false_negatives']:3d}"
          for b in BACKEND_ORDER))


def ours_wrong(pairs, verdicts):
  """Every pair our backend gets wrong, with its verdict, what it extracted and math-verify's
  verdict."""
  wrong = []
  for i, (p, v) in enumerate(zip(pairs, verdicts["longrl"])):
    if v.correct == p["label"]:
      continue
    extracted = None if v.reason == "timeout" else math_verifier.extract_answer(p["response"])
    wrong.append({"line": i + 1, "kind": "false positive" if v.correct else "false negative",
                  **p, "reason": v.reason, "extracted": extracted and extracted.answer,
                  "math_verify_right": verdicts["math_verify"][i].correct == p["label"]})
  return wrong


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
  parser.add_argument("--pairs-only", action="store_true",
                      help="only score the backends on bench/data/math_pairs.jsonl")
  parser.add_argument("--wrong", help="write the pairs our backend gets wrong here (JSON lines)")
  args = parser.parse_args()
  path = os.path.join(args.out, "verifiers.json")
  results = {}
  if args.pairs_only and os.path.exists(path):  # keep the throughput parts of the last full run
    with open(path) as f:
      results = json.load(f)
  pairs = load_pairs()
  results["math_pairs"], verdicts = bench_pairs(pairs)
  print_pairs(results["math_pairs"])
  wrong = ours_wrong(pairs, verdicts)
  print(f"longrl gets {len(wrong)} of {len(pairs)} pairs wrong:")
  for w in wrong:
    print(f"  line {w['line']} {w['kind']} [{w['class']}] {w['source']}: response "
          f"{_short(w['response'])} | gold {_short(w['gold'], 80)} | extracted "
          f"{w['extracted']!r} ({w['reason']}); math-verify "
          f"{'right' if w['math_verify_right'] else 'wrong'}")
  if args.wrong:
    with open(args.wrong, "w", encoding="utf-8") as f:
      for w in wrong:
        f.write(json.dumps(w, ensure_ascii=False) + "\n")
  if not args.pairs_only:
    results["math"] = bench_math()
    math_results = results["math"]
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
    results["code"] = code_results = bench_code()
    print(f"code, {code_results['workers']} at a time: baseline subprocess "
          f"{code_results['baseline_executions_per_second']:.1f}/s, sandbox "
          f"({code_results['isolation']}) {code_results['sandbox_executions_per_second']:.1f}/s: "
          f"ratio {code_results['ratio']:.2f} (target >= 2); both correct "
          f"{code_results['baseline_correct']}/{code_results['sandbox_correct']} of 600")
    print(f"HumanEval canonical solutions: {code_results['humaneval_canonical_passed']}/164 "
          f"passed, {code_results['humaneval_problems_per_second']:.1f} problems/s")
  os.makedirs(args.out, exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=2, default=list)


if __name__ == "__main__":
  main()
