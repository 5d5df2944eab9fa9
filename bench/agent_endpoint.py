"""The agent endpoint (rl/agents/) against calling the engine directly, and episodes per second
with 64 agents at once, on this machine. Not a test.

  python bench/agent_endpoint.py [--calls 30] [--agents 64] [--episodes 256] [--out bench/results]

(writes bench/results/agent_endpoint.json)

On the untrained tiny Qwen2 of experiments/tiny_checkpoint.py (its 2 layers of 128, the
embedded engine in float32), replies of up to 16 tokens at temperature 1:
  per call   one chat completion at a time, --calls times each, alternating: the official
             `openai` client through the endpoint (render, HTTP, queue, record, reply), and
             engine.generate on the same prompt's ids; the median of each, and their ratio
  agents     --episodes episodes on --agents threads at once, each an agent of three calls
             (ask; a tool's result and ask again; ask once more) through the `openai` client,
             every call a fresh sample; episodes and calls per second over the whole run
             (after two untimed runs of as many episodes, in which the engine compiles the
             batch and prompt shapes the calls take); against the engine alone given the
             same calls' prompts in waves of --agents episodes, one engine.generate per turn
             (what rl/envs/driver.py's waves would make of them)
XLA:CPU on this machine's cores; the first calls of each side compile and are not timed.
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import openai  # noqa: E402

from experiments import tiny_checkpoint  # noqa: E402
from rl.agents import chat as chatlib  # noqa: E402
from rl.agents.endpoint import AgentEndpoint  # noqa: E402
from rl.pretrained import HFCheckpoint  # noqa: E402
from rollouts.engine import SamplingParams  # noqa: E402
from rollouts.jax_engine import JaxEngine  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 12+30+45?"}]


def _episode(endpoint: AgentEndpoint) -> list:
  """One agent's episode of three calls in one conversation; each call's prompt ids."""
  session = endpoint.open_session()
  client = openai.OpenAI(base_url=endpoint.url, api_key=session.key, max_retries=0)
  messages = list(MESSAGES)
  for turn in range(3):
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages += [reply.choices[0].message.model_dump(include={"role", "content"}),
                 {"role": "user", "content": f"The tool says {turn}. Once more?"}]
  endpoint.close_session(session)
  return [call.plan.prompt_ids.tolist() for call in session.calls]


class Timed:
  """The engine, its generate calls counted and timed (what the endpoint's queue made of the
  agents' calls)."""

  def __init__(self, engine):
    self.engine, self.batches = engine, []

  @property
  def capabilities(self):
    return self.engine.capabilities

  def generate(self, prompts, *args, **kwargs):
    started = time.perf_counter()
    out = self.engine.generate(prompts, *args, **kwargs)
    self.batches.append((len(prompts), time.perf_counter() - started))
    return out


def per_call(endpoint: AgentEndpoint, engine, chat, sampling, calls: int) -> dict:
  session = endpoint.open_session()
  client = openai.OpenAI(base_url=endpoint.url, api_key=session.key, max_retries=0)
  ids = chatlib.render(chat, MESSAGES)
  through, direct = [], []
  for i in range(calls + 2):  # the first two of each compile
    started = time.perf_counter()
    client.chat.completions.create(model="policy", messages=MESSAGES)
    middle = time.perf_counter()
    engine.generate([ids], sampling, seed=i)
    done = time.perf_counter()
    if i >= 2:
      through.append(middle - started)
      direct.append(done - middle)
  endpoint.close_session(session)
  out = {"endpoint_s": statistics.median(through), "engine_s": statistics.median(direct)}
  out["endpoint_over_engine"] = out["endpoint_s"] / out["engine_s"]
  out["overhead_ms"] = 1000 * (out["endpoint_s"] - out["engine_s"])
  return out


def _engine_alone(engine, sampling, prompts: list, agents: int) -> float:
  """Seconds the engine alone takes for `prompts` (per episode, its calls' prompts) in
  waves of `agents` episodes, one engine.generate per turn of a wave."""
  started = time.perf_counter()
  for wave in range(0, len(prompts), agents):
    episodes = prompts[wave:wave + agents]
    for turn in range(len(episodes[0])):
      engine.generate([p[turn] for p in episodes], sampling, seed=wave + turn)
  return time.perf_counter() - started


def concurrent_agents(endpoint: AgentEndpoint, timed: Timed, sampling, agents: int,
                      episodes: int, warm_rounds: int = 2) -> dict:
  engine = timed.engine
  with concurrent.futures.ThreadPoolExecutor(agents) as pool:
    for _ in range(warm_rounds):  # until the engine has compiled the shapes the calls take
      list(pool.map(lambda _: _episode(endpoint), range(episodes)))
    timed.batches.clear()
    started = time.perf_counter()
    prompts = list(pool.map(lambda _: _episode(endpoint), range(episodes)))
    seconds = time.perf_counter() - started
  batches = list(timed.batches)
  _engine_alone(engine, sampling, prompts, agents)  # compiled at these shapes
  alone = _engine_alone(engine, sampling, prompts, agents)
  calls = sum(map(len, prompts))
  return {"agents": agents, "episodes": episodes, "calls": calls, "seconds": seconds,
          "episodes_per_s": episodes / seconds, "calls_per_s": calls / seconds,
          "engine_alone_episodes_per_s": episodes / alone,
          "endpoint_over_engine_alone": alone / seconds,
          "engine_alone_s": alone, "engine_in_endpoint_s": sum(b[1] for b in batches),
          "batches": len(batches), "mean_batch": calls / len(batches),
          "wave_batches": -(-episodes // agents) * 3}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--agents", type=int, default=64)
  parser.add_argument("--episodes", type=int, default=256)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    path = tiny_checkpoint.make(tmp, sft_steps=0, progress=False)
    checkpoint = HFCheckpoint(path, dtype="float32")
    cfg = checkpoint(0)
    chat = checkpoint.tokenizer()
    engine = Timed(JaxEngine(cfg, checkpoint.load(cfg)))
  sampling = SamplingParams(max_new_tokens=16, temperature=1.0,
                            stop_token_ids=chat.stop_token_ids)
  with AgentEndpoint(engine, chat, sampling) as endpoint:
    results = {"per_call": per_call(endpoint, engine.engine, chat, sampling, args.calls),
               "concurrent": concurrent_agents(endpoint, engine, sampling, args.agents,
                                               args.episodes)}
  results["config"] = {"max_new_tokens": 16, "model": "tiny_checkpoint qwen2, untrained",
                       "calls": args.calls}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "agent_endpoint.json"), "w") as f:
    json.dump(results, f, indent=1)
  c, a = results["per_call"], results["concurrent"]
  print(f"per call: endpoint {c['endpoint_s'] * 1000:.1f} ms, engine {c['engine_s'] * 1000:.1f} "
        f"ms, endpoint / engine {c['endpoint_over_engine']:.2f} ({c['overhead_ms']:.1f} ms)")
  print(f"{a['agents']} agents: {a['episodes_per_s']:.2f} episodes/s, {a['calls_per_s']:.1f} "
        f"calls/s ({a['episodes']} episodes of 3 calls in {a['seconds']:.1f} s); the engine "
        f"alone {a['engine_alone_episodes_per_s']:.2f} episodes/s, through the endpoint "
        f"{a['endpoint_over_engine_alone']:.2f} of it")
  print(f"the engine's calls in the endpoint: {a['batches']} of {a['mean_batch']:.1f} prompts, "
        f"{a['engine_in_endpoint_s']:.1f} s; alone: {a['wave_batches']} of {a['agents']}, "
        f"{a['engine_alone_s']:.1f} s")


if __name__ == "__main__":
  main()
