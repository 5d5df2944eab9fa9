"""The findings (experiments/findings.py): every notebook runs headless on the tiny config,
and the verdict rules read the curves they are meant to read."""

import json
import os

import nbformat
import numpy as np
import pytest

from experiments import findings

VERDICTS = {"reproduced", "partially reproduced", "not reproduced"}


@pytest.mark.slow
def test_every_finding_runs_headless_on_the_tiny_config(tmp_path, monkeypatch):
  monkeypatch.setenv("LONGRL_FINDINGS_DIR", str(tmp_path))  # restored after the test
  monkeypatch.setenv("LONGRL_FINDINGS_TINY", "1")
  findings.main(["--all", "--tiny", "--report_dir", str(tmp_path)])
  report = open(tmp_path / "report.md").read()
  for key, finding in findings.FINDINGS.items():
    result = json.load(open(tmp_path / key / "result.json"))
    assert result["verdict"] in VERDICTS and result["tiny"] and result["table"]
    assert f"| {finding.title} | {result['verdict']} | " in report
    assert result["minutes"] > 0  # every arm it needs ran in this report directory
    assert (tmp_path / key / "plot.png").stat().st_size > 0
    nb = nbformat.read(str(tmp_path / f"{key}.ipynb"), as_version=4)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), key
    assert any(result["verdict"] in o.get("data", {}).get("text/markdown", "")
               for o in outputs), key
  # Arms shared between findings ran once; long2short wrote its three models.
  runs = sorted(os.listdir(tmp_path / "runs"))
  assert runs == sorted([*findings.ARMS, findings.WARM_START, "long2short"])
  for method in ("shortest_rejection", "dpo", "merge"):
    assert (tmp_path / "runs" / "long2short" / method / "summary.json").exists()


def test_unknown_finding_is_refused(capsys):
  with pytest.raises(SystemExit):
    findings.main(["z"])
  assert "a_two_stages" in capsys.readouterr().err


def _arm(label, **curves):
  """Synthetic metrics records: RL steps 1..n with the given per-step curves, and evaluations
  (eval_* curves, every 10 steps from step 0)."""
  n = max(len(v) for k, v in curves.items() if not k.startswith("eval_"))
  records = [{"step": 0}] + [{"step": s + 1, **{k: float(v[s]) for k, v in curves.items()
                                                if not k.startswith("eval_")}}
                             for s in range(n)]
  for k, v in curves.items():
    if k.startswith("eval_"):
      for i, value in enumerate(v):
        records[10 * i][k] = float(value)  # records[s] is step s
  return {"label": label, "records": records, "summary": {}}


def test_two_stages_verdict_reads_the_curves():
  steps = np.arange(60)
  length = np.where(steps < 20, 40 - steps, 20.0)  # falls in the first third, then flat
  rising = np.where(steps < 20, 0.3, 0.3 + 0.01 * (steps - 20))  # then the reward rises
  baseline = _arm("baseline", completion_length=np.full(60, 40.0), reward=np.full(60, 0.5),
                  accuracy=np.full(60, 0.5), eval_accuracy=[0.5] * 6)
  two = findings.two_stages({"budget": _arm("budget", completion_length=length, reward=rising,
                                            accuracy=rising, eval_accuracy=[0.5] * 6),
                             "baseline": baseline})
  assert two[0] == "reproduced"
  flat = findings.two_stages({"budget": _arm("budget", completion_length=length,
                                             reward=np.full(60, 0.3), accuracy=rising,
                                             eval_accuracy=[0.5] * 6),
                              "baseline": baseline})
  assert flat[0] == "partially reproduced"  # length fell, accuracy did not follow
  none = findings.two_stages({"budget": baseline, "baseline": baseline})
  assert none[0] == "not reproduced"


def test_coverage_and_negative_gradient_verdicts():
  sharpened = _arm("k1.5", accuracy=np.full(30, 0.5), **{
      "eval_pass@16": [0.9, 0.9, 0.88], "eval_mean@16": [0.4, 0.5, 0.6],
      "eval_maj@16": [0.5, 0.6, 0.6], "eval_pass@1": [0.4, 0.5, 0.6]})
  assert findings.coverage({"baseline": sharpened})[0] == "reproduced"
  widened = _arm("k1.5", accuracy=np.full(30, 0.5), **{
      "eval_pass@16": [0.5, 0.7, 0.9], "eval_mean@16": [0.4, 0.5, 0.6],
      "eval_maj@16": [0.5, 0.6, 0.6], "eval_pass@1": [0.4, 0.5, 0.6]})
  assert findings.coverage({"baseline": widened})[0] == "not reproduced"
  k15 = _arm("k1.5", accuracy=np.full(30, 0.5), completion_length=np.full(30, 9.0),
             eval_accuracy=[0.5, 0.7, 0.8])
  rest = _arm("rest", accuracy=np.full(30, 0.5), completion_length=np.full(30, 9.0),
              eval_accuracy=[0.5, 0.6, 0.7])
  assert findings.negative_gradients({"baseline": k15, "rest": rest})[0] == "reproduced"
  assert findings.negative_gradients({"baseline": rest, "rest": k15})[0] == "not reproduced"
