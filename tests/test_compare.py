"""experiments/seeds.py (the seed<k> layout and the parallel runner) and
experiments/compare.py (run directories in, a banded figure and a table of intervals out),
on hand-made run directories and jobs: no training."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import compare, seeds, stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(run_dir, *, reward, eval_accuracy, rl_accuracy=None):
  """A run directory as run.py leaves it: metrics.jsonl (step 0: the evaluation before RL;
  steps 1..n: reward; eval_accuracy every 5 steps) and summary.json."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for step in range(len(reward) + 1):
      record = {"step": step}
      if step:
        record["reward"] = float(reward[step - 1])
      if step % 5 == 0:
        record["eval_accuracy"] = float(eval_accuracy[step // 5])
      f.write(json.dumps(record) + "\n")
  summary = {"sft_accuracy": float(eval_accuracy[0])}
  if rl_accuracy is not None:
    summary["rl_accuracy"] = rl_accuracy
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f)


def _ablation(tmp_path):
  """Runs A and B over seeds 0..2 (B's reward 0.1 higher than A's on each seed, plus 0.01 *
  seed) and a plain run directory C."""
  for k in range(3):
    _write_run(tmp_path / "A" / f"seed{k}", reward=np.full(10, 0.5 + 0.05 * k),
               eval_accuracy=[0.5, 0.6, 0.7], rl_accuracy=0.7 + 0.01 * k)
    _write_run(tmp_path / "B" / f"seed{k}", reward=np.full(10, 0.6 + 0.06 * k),
               eval_accuracy=[0.5, 0.7, 0.8], rl_accuracy=0.8)
  _write_run(tmp_path / "C", reward=np.linspace(0, 1, 10), eval_accuracy=[0.5, 0.5, 0.5])
  return [str(tmp_path / n) for n in "ABC"]


def test_read_finds_the_seed_directories(tmp_path):
  a, _, c = _ablation(tmp_path)
  assert seeds.seeds_in(a) == [0, 1, 2]
  runs = seeds.read(a)
  assert sorted(runs) == [0, 1, 2] and runs[2]["summary"]["rl_accuracy"] == pytest.approx(0.72)
  assert len(runs[0]["records"]) == 11
  assert list(seeds.read(c)) == [0]  # a plain run directory is one run
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
    seeds.read(str(tmp_path / "nothing"))


def test_compare_writes_a_banded_figure_and_a_table_of_intervals(tmp_path, capsys):
  a, b, c = _ablation(tmp_path)
  out = tmp_path / "out"
  result = compare.main([a, b, c, "--metrics", "reward", "eval_accuracy", "rl_accuracy",
                         "--out", str(out)])
  for name in ("compare.png", "compare.md", "compare.json"):
    assert (out / name).stat().st_size > 0
  # Final reward: the mean of the last 20% of the steps (here constant per seed).
  reward_a = result["runs"]["A"]["reward"]
  assert reward_a["per_seed"] == pytest.approx({0: 0.5, 1: 0.55, 2: 0.6})
  expected = stats.mean_ci([0.5, 0.55, 0.6])
  assert (reward_a["low"], reward_a["high"]) == pytest.approx((expected.low, expected.high))
  assert result["runs"]["A"]["rl_accuracy"]["mean"] == pytest.approx(0.71)  # summary.json
  assert result["runs"]["B"]["eval_accuracy"]["mean"] == pytest.approx(0.8)  # last value
  # B - A, paired by seed: 0.1, 0.11, 0.12.
  diff = result["differences"]["B - A"]["reward"]
  assert diff["per_seed"] == pytest.approx({0: 0.1, 1: 0.11, 2: 0.12})
  assert diff["low"] > 0
  assert result["differences"]["C - A"]["reward"]["n"] == 1  # C has seed 0 only
  assert result["runs"]["C"]["rl_accuracy"] is None  # C's summary has none
  text = capsys.readouterr().out
  assert "| A | " in text and "| B - A | " in text and str(stats.Interval(
      **{k: diff[k] for k in ("mean", "low", "high", "n")})) in text
  assert open(out / "compare.md").read() in text
  saved = json.load(open(out / "compare.json"))
  assert saved["run_dirs"]["A"] == a and saved["runs"]["B"]["reward"]["n"] == 3


def test_compare_figure_draws_the_mean_and_a_band_per_run(tmp_path):
  a, b, _ = _ablation(tmp_path)
  fig = compare.figure({"A": seeds.read(a), "B": seeds.read(b)}, ["reward", "eval_accuracy",
                                                                   "rl_accuracy"], window=1)
  axes = fig.axes
  assert len(axes) == 2  # rl_accuracy is not a curve: no panel
  line = axes[0].lines[0]
  assert np.allclose(line.get_ydata(), 0.55)  # mean over A's seeds
  assert len(axes[0].collections) == 2  # one band per run
  band = axes[0].collections[0].get_paths()[0].vertices[:, 1]
  assert band.min() == pytest.approx(0.5) and band.max() == pytest.approx(0.6)


def test_stack_keeps_the_steps_every_seed_logged():
  runs = {0: {"records": [{"step": s, "x": s} for s in range(5)]},
          1: {"records": [{"step": s, "x": 2 * s} for s in range(3)]},
          2: {"records": [{"step": 0}]}}
  steps, values = compare.stack(runs, "x")
  assert steps.tolist() == [0, 1, 2] and values.tolist() == [[0, 1, 2], [0, 2, 4]]


def _job(tmp_path, name, script, **kw):
  out = str(tmp_path / name)
  return seeds.Job(name, (sys.executable, "-c", script, out), out, **kw)


FINISH = ("import json, os, sys; json.dump({'rl_accuracy': 1.0}, "
          "open(os.path.join(sys.argv[1], 'summary.json'), 'w'))")


def test_runner_orders_skips_and_reports_failures(tmp_path):
  os.makedirs(tmp_path / "done")
  with open(tmp_path / "done" / "summary.json", "w") as f:
    json.dump({"rl_accuracy": 0.5}, f)
  first_done = f"import os, sys; assert os.path.exists('{tmp_path}/first/summary.json'); "
  jobs = [_job(tmp_path, "second", first_done + FINISH, after=("first",)),
          _job(tmp_path, "first", FINISH),
          _job(tmp_path, "done", "raise SystemExit(1)"),  # finished: never started
          _job(tmp_path, "fails", "print('boom'); raise SystemExit(3)"),
          _job(tmp_path, "after_fail", FINISH, after=("fails",))]
  messages = []
  with pytest.raises(RuntimeError, match=r"1 job\(s\) failed: fails .*1 skipped"):
    seeds.run_jobs(jobs, parallel=1, log=messages.append)
  assert seeds.finished(str(tmp_path / "second"))  # ran after "first"
  assert seeds.seconds(str(tmp_path / "first")) > 0
  assert not os.path.exists(tmp_path / "after_fail")
  assert not os.path.exists(tmp_path / "done" / "job.json")
  assert any("FAILED fails (exit 3)" in m and "boom" in m for m in messages)
  with pytest.raises(ValueError, match="unknown job"):
    seeds.run_jobs([_job(tmp_path, "x", FINISH, after=("y",))])
  with pytest.raises(ValueError, match="wait for each other"):
    seeds.run_jobs([_job(tmp_path, "x", FINISH, after=("y",)),
                    _job(tmp_path, "y", FINISH, after=("x",))], log=messages.append)


def test_runner_clears_a_half_done_job_that_cannot_resume(tmp_path):
  job = _job(tmp_path, "l2s", FINISH, resumes=False)
  os.makedirs(job.out_dir)
  open(os.path.join(job.out_dir, "stale"), "w").close()
  seeds.run_jobs([job], parallel=1, log=lambda m: None)
  assert job.done() and not os.path.exists(os.path.join(job.out_dir, "stale"))


@pytest.mark.skipif(len(seeds.available_cpus()) < 2, reason="needs two cores")
def test_runner_runs_jobs_at_once_each_on_its_own_cores(tmp_path):
  # Each job waits until the other has started: run one after the other, both would fail.
  script = ("import json, os, sys, time; out = sys.argv[1]; "
            "open(os.path.join(out, 'started'), 'w').close(); "
            "other = os.path.join(os.path.dirname(out), {other!r}, 'started'); "
            "deadline = time.time() + 60; "
            "exec('while not os.path.exists(other):\\n assert time.time() < deadline\\n "
            "time.sleep(0.05)'); "
            "json.dump({{'rl_accuracy': 1.0, 'cpus': sorted(os.sched_getaffinity(0))}}, "
            "open(os.path.join(out, 'summary.json'), 'w'))")
  jobs = [_job(tmp_path, "a", script.format(other="b")),
          _job(tmp_path, "b", script.format(other="a"))]
  seeds.run_jobs(jobs, parallel=2, threads=1, log=lambda m: None)
  cpus = [seeds.finished(j.out_dir)["cpus"] for j in jobs]
  assert all(len(c) == 1 for c in cpus) and cpus[0] != cpus[1]


def test_config_jobs_give_each_seed_its_dir_and_train_seed(tmp_path):
  jobs = seeds.config_jobs(["q.gin"], ["FromRun.path = 'runs/warm/seed{seed}'"],
                           str(tmp_path / "runs"), range(2))
  assert [j.out_dir for j in jobs] == [str(tmp_path / "runs" / f"seed{k}") for k in (0, 1)]
  argv = list(jobs[1].argv)
  assert argv[argv.index("--gin") + 1] == "q.gin"
  bindings = [argv[i + 1] for i, a in enumerate(argv) if a == "--gin_param"]
  assert "train.seed = 1" in bindings and "FromRun.path = 'runs/warm/seed1'" in bindings
  assert argv[-2:] == ["--run_dir", jobs[1].out_dir]


@pytest.mark.slow
def test_seeds_command_runs_the_quickstart_over_two_seeds(tmp_path):
  out = str(tmp_path / "quick")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments/seeds.py"),
       "--gin", os.path.join(ROOT, "experiments/configs/quickstart.gin"),
       "--gin", os.path.join(ROOT, "experiments/configs/tiny.gin"),
       "--run_dir", out, "--seeds", "2", "--jobs", "1"],
      capture_output=True, text=True, cwd=ROOT, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  runs = seeds.read(out)
  assert sorted(runs) == [0, 1] and all("rl_accuracy" in r["summary"] for r in runs.values())
  assert "train.seed = 1" in open(os.path.join(out, "seed1", "config.gin")).read()
  assert runs[0]["records"] != runs[1]["records"]  # the seeds differ
  again = subprocess.run(result.args, capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert again.returncode == 0 and "to run" not in again.stdout  # both finished: nothing runs
