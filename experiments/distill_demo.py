"""On-policy distillation of two experts into one student, on a 2-core CPU (Kimi K3's merge).

  python experiments/distill_demo.py [--out_dir runs/distill] [--docs docs/distillation]

Two arithmetic domains, sums of two and of three 2-digit numbers ("add2", "add3"), with the
quickstart's sloppy demonstrator (it forgets the final carry in 60% of the problems whose
last column carries). One SFT warm start on both domains; one expert per domain, RL (k1.5)
from that warm start on its domain alone; then from the same warm start
- the student: on-policy distillation (loss `opd`) on both domains, each prompt scored by its
  domain's expert;
- the baseline: SFT on the experts' own samples (each on its domain, temperature 1), as many
  tokens as the student generated.
Held-out greedy accuracy per domain (256 problems each) for every model, and the student's
over distillation steps, go to DOCS/results.json and DOCS/plot.png. Runs resume: a finished
stage is read back from OUT_DIR, the student's curve from OUT_DIR/student/curve.json.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from models import host_allocator  # noqa: E402

host_allocator.keep_freed_memory()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models import config, transformer  # noqa: E402
from models.tokenizer import CharTokenizer  # noqa: E402
from rl import checkpoint, distill, rollout, sft, trainer  # noqa: E402
from rl import eval as eval_lib  # noqa: E402
from rl.config import RLConfig  # noqa: E402
from rl.tasks.arithmetic import Arithmetic  # noqa: E402
from rl.tasks.mixture import Mixture  # noqa: E402
from rollouts.engine import SamplingParams  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402

DOMAINS = {"add2": Arithmetic(digits=2, operands=2, sloppy=0.6),
           "add3": Arithmetic(digits=2, operands=3, sloppy=0.6)}
RL = RLConfig(prompts_per_step=32, samples_per_prompt=8, max_new_tokens=40, seq_len=128)
EVAL_RECORDS = 256


def model(vocab: int):
  return config.tiny(vocab, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384)


def run(run_dir: str, *, task, num_steps: int, init_from: str | None = None,
        loss: str = "k1.5", teachers=None) -> dict:
  summary = os.path.join(run_dir, "summary.json")
  if os.path.exists(summary) and json.load(open(summary)).get("steps", -1) >= num_steps:
    return json.load(open(summary))
  return trainer.train(
      run_dir, task=task, model=model, rl=dataclasses.replace(RL, num_steps=num_steps),
      objective=trainer.Objective(loss=loss, teachers=teachers),
      start=trainer.FromRun(init_from) if init_from else trainer.WarmStart(steps=600,
                                                                          batch_size=64),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=EVAL_RECORDS),
                          checkpoint_every=10, progress=False))


def per_domain(params, cfg, tokenizer, task: Mixture) -> dict[str, float]:
  engine = JaxEngine(cfg, params)
  return {name: eval_lib.greedy_eval(engine, task.only(name), tokenizer,
                                     num_records=EVAL_RECORDS,
                                     max_new_tokens=RL.max_new_tokens)["accuracy"]
          for name in task.tasks}


def expert_samples(experts: dict[str, JaxEngine], task: Mixture, tokenizer, tokens: int,
                   seed: int = 0):
  """(prompt ids, completion ids) pairs sampled by each domain's expert on its domain's train
  prompts, the domains alternating, until they hold `tokens` completion tokens."""
  sampling = SamplingParams(max_new_tokens=RL.max_new_tokens, stop_token_ids=(tokenizer.eos_id,))
  examples, total, start = [], 0, 0
  while total < tokens:
    for name, engine in experts.items():
      domain = task.only(name)
      records = [domain.train[i] for i in range(start, start + 64)]
      for t in rollout.generate(engine, domain, tokenizer, records, sampling,
                                seed=seed + start):
        examples.append((list(t.prompt_ids), list(t.token_ids)))
        total += len(t.token_ids)
    start += 64
  return examples


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out_dir", default=os.path.join(ROOT, "runs", "distill"))
  parser.add_argument("--docs", default=os.path.join(ROOT, "docs", "distillation"))
  parser.add_argument("--expert_steps", type=int, default=100)
  parser.add_argument("--student_steps", type=int, default=60)
  parser.add_argument("--chunk", type=int, default=10, help="student steps between evals")
  args = parser.parse_args(argv)
  started = time.perf_counter()
  tokenizer = CharTokenizer()
  cfg = model(tokenizer.vocab_size)
  task = Mixture(DOMAINS)
  out = lambda name: os.path.join(args.out_dir, name)
  like = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
  load = lambda name: checkpoint.load_policy(out(name), like=like)

  run(out("sft"), task=task, num_steps=0)
  for name in DOMAINS:
    run(out(f"expert_{name}"), task=task.only(name), init_from=out("sft"),
        num_steps=args.expert_steps)
  teachers = lambda c: distill.from_checkpoints(
      c, paths={n: out(f"expert_{n}") for n in DOMAINS}, routes={n: n for n in DOMAINS})
  # The curve is kept in OUT_DIR: a finished student's earlier steps cannot be evaluated again
  # (only its last checkpoints are kept), so a rerun reads them back instead.
  curve_path = os.path.join(out("student"), "curve.json")
  saved = ({int(k): v for k, v in json.load(open(curve_path)).items()}
           if os.path.exists(curve_path) else {})
  curve = {0: saved.get(0) or per_domain(load("sft"), cfg, tokenizer, task)}
  for steps in range(args.chunk, args.student_steps + 1, args.chunk):
    if steps in saved:
      curve[steps] = saved[steps]
      continue
    summary = run(out("student"), task=task, init_from=out("sft"), loss="opd",
                  teachers=teachers, num_steps=steps)
    if summary["steps"] != steps:
      print(f"student is at step {summary['steps']}, not {steps}, and {curve_path} has no "
            f"evaluation of step {steps}: that point is left out")
      continue
    curve[steps] = per_domain(load("student"), cfg, tokenizer, task)
    print(f"student at step {steps}: {curve[steps]}")
    with open(curve_path, "w") as f:
      json.dump({str(k): v for k, v in sorted(curve.items())}, f, indent=1)
  records = [json.loads(line) for line in open(os.path.join(out("student"), "metrics.jsonl"))]
  student_tokens = int(sum(r["completion_length"] * RL.prompts_per_step * RL.samples_per_prompt
                           for r in records if r.get("step", 0) > 0))

  experts = {n: JaxEngine(cfg, load(f"expert_{n}")) for n in DOMAINS}
  baseline_path = out("baseline_sft_on_expert_samples")
  if not os.path.isdir(os.path.join(baseline_path, "checkpoints")):
    examples = expert_samples(experts, task, tokenizer, student_tokens)
    example = lambda i: (examples[i][0], examples[i][1] + [tokenizer.eos_id])
    params, _ = sft.fit(load("sft"), cfg, example, len(examples),
                        steps=max(1, len(examples) // 64), batch_size=64, learning_rate=1e-3,
                        seq_len=RL.seq_len, progress=False, desc="SFT on expert samples")
    checkpoint.save_policy(baseline_path, params)
  results = {
      "domains": {n: {"digits": t.digits, "operands": t.operands, "sloppy": t.sloppy}
                  for n, t in DOMAINS.items()},
      "eval_records_per_domain": EVAL_RECORDS,
      "expert_steps": args.expert_steps, "student_steps": args.student_steps,
      "student_tokens": student_tokens,
      "accuracy": {
          "sft": curve[0],
          **{f"expert_{n}": per_domain(load(f"expert_{n}"), cfg, tokenizer, task)
             for n in DOMAINS},
          "student": curve[max(curve)],
          "baseline_sft_on_expert_samples": per_domain(
              checkpoint.load_policy(baseline_path, like=like), cfg, tokenizer, task)},
      "student_curve": {str(k): v for k, v in sorted(curve.items())},
      "minutes": (time.perf_counter() - started) / 60,
  }
  os.makedirs(args.docs, exist_ok=True)
  with open(os.path.join(args.docs, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  plot(results, os.path.join(args.docs, "plot.png"))
  print(json.dumps(results["accuracy"], indent=1))


def plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  domains = list(results["domains"])
  fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 3.6), sharey=True)
  steps = [int(s) for s in results["student_curve"]]
  for ax, name in zip(np.atleast_1d(axes), domains):
    acc = results["accuracy"]
    ax.plot(steps, [results["student_curve"][str(s)][name] for s in steps], marker="o",
            label="student (opd)")
    for key, style, color in ((f"expert_{name}", "--", "tab:orange"),
                              ("baseline_sft_on_expert_samples", ":", "tab:green"),
                              ("sft", "-.", "gray")):
      ax.axhline(acc[key][name], linestyle=style, color=color, label=key.replace("_", " "))
    ax.set(title=f"{name}: held-out greedy accuracy", xlabel="distillation step",
           ylim=(0, 1.02))
    ax.legend(fontsize=8, loc="lower right")
  np.atleast_1d(axes)[0].set_ylabel("accuracy")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  main()
