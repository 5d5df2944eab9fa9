"""Seeds as an axis of every experiment: one run directory per seed, and a runner that
starts the runs as parallel subprocesses.

    python experiments/seeds.py --gin FILE [--gin FILE ...] [--gin_param BINDING ...] \
        --run_dir DIR [--seeds 5] [--jobs N] [--threads T]

runs experiments/run.py once per seed k in DIR/seed<k> with `train.seed = k` (a literal
"{seed}" in a binding becomes k, e.g. "FromRun.path = 'runs/warm/seed{seed}'" with
"train.start = @FromRun()").
experiments/compare.py reads such directories back; experiments/findings.py builds its arms
over seeds with the same runner.

The runner (`run_jobs`) takes jobs (a command, its output directory, the jobs it waits
for), skips finished ones (a run whose summary.json holds rl_accuracy), resumes
half-done ones (run.py resumes from the run's checkpoint) and starts the rest `jobs` at a
time, each pinned to its own `threads` cores. Each job's output goes to OUT_DIR/job.log
and its command and wall time to OUT_DIR/job.json. Owns the seed<k> layout; knows nothing
of what the runs compute.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import IO, Callable, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl import metrics as metrics_lib  # noqa: E402

# A findings run (tiny model, CPU) keeps about two cores busy: JAX's CPU thread pool for the
# train step and the embedded sampler, and the Python loop.
THREADS = 2
_SEED_DIR = re.compile(r"seed(\d+)$")


def seed_dir(run_dir: str, seed: int) -> str:
  return os.path.join(run_dir, f"seed{seed}")


def seeds_in(run_dir: str) -> list[int]:
  """The seeds k with a run_dir/seed<k> directory, in order."""
  if not os.path.isdir(run_dir):
    return []
  return sorted(int(m.group(1)) for name in os.listdir(run_dir)
                if (m := _SEED_DIR.fullmatch(name)) and os.path.isdir(os.path.join(run_dir, name)))


def finished(out_dir: str, file: str = "summary.json", key: str | None = "rl_accuracy"):
  """out_dir/file's JSON if it exists (and holds `key`): what a job writes last."""
  path = os.path.join(out_dir, file)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    content = json.load(f)
  return content if key is None or key in content else None


def read(run_dir: str) -> dict[int, dict]:
  """{seed: {"summary": summary.json or {}, "records": metrics.jsonl}} of run_dir's seed<k>
  directories; a run directory without them is one run, read as seed 0."""
  dirs = {k: seed_dir(run_dir, k) for k in seeds_in(run_dir)} or {0: run_dir}
  if not any(os.path.exists(os.path.join(d, "metrics.jsonl")) for d in dirs.values()):
    raise FileNotFoundError(f"{run_dir}: no metrics.jsonl there nor in seed<k>/ below it")
  return {seed: read_run(d) for seed, d in dirs.items()}


def read_run(run_dir: str) -> dict:
  """{"summary": summary.json or {}, "records": metrics.jsonl} of one run."""
  return {"summary": finished(run_dir, key=None) or {},
          "records": metrics_lib.read(os.path.join(run_dir, "metrics.jsonl"))}


# ----------------------------------------------------------------------------- the runner

@dataclasses.dataclass(frozen=True)
class Job:
  """One subprocess: `argv`, run in the repository root, writing `out_dir`; done when
  out_dir/done_file exists (holding done_key). `resumes`: a half-done out_dir is continued
  (run.py); otherwise it is cleared before the job starts again."""
  name: str
  argv: tuple[str, ...]
  out_dir: str
  after: tuple[str, ...] = ()  # names of jobs that must have finished first
  done_file: str = "summary.json"
  done_key: str | None = "rl_accuracy"
  resumes: bool = True

  def done(self) -> bool:
    return finished(self.out_dir, self.done_file, self.done_key) is not None


def available_cpus() -> list[int]:
  return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
      range(os.cpu_count() or 1))


