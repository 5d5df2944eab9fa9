"""The findings (experiments/findings.py): every notebook runs headless on the tiny config over
two seeds, and each finding's verdict rule reads synthetic multi-seed curves as it should:
reproduced where the effect is there, not reproduced where it is reversed, too wide to tell
where the seeds disagree."""

import json
import os

import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pytest

from experiments import findings, stats

SEEDS = 5
STEPS = 60
# Per-seed deviations of the effect: small (the seeds agree) or large (they disagree), both
# of mean zero so the mean effect is the one built in.
AGREE = [0.1, -0.1, 0.05, -0.05, 0.0]
DISAGREE = [3.0, -3.0, 2.0, -2.0, 0.0]
CASES = [(1.0, AGREE, stats.REPRODUCED), (-1.0, AGREE, stats.NOT_REPRODUCED),
         (1.0, DISAGREE, stats.TOO_WIDE)]
CASE_IDS = ["effect", "reversed", "noisy"]


@pytest.fixture(autouse=True)
def _close_figures():
  yield
  plt.close("all")


@pytest.mark.slow
def test_every_finding_runs_headless_on_the_tiny_config(tmp_path, monkeypatch):
  monkeypatch.setenv("LONGRL_FINDINGS_DIR", str(tmp_path))  # restored after the test
  monkeypatch.setenv("LONGRL_FINDINGS_TINY", "1")
  for name, value in {"SEEDS": "2", "JOBS": "2", "THREADS": "1", "CI": "t"}.items():
    monkeypatch.setenv(f"LONGRL_FINDINGS_{name}", value)  # main sets them too
  findings.main(["--all", "--tiny", "--seeds", "2", "--jobs", "2", "--threads", "1",
                 "--report_dir", str(tmp_path)])
  report = open(tmp_path / "report.md").read()
  for key, finding in findings.FINDINGS.items():
    result = json.load(open(tmp_path / key / "results.json"))
    assert result["verdict"] in stats.VERDICTS and result["tiny"] and result["table"]
    assert result["seeds"] == [0, 1] and result["checks"]
    assert all(c["n"] == 2 and c["low"] is not None for c in result["checks"])
    assert f"| {finding.title} | {result['verdict']} | 2 | " in report
    assert result["checks"][0]["interval"] in report
    assert result["minutes"] > 0  # every run it needs ran in this report directory
    assert (tmp_path / key / "plot.png").stat().st_size > 0
    nb = nbformat.read(str(tmp_path / f"{key}.ipynb"), as_version=4)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), key
    assert any(result["verdict"] in o.get("data", {}).get("text/markdown", "")
               for o in outputs), key
  # Arms shared between findings ran once per seed, each seed in its own directory.
  runs = tmp_path / "runs"
  assert sorted(os.listdir(runs)) == sorted([*findings.ARMS, *findings.WARM_STARTS,
                                             "long2short"])
  for name in [*findings.ARMS, *findings.WARM_STARTS]:
    assert sorted(os.listdir(runs / name)) == ["seed0", "seed1"], name
    assert "train.seed = 1" in open(runs / name / "seed1" / "config.gin").read()
  for method in findings.LONG2SHORT_METHODS:
    assert (runs / "long2short" / method / "seed1" / "summary.json").exists()
  assert (runs / "baseline" / "seed1" / "before_rl" / "report.json").exists()


def test_unknown_finding_is_refused(capsys):
  with pytest.raises(SystemExit):
    findings.main(["z"])
  assert "a_two_stages" in capsys.readouterr().err


# ----------------------------------------------------------------------------- synthetic arms

def _run(*, evals=None, **curves):
  """One seed's run as findings.arm returns it: records of RL steps 1..STEPS with the given
  per-step curves (defaults for the others), evaluations every 10 steps from step 0 (eval_*
  lists, one value per evaluation; None: not logged then, as the sampled metrics at step 0)."""
  defaults = {"completion_length": 30.0, "reward": 0.5, "accuracy": 0.5, "entropy": 0.2,
              "well_formed": 1.0}
  curves = {k: np.broadcast_to(np.asarray(v, float), STEPS)
            for k, v in {**defaults, **curves}.items()}
  records = [{"step": 0}] + [{"step": s, **{k: float(v[s - 1]) for k, v in curves.items()}}
                             for s in range(1, STEPS + 1)]
  for key, values in {"eval_accuracy": [0.7] * 7, **(evals or {})}.items():
    for i, value in enumerate(values):
      if value is not None:
        records[10 * i][key] = float(value)
  return {"summary": {}, "records": records}


