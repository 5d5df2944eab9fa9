"""Train an agent someone else wrote: experiments/agents/calculator.py (the `openai` package
alone, a calculator it calls through function calling) on the tiny pretrained checkpoint,
through the agent endpoint, until its success rate rises.

  python experiments/agent_demo.py [--out runs/agent_demo] [--steps 20]

1. The tiny Qwen2 of experiments/tiny_checkpoint.py, its SFT demonstrations a mix of worked
   sums (60% of those with a final carry drop it: a sloppy demonstrator) and calls of the
   `calc` tool (30%, always right once the model copies the tool's answer).
2. The agent's held-out success (the task's verifier on its answer) and how often it calls the
   calculator, greedy, over the test split: before RL.
3. RL (GRPO) whose rollouts are the agent's own episodes (rl.agents.rollouts.AgentRollouts),
   rewarded 1 when the task verifies the agent's answer.
4. The same held-out figures after RL, the exported checkpoint's; OUT/agent_demo.png (the
   training reward and call rate per step, before and after) and OUT/results.json.
The trainer's own held-out evaluation (its sft_accuracy / rl_accuracy line) gives the model
the bare question and answers no tool call: it falls as the model learns to call the
calculator. The agent's success is this demo's figure.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import tiny_checkpoint  # noqa: E402
from experiments.agents import calculator  # noqa: E402
from rl import rewards, trainer  # noqa: E402
from rl.agents import rollouts as agent_rollouts  # noqa: E402
from rl.config import RLConfig  # noqa: E402
from rl.pretrained import HFCheckpoint  # noqa: E402
from rl.tasks.math import MathTask  # noqa: E402
from rollouts.engine import SamplingParams  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402


def agent(base_url: str, api_key: str, record: dict) -> dict:
  """The agent on one task record: it is given the question only."""
  return calculator.solve(base_url, api_key, record["question"])


def reward_of(task):
  def reward(record, result, session):
    del session
    return float(task.verify(result["answer"], record))
  return reward


def held_out(path: str, task, records: int) -> dict:
  """The agent's greedy success and call rate on the first `records` test records, with the
  checkpoint in `path`."""
  checkpoint = HFCheckpoint(path, dtype="float32")
  cfg, chat = checkpoint(0), checkpoint.tokenizer()
  engine = JaxEngine(cfg, checkpoint.load(cfg))
  sampling = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=chat.stop_token_ids)
  return agent_rollouts.evaluate(engine, chat, agent, task.test[:records], reward_of(task),
                                 sampling)


def plot(metrics: list[dict], before: dict, after: dict, out: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [m["step"] for m in metrics]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
  left.plot(steps, [m["agent_reward_mean"] for m in metrics], label="reward (success)")
  left.plot(steps, [m["agent_tool_calls_rate"] for m in metrics], label="episodes calling calc")
  left.set(xlabel="RL step", ylim=(0, 1), title="the agent's training episodes")
  left.legend()
  names = ["success", "tool_calls_rate"]
  for k, (label, values) in enumerate((("before RL", before), ("after RL", after))):
    right.bar([i + 0.4 * k for i in range(2)], [values[n] for n in names], width=0.4,
              label=label)
  right.set_xticks([0.2, 1.2], ["held-out success", "calls calc"])
  right.set(ylim=(0, 1), title="held out, greedy")
  right.legend(loc="upper left")
  fig.tight_layout()
  path = os.path.join(out, "agent_demo.png")
  fig.savefig(path, dpi=110)
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="runs/agent_demo")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--samples", type=int, default=8)
  parser.add_argument("--held_out", type=int, default=200)
  parser.add_argument("--sft_steps", type=int, default=600)
  args = parser.parse_args(argv)
  started = time.perf_counter()
  checkpoint = os.path.join(args.out, "checkpoint")
  if not os.path.isfile(os.path.join(checkpoint, "model.safetensors")):
    tiny_checkpoint.make(checkpoint, sft_steps=args.sft_steps, tool_calls=0.3)
  task = MathTask(train_path=f"{checkpoint}/data/train.jsonl",
                  test_path=f"{checkpoint}/data/test.jsonl", fields={"problem": "question"})
  before = held_out(checkpoint, task, args.held_out)
  print(f"before RL: held-out success {before['success']:.2f}, calls calc "
        f"{before['tool_calls_rate']:.2f}")
  run_dir = os.path.join(args.out, "run")
  trainer.train(
      run_dir, task=task, model=HFCheckpoint(checkpoint, dtype="float32"),
      rl=RLConfig(num_steps=args.steps, prompts_per_step=args.prompts,
                  samples_per_prompt=args.samples, max_new_tokens=40, seq_len=256,
                  learning_rate=2e-4, temperature=0.6),
      objective=trainer.Objective(loss="grpo", reward=rewards.named_chain(
          {"episode": rewards.episode_reward()})),
      rollouts=agent_rollouts.AgentRollouts(agent=agent, reward=reward_of(task)),
      hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=args.held_out, every=0),
                          tensorboard=False, samples=0))
  after = held_out(os.path.join(run_dir, "hf"), task, args.held_out)
  print(f"after RL: held-out success {after['success']:.2f}, calls calc "
        f"{after['tool_calls_rate']:.2f}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    metrics = [m for m in map(json.loads, f) if "agent_reward_mean" in m]
  figure = plot(metrics, before, after, args.out)
  results = {"before": before, "after": after, "steps": args.steps, "seconds":
             time.perf_counter() - started, "figure": os.path.basename(figure),
             "reward_per_step": [m["agent_reward_mean"] for m in metrics],
             "tool_calls_rate_per_step": [m["agent_tool_calls_rate"] for m in metrics]}
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(f"success {before['success']:.2f} -> {after['success']:.2f}, calls calc "
        f"{before['tool_calls_rate']:.2f} -> {after['tool_calls_rate']:.2f} "
        f"({results['seconds'] / 60:.1f} min; {figure})")


if __name__ == "__main__":
  main()