def default_jobs(threads: int = THREADS) -> int:
  """As many runs at once as the cores allow at `threads` each."""
  return max(1, len(available_cpus()) // threads)


def seconds(out_dir: str) -> float | None:
  """The wall time the runner recorded for the job that wrote out_dir (None if none)."""
  record = finished(out_dir, "job.json", "seconds")
  return None if record is None else record["seconds"]


def run_jobs(jobs: list[Job], *, parallel: int | None = None, threads: int = THREADS,
             log: Callable[[str], None] = print, in_process: bool = False) -> None:
  """Run the unfinished `jobs`, `parallel` at a time (default: default_jobs(threads)), each
  after the jobs it names in `after`; with parallel x threads cores to spare each job is
  pinned to its own `threads` of them. `in_process`: in `parallel` worker processes that each
  run job after job in themselves (`run_in_process`: no interpreter start-up per job, and
  compiled programs shared between runs: what tiny runs spend most of their time on). A
  failing job does not stop the others (those after it are skipped); the call then raises
  RuntimeError naming the failed jobs and their logs."""
  if in_process:
    return _run_in_workers(jobs, parallel or default_jobs(threads), threads, log)
  by_name = {}
  for job in jobs:
    if job.name in by_name:
      raise ValueError(f"run_jobs: two jobs named {job.name!r}")
    by_name[job.name] = job
  for job in jobs:
    unknown = [a for a in job.after if a not in by_name]
    if unknown:
      raise ValueError(f"run_jobs: job {job.name!r} waits for unknown job(s) {unknown}")
  parallel = parallel or default_jobs(threads)
  cpus = available_cpus()
  pin = parallel * threads <= len(cpus)
  slots = [cpus[i * threads:(i + 1) * threads] if pin else None for i in range(parallel)]
  done = {job.name for job in jobs if job.done()}
  waiting = [job for job in jobs if job.name not in done]
  failed, skipped, running = [], [], {}  # running: name -> _Running
  if waiting:
    log(f"{len(waiting)} of {len(jobs)} job(s) to run, {parallel} at a time"
        + (f" on {threads} core(s) each" if pin else ""))
  try:
    while waiting or running:
      for job in list(waiting):  # those after a failed job will never start
        if any(a in failed or a in skipped for a in job.after):
          waiting.remove(job)
          skipped.append(job.name)
          log(f"skipped {job.name} (after a failed job)")
      free = [s for s in range(parallel) if s not in {r.slot for r in running.values()}]
      for job in [j for j in waiting if all(a in done for a in j.after)][:len(free)]:
        waiting.remove(job)
        slot = free.pop(0)
        running[job.name] = _Running(job, *_start(job, slots[slot]), slot,
                                     time.perf_counter())
        log(f"started {job.name}" + (f" (cores {slots[slot]})" if pin else ""))
      if not running:
        break
      time.sleep(0.2)
      for name, (job, process, log_file, slot, started) in list(running.items()):
        if process.poll() is None:
          continue
        log_file.close()
        del running[name]
        elapsed = time.perf_counter() - started
        with open(os.path.join(job.out_dir, "job.json"), "w") as f:
          json.dump({"argv": list(job.argv), "seconds": elapsed,
                     "returncode": process.returncode, "cores": slots[slot]}, f, indent=2)
        if process.returncode == 0 and job.done():
          done.add(name)
          log(f"finished {name} in {elapsed:.0f} s")
        else:
          failed.append(name)
          log(f"FAILED {name} (exit {process.returncode}); last lines of "
              f"{log_file.name}:\n{_tail(log_file.name)}")
  except BaseException:  # KeyboardInterrupt included: no run outlives the runner
    for r in running.values():
      r.process.terminate()
    for r in running.values():
      r.process.wait()
      r.log_file.close()
    raise
  if waiting:
    raise ValueError(f"run_jobs: {[j.name for j in waiting]} wait for each other")
  if failed:
    raise RuntimeError(f"{len(failed)} job(s) failed: " + ", ".join(
        f"{n} (log {os.path.join(by_name[n].out_dir, 'job.log')})" for n in failed)
        + (f"; {len(skipped)} skipped after them" if skipped else ""))


def _run_in_workers(jobs: list[Job], parallel: int, threads: int,
                    log: Callable[[str], None]) -> None:
  """run_jobs's in-process mode: `parallel` worker processes (each pinned to its own
  `threads` cores when there are enough), each job sent to a free one once the jobs it waits
  for are done."""
  import multiprocessing
  done = {job.name for job in jobs if job.done()}
  waiting, failed, running = [job for job in jobs if job.name not in done], [], {}
  if not waiting:
    return
  cpus = available_cpus()
  cores = ([cpus[i * threads:(i + 1) * threads] for i in range(parallel)]
           if parallel * threads <= len(cpus) else None)
  log(f"{len(waiting)} of {len(jobs)} job(s) to run in {parallel} worker process(es)")
  context = multiprocessing.get_context("spawn")  # no JAX state forked into the workers
  slots = context.Queue()
  for slot in range(parallel):
    slots.put(cores[slot] if cores else None)
  with context.Pool(parallel, initializer=_pin, initargs=(slots,)) as pool:
    while waiting or running:
      for job in [j for j in waiting if any(a in failed for a in j.after)]:
        waiting.remove(job)
        failed.append(job.name)
        log(f"skipped {job.name} (after a failed job)")
      for job in [j for j in waiting if all(a in done for a in j.after)][
          :parallel - len(running)]:
        waiting.remove(job)
        running[job.name] = (job, pool.apply_async(_timed, (job,)))
      if not running:
        if waiting:
          raise ValueError(f"run_jobs: {[j.name for j in waiting]} wait for each other")
        break
      time.sleep(0.05)
      for name, (job, result) in list(running.items()):
        if not result.ready():
          continue
        del running[name]
        returncode, elapsed = result.get()
        if returncode == 0 and job.done():
          done.add(name)
          log(f"finished {name} in {elapsed:.1f} s")
        else:
          failed.append(name)
          log(f"FAILED {name}; last lines of its log:\n"
              f"{_tail(os.path.join(job.out_dir, 'job.log'))}")
  if failed:
    raise RuntimeError(f"{len(failed)} job(s) failed or were skipped: {', '.join(failed)}")


def _pin(slots) -> None:
  """A worker process's start: pinned to the cores of the next free slot (before anything
  starts threads: XLA sizes its CPU thread pool from this affinity)."""
  cores = slots.get()
  if cores:
    os.sched_setaffinity(0, cores)


def _timed(job: Job) -> tuple[int, float]:
  """run_in_process(job) and its wall time, recorded in out_dir/job.json."""
  started = time.perf_counter()
  returncode = run_in_process(job)
  elapsed = time.perf_counter() - started
  with open(os.path.join(job.out_dir, "job.json"), "w") as f:
    json.dump({"argv": list(job.argv), "seconds": elapsed, "returncode": returncode,
               "cores": sorted(os.sched_getaffinity(0))}, f, indent=2)
  return returncode, elapsed


def run_in_process(job: Job) -> int:
  """`job` in this process: its script's main(argv) (experiments/run.py, eval.py or
  long2short.py), gin cleared first, output to out_dir/job.log. Returns 0, or 1 when it
  failed (its error at the end of the log)."""
  import contextlib
  import importlib
  import traceback

  import gin
  script = os.path.splitext(os.path.basename(job.argv[1]))[0]
  main = importlib.import_module(f"experiments.{script}").main
  if not job.resumes and os.path.isdir(job.out_dir):
    shutil.rmtree(job.out_dir)  # unfinished (finished jobs never start): start afresh
  os.makedirs(job.out_dir, exist_ok=True)
  cwd = os.getcwd()
  with open(os.path.join(job.out_dir, "job.log"), "a") as log_file, \
      contextlib.redirect_stdout(log_file), contextlib.redirect_stderr(log_file):
    try:
      os.chdir(ROOT)
      gin.clear_config()
      main(list(job.argv[2:]))
      return 0
    except (Exception, SystemExit):  # noqa: BLE001 - a failed run fails its job, not the rest
      traceback.print_exc(file=log_file)
      return 1
    finally:
      gin.clear_config()
      os.chdir(cwd)


class _Running(NamedTuple):
  job: Job
  process: subprocess.Popen
  log_file: IO
  slot: int
  started: float


def _start(job: Job, cores):
  if not job.resumes and os.path.isdir(job.out_dir):
    shutil.rmtree(job.out_dir)  # unfinished (finished jobs never start): start afresh
  os.makedirs(job.out_dir, exist_ok=True)
  log_file = open(os.path.join(job.out_dir, "job.log"), "a")
  process = subprocess.Popen(job.argv, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
  if cores:
    # Set right after the exec, before the interpreter has imported anything that starts
    # threads; XLA sizes its CPU thread pool from this affinity.
    os.sched_setaffinity(process.pid, cores)
  return process, log_file


def _tail(path: str, lines: int = 15) -> str:
  with open(path, errors="replace") as f:
    return "".join(f.readlines()[-lines:])


# ----------------------------------------------------------------------------- one config

def config_jobs(files, bindings, run_dir: str, seeds) -> list[Job]:
  """run.py with `files` and `bindings` once per seed, in run_dir/seed<k>."""
  run_py = os.path.join(ROOT, "experiments/run.py")
  jobs = []
  for k in seeds:
    argv = [sys.executable, run_py, *[a for f in files for a in ("--gin", f)]]
    for binding in [*bindings, f"train.seed = {k}", "Hooks.progress = False"]:
      argv += ["--gin_param", binding.replace("{seed}", str(k))]
    out = seed_dir(run_dir, k)
    jobs.append(Job(out, (*argv, "--run_dir", out), out))
  return jobs


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin", action="append", required=True, metavar="FILE")
  parser.add_argument("--gin_param", action="append", default=[], metavar="BINDING")
  parser.add_argument("--run_dir", required=True, help="the runs go to RUN_DIR/seed<k>")
  parser.add_argument("--seeds", type=int, default=5, help="seeds 0..SEEDS-1 (default 5)")
  parser.add_argument("--jobs", type=int, default=None,
                      help="runs at once (default: cores / threads)")
  parser.add_argument("--threads", type=int, default=THREADS,
                      help=f"cores per run (default {THREADS})")
  args = parser.parse_args(argv)
  for path in args.gin:
    if not os.path.isfile(path):
      raise SystemExit(f"error: gin config file not found: {path}")
  files = [os.path.abspath(f) for f in args.gin]
  run_jobs(config_jobs(files, args.gin_param, os.path.abspath(args.run_dir),
                       range(args.seeds)), parallel=args.jobs, threads=args.threads)
  print(f"runs: {os.path.join(args.run_dir, 'seed<k>')} for k < {args.seeds}; compare them "
        f"with python experiments/compare.py {args.run_dir} OTHER_RUN_DIR")


if __name__ == "__main__":
  main()