def _arm(label, make, jitter):
  """An arm over SEEDS seeds: make(seed's jitter) -> that seed's run."""
  return {"label": label, "seeds": {k: make(j) for k, j in enumerate(jitter)}}


def _fall(start, end, over):
  """A length curve falling linearly from `start` to `end` over the first `over` steps."""
  steps = np.arange(1, STEPS + 1)
  return np.where(steps < over, start + (end - start) * steps / over, end)


def _evals(before, after, at=2):
  """Seven evaluations: `before` up to evaluation `at`, then `after`."""
  return [before] * at + [after] * (7 - at)


def _analyse(key, arms):
  return findings.FINDINGS[key].analyse(arms)


def test_one_seed_gives_no_interval():
  arms = {"baseline": _arm("k1.5", lambda j: _run(evals={"eval_accuracy": _evals(0.5, 0.8)}),
                           [0.0]),
          "rest": _arm("ReST", lambda j: _run(), [0.0])}
  analysis = _analyse("c_negative_gradients", arms)
  assert analysis.verdict == stats.ONE_SEED and analysis.checks[0].interval.n == 1


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_two_stages(effect, jitter, expected):
  # Budget arm: length falls by 20 tokens over the first 15 steps (rises if reversed); its
  # held-out accuracy trails the correctness-only arm's by 0.1 right after, then catches up.
  baseline = _arm("correctness only", lambda j: _run(
      completion_length=40.0, evals={"eval_accuracy": np.linspace(0.6, 0.8, 7)}), jitter)
  budget = _arm("budget", lambda j: _run(
      completion_length=_fall(40, 40 - 20 * effect, 15) + 15 * j,
      evals={"eval_accuracy": np.linspace(0.6, 0.8, 7)
             + np.array([0, -0.1 * effect, -0.1 * effect, 0.1 * j, 0.1 * j, 0.1 * j, 0.1 * j])}),
      jitter)
  analysis = _analyse("a_two_stages", {"budget": budget, "baseline": baseline})
  assert analysis.verdict == expected, [(c.name, str(c.interval)) for c in analysis.checks]
  if expected == stats.REPRODUCED:
    assert analysis.checks[0].interval.mean == pytest.approx(-20, abs=1)
    assert analysis.checks[1].interval.mean == pytest.approx(0.1, abs=0.01)


def test_two_stages_recovery_is_against_the_correctness_only_arm():
  # Both arms gain 0.2 held-out accuracy over RL, in step: no recovery relative to the
  # correctness-only arm, although the budget arm's accuracy rises from its start.
  rising = {"eval_accuracy": np.linspace(0.6, 0.8, 7)}
  arms = {"budget": _arm("budget", lambda j: _run(completion_length=_fall(40, 20, 15) + j,
                                                  evals=rising), AGREE),
          "baseline": _arm("correctness only", lambda j: _run(
              completion_length=40.0, evals={"eval_accuracy": np.linspace(0.6, 0.8, 7) + j
                                             / 100}), AGREE)}
  analysis = _analyse("a_two_stages", arms)
  assert [c.verdict for c in analysis.checks] == [stats.REPRODUCED, stats.NOT_REPRODUCED]
  assert analysis.verdict == stats.PARTIAL
  assert "no effect" in analysis.checks[1].reading()


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_easy_vs_hard(effect, jitter, expected):
  # A collapse (accuracy -0.3, entropy peaking at twice its start, length -8 tokens) in the
  # hard arm, or in the easy one if reversed.
  def arm(collapse):
    def make(j):
      c = collapse(j)
      spike = 0.2 * (1 + c * np.exp(-((np.arange(STEPS) - 30) / 5.0) ** 2))
      return _run(completion_length=_fall(30, 20 - 8 * c, 20), entropy=spike,
                  evals={"eval_accuracy": _evals(0.75, 0.75 - 0.3 * c, at=1)})
    return make

  collapsing, steady = (lambda j: 1 + j), (lambda j: 0.0)
  hard, easy = (collapsing, steady) if effect > 0 else (steady, collapsing)
  arms = {"penalty_easy": _arm("easy", arm(easy), jitter),
          "penalty_hard": _arm("hard", arm(hard), jitter)}
  analysis = _analyse("b_easy_vs_hard", arms)
  assert analysis.verdict == expected, [(c.name, str(c.interval)) for c in analysis.checks]


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_negative_gradients(effect, jitter, expected):
  arms = {"baseline": _arm("k1.5", lambda j: _run(evals={"eval_accuracy": _evals(0.7, 0.8)}),
                           jitter),
          "rest": _arm("ReST", lambda j: _run(
              evals={"eval_accuracy": _evals(0.7, 0.8 - 0.1 * effect + 0.1 * j)}), jitter)}
  assert _analyse("c_negative_gradients", arms).verdict == expected


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_samplers(effect, jitter, expected):
  better = lambda j: _run(evals={"eval_accuracy": _evals(0.7, 0.8 + 0.1 * effect + 0.1 * j)})
  arms = {"baseline": _arm("uniform", lambda j: _run(evals={"eval_accuracy": _evals(0.7, 0.8)}),
                           jitter),
          "prioritized": _arm("prioritized", better, jitter),
          "curriculum": _arm("curriculum", better, jitter)}
  assert _analyse("d_sampling", arms).verdict == expected


def test_samplers_one_of_two_is_partial():
  arms = {"baseline": _arm("uniform", lambda j: _run(evals={"eval_accuracy": _evals(0.7, 0.8)}),
                           AGREE),
          "prioritized": _arm("prioritized", lambda j: _run(
              evals={"eval_accuracy": _evals(0.7, 0.9 + 0.1 * j)}), AGREE),
          "curriculum": _arm("curriculum", lambda j: _run(
              evals={"eval_accuracy": _evals(0.7, 0.8 + 0.001 * j)}), AGREE)}
  assert _analyse("d_sampling", arms).verdict == stats.PARTIAL


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_coverage(effect, jitter, expected):
  # Before RL (the warm start, sampled alike): mean@16 0.5, pass@4 0.85. Under RL mean@16
  # rises by 0.1 while pass@4 falls by 0.1 (reversed: mean@16 falls, pass@4 rises).
  def make(j):
    mean, pass4 = 0.5 + 0.1 * effect + 0.1 * j, 0.85 - 0.1 * effect + 0.1 * j
    sampled = {"pass@1": mean, "pass@4": pass4, "pass@16": 0.95, "mean@16": mean,
               "maj@16": 0.7}
    run = _run(evals={f"eval_{k}": [None] + [v] * 6 for k, v in sampled.items()})
    run["before_rl"] = {"pass@1": 0.5, "pass@4": 0.85, "pass@16": 0.95, "mean@16": 0.5,
                        "maj@16": 0.7, "accuracy": 0.5}
    return run

  analysis = _analyse("e_coverage", {"baseline": _arm("k1.5", make, jitter)})
  assert analysis.verdict == expected, [(c.name, str(c.interval)) for c in analysis.checks]
  assert [r["arm"] for r in analysis.table] == ["k1.5, before RL", "k1.5, RL, 2nd half"]


def test_coverage_pass_at_k_rising_a_little_is_not_flat():
  def make(j):
    sampled = {"pass@1": 0.6, "pass@4": 0.9 + 0.001 * j, "pass@16": 0.95, "mean@16": 0.6,
               "maj@16": 0.7}
    run = _run(evals={f"eval_{k}": [None] + [v] * 6 for k, v in sampled.items()})
    run["before_rl"] = {"pass@1": 0.5, "pass@4": 0.85, "pass@16": 0.95, "mean@16": 0.5,
                        "maj@16": 0.7}
    return run

  analysis = _analyse("e_coverage", {"baseline": _arm("k1.5", make, AGREE)})
  assert [c.verdict for c in analysis.checks] == [stats.REPRODUCED, stats.NOT_REPRODUCED]
  assert analysis.verdict == stats.PARTIAL


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_coverage_second_design_reads_the_largest_k(effect, jitter, expected):
  # e2: pass@16 is the coverage read (pass@4 moves the other way and must not matter).
  def make(j):
    mean, pass16 = 0.2 + 0.1 * effect + 0.1 * j, 0.6 - 0.1 * effect + 0.1 * j
    sampled = {"pass@1": mean, "pass@4": 0.4 + 0.2 * effect, "pass@16": pass16,
               "mean@16": mean, "maj@16": 0.3}
    run = _run(evals={f"eval_{k}": [None] + [v] * 6 for k, v in sampled.items()})
    run["before_rl"] = {"pass@1": 0.2, "pass@4": 0.4, "pass@16": 0.6, "mean@16": 0.2,
                        "maj@16": 0.3}
    return run

  analysis = _analyse("e2_coverage_harder", {"baseline": _arm("k1.5", make, jitter)})
  assert analysis.verdict == expected, [(c.name, str(c.interval)) for c in analysis.checks]
  assert analysis.checks[1].name.startswith("pass@16")


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_masking(effect, jitter, expected):
  base = lambda j: _run(completion_length=20.0, evals={"eval_accuracy": _evals(0.7, 0.8)})
  arms = {"budget": _arm("budget", base, jitter),
          "budget_mask_incorrect": _arm("-I", lambda j: _run(
              completion_length=20 - 5 * effect + 5 * j,
              evals={"eval_accuracy": _evals(0.7, 0.8 - 0.1 * effect + 0.1 * j)}), jitter),
          "budget_mask_long_correct": _arm("-L&C", lambda j: _run(
              completion_length=20 + 5 * effect + 5 * j,
              evals={"eval_accuracy": _evals(0.7, 0.8)}), jitter)}
  assert _analyse("f_masking", arms).verdict == expected


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_staleness(effect, jitter, expected):
  # On-policy: the length falls 40 -> 20 over 20 steps (half way at step 10); stale: half
  # way at step 10 - 5 (reversed: 15), entropy over the last quarter 0.1 higher (lower).
  on = lambda j: _run(completion_length=_fall(40, 20, 20), entropy=0.2)
  stale = lambda j: _run(completion_length=_fall(40, 20, max(2.0, 20 - 10 * effect + 8 * j)),
                         entropy=0.2 + 0.1 * effect + 0.1 * j)
  arms = {"budget": _arm("on-policy", on, jitter),
          "budget_stale": _arm("stale", stale, jitter)}
  for key in ("g_staleness", "g2_staleness_sync"):  # g2: the same rule, stale weights
    analysis = _analyse(key, arms)
    assert analysis.verdict == expected, [(c.name, str(c.interval)) for c in analysis.checks]
  assert analysis.rule.startswith("With weights synced every 4th step")


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_low_precision(effect, jitter, expected):
  # The INT4 engine without a correction loses 0.1 held-out accuracy to the float32 engine
  # (reversed: gains it); each fix wins it back (reversed: loses 0.1 more); QAT's mismatch is
  # float32's (reversed: ten times the INT4 engine's).
  def run(accuracy, kl):
    return lambda j: _run(engine_kl_k3=kl * (1 + j), engine_ratio_p01=0.6,
                          engine_ratio_p99=1.3, would_mask_icepop=0.01,
                          would_mask_seq_mis=0.05,
                          evals={"eval_accuracy": _evals(0.5, accuracy + 0.1 * j)})
  int4 = 0.8 - 0.1 * effect
  arms = {"float32_engine": _arm("float32", run(0.8, 1e-8), jitter),
          "int4_keep": _arm("INT4", run(int4, 0.01), jitter),
          **{f"int4_{fix}": _arm(fix, run(int4 + 0.1 * effect, 0.01), jitter)
             for fix in findings.LOW_PRECISION_FIXES}}
  arms["int4_qat"] = _arm("QAT", run(int4 + 0.1 * effect, 1e-8 if effect > 0 else 0.1), jitter)
  analysis = _analyse("i_int4_rollouts", arms)
  assert analysis.verdict == expected, [(c.name, str(c.interval)) for c in analysis.checks]
  assert len(analysis.checks) == 2 + len(findings.LOW_PRECISION_FIXES)
  assert [row["arm"] for row in analysis.table][:2] == ["float32", "INT4"]


@pytest.mark.parametrize("effect,jitter,expected", CASES, ids=CASE_IDS)
def test_long2short(effect, jitter, expected):
  # Every method cuts tokens (reversed: lengthens), long2short RL the most and at the best
  # accuracy for its length (reversed: longest and least accurate).
  def model(length, accuracy, noise=0.0):  # the seeds' deviations on its length
    return lambda j: {"summary": {"sampled_length": length + noise * j,
                                  "sampled_accuracy": accuracy, "length": length,
                                  "accuracy": accuracy}}

  cuts = {"shortest rejection": 10, "dpo": 12, "merge": 6}
  models = {"long model": _arm("long model", model(40, 0.7, noise=10), jitter),
            **{n: _arm(n, model(40 - effect * c, 0.7), jitter) for n, c in cuts.items()},
            "long2short RL": _arm("long2short RL", model(40 - 25 * effect, 0.65 + 0.1 * effect,
                                                         noise=5), jitter)}
  analysis = findings.long2short_methods(models)
  assert analysis.verdict == expected, [(c.name, str(c.interval)) for c in analysis.checks]
  assert len(analysis.checks) == 4 + 2 * 3


def test_results_and_report_show_the_intervals(tmp_path, monkeypatch):
  monkeypatch.setenv("LONGRL_FINDINGS_DIR", str(tmp_path))
  arms = {"baseline": _arm("k1.5", lambda j: _run(
              evals={"eval_accuracy": _evals(0.7, 0.85 + 0.01 * j)}), AGREE),
          "rest": _arm("ReST", lambda j: _run(evals={"eval_accuracy": _evals(0.7, 0.8)}),
                       AGREE)}
  finding = findings.FINDINGS["c_negative_gradients"]
  result = findings.Result(finding.key, finding.title, finding.claim,
                           finding.analyse(arms), list(range(SEEDS)), minutes=12.5)
  result.save(str(tmp_path / finding.key))
  saved = json.load(open(tmp_path / finding.key / "results.json"))
  (check,) = saved["checks"]
  assert saved["verdict"] == stats.REPRODUCED and saved["seeds"] == [0, 1, 2, 3, 4]
  assert check["per_seed"] == pytest.approx({str(k): 0.05 + 0.01 * j
                                             for k, j in enumerate(AGREE)})
  assert check["low"] > 0 and check["mean"] == pytest.approx(0.05)
  assert saved["table"][0]["held-out acc., 2nd half"]["mean"] == pytest.approx(0.85)
  report = open(findings.write_report([finding.key], str(tmp_path))).read()
  assert f"| {finding.title} | reproduced | 5 | 12.5 |" in report
  assert check["interval"] in report and "on seeds 0..4" in report
  # Findings on more seeds (where the interval was too wide): each group by its command.
  os.makedirs(tmp_path / "a_two_stages")
  json.dump({**saved, "key": "a_two_stages", "seeds": list(range(10))},
            open(tmp_path / "a_two_stages" / "results.json", "w"))
  report = open(findings.write_report(["a_two_stages", finding.key], str(tmp_path))).read()
  assert ("`python experiments/findings.py c --seeds 5` then `python experiments/findings.py a "
          "--seeds 10`") in report
  assert "seeds 0..4 in c; seeds 0..9 in a" in report
  assert "| k1.5 | 0.7 [0.7, 0.7] | 0.85 [" in report
  shown = result._repr_markdown_()  # what the notebook displays
  assert f"**{finding.title}: reproduced**" in shown and check["interval"] in shown
