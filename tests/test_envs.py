"""Multi-turn episodes (rl/envs): the driver's round trip and budgets, tool-call formats, tools
that fail, the sandboxed Python tool, training on episodes (masks, log-probs, metrics), the
same episode on the embedded engine and on a server process, partial rollouts of episodes,
the agentic recipe through rl.trainer.train, and the Qwen format with a real BPE tokenizer."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import hf
from rl import ConfigError, corrections, envs, eval as eval_lib, loop, losses, rewards, rollout
from rl import batch as batch_lib
from rl import sft, sources
from rl.config import RLConfig
from rl.packing import trajectory_batch
from rl.tasks.agentic import ToolArithmetic
from rl.tasks.arithmetic import Arithmetic
from rl.train_step import init_train_state, make_train_step, policy_logprobs
from rl.verifiers.code import Limits
from rollouts.engine import Capabilities, Completion, SamplingParams
from rollouts.jax_engine import JaxEngine
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@envs.register_tool("boom")
def _boom(arguments: str) -> str:
  raise RuntimeError("the tool broke")


_RELEASE = threading.Event()  # set at the end of the test that hangs a tool


@envs.register_tool("hang")
def _hang(arguments: str) -> str:
  _RELEASE.wait(60)
  return "late"


@envs.register_tool("flood")
def _flood(arguments: str) -> str:
  return "x" * 1_000_000


class ScriptedEngine:
  """A RolloutEngine whose policy is a function: `policy(context_text) -> (text, eos)`, the
  rest of what it means to write in its current turn given the decoded context (prompt and
  episode so far). Emits those tokens up to max_new or the first stop token (included);
  log-prob of the i-th token of a call: -0.01 * (i + 1). Records every call."""

  capabilities = Capabilities()

  def __init__(self, tokenizer, policy, version: int = 0):
    self.tokenizer, self.policy, self._version = tokenizer, policy, version
    self.calls = []

  @property
  def version(self):
    return self._version

  def update_weights(self, params, version, *, while_generating=False):
    self._version = version
    return 0.0

  def close(self):
    pass

  def generate(self, prompts, sampling, *, seed, affinity=None, max_new_tokens=None,
               on_ready=None, stop_when=None):
    del stop_when  # Capabilities.abort is False: never given
    limits = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
    self.calls.append({"prompts": [tuple(p) for p in prompts], "max_new": list(limits),
                       "affinity": affinity})
    out = []
    for prompt, limit in zip(prompts, limits):
      text, eos = self.policy(self.tokenizer.decode(prompt))
      ids = self.tokenizer.encode(text) + ([self.tokenizer.eos_id] if eos else [])
      stopped = False
      for k, token in enumerate(ids[:limit]):
        if token in sampling.stop_token_ids:
          ids, stopped = ids[:k + 1], True
          break
      ids = ids[:limit]
      out.append(Completion(np.array(ids, np.int32), -0.01 * np.arange(1, len(ids) + 1,
                                                                        dtype=np.float32),
                            "stop" if stopped else "length",
                            np.full(len(ids), self._version, np.int32)))
    if on_ready is not None:
      on_ready(dict(enumerate(out)))
    return out


def calculator_policy(context: str):
  """The winning policy of ToolArithmetic: call calc on the question, copy its result."""
  question, _, episode = context.partition("=")
  result = re.search(r"<result>(.*?)</result>", episode)
  full = f"<calc>{question}</calc>" + (f"<result>{result.group(1)}</result>#"
                                       f"{result.group(1)}" if result else "")
  assert full.startswith(episode), (full, episode)
  return full[len(episode):], result is not None


def mixed_policy(context: str):
  """Answers from the head (one turn, correct) when the question is of even length, else
  calls the calculator (two turns): episodes of different lengths in one step."""
  question = context.partition("=")[0]
  if len(question) % 2:
    return calculator_policy(context)
  return "#" + str(sum(int(x) for x in question.split("+"))), True


class ScriptedEnvironment:
  """Answers turn k with observations[k] and rewards[k]; done after the last one."""

  def __init__(self, observations, rewards, stop_strings=(";",), max_turn_tokens=None):
    self.observations, self.rewards = observations, rewards
    self.stop_strings, self.max_turn_tokens = stop_strings, max_turn_tokens
    self.max_turns = len(observations)
    self.turns = []

  def reset(self, record):
    return 0

  def step(self, state, turn, tokenizer):
    self.turns.append(turn)
    k = turn.index
    done = k == len(self.observations) - 1
    return state + 1, envs.Observation(self.observations[k], self.rewards[k], done=done,
                                       counts={"scripted": 1})

  def close(self):
    pass


def greedy(max_new, tokenizer):
  return SamplingParams(max_new, temperature=0.0, stop_token_ids=(tokenizer.eos_id,))


# --- the driver


def test_scripted_round_trip_masks_exactly_the_policy_tokens(tokenizer):
  """Known turns in, known observation ids out; the packed loss mask covers exactly the
  policy's targets, per-turn rewards sit on each turn's last policy token."""
  enc = tokenizer.encode
  observations = [(40, 41), (42,), ()]
  policy_turns = [enc("ab;"), enc("cd;"), enc("ef") + [tokenizer.eos_id]]
  transcript = policy_turns[0] + [40, 41] + policy_turns[1] + [42] + policy_turns[2]
  prompt = [tokenizer.bos_id] + enc("q=")

  def policy(context):  # the rest of the transcript up to the end of the current turn
    done = tokenizer.encode(context)[len(prompt) - 1:]
    assert transcript[:len(done)] == done
    rest = transcript[len(done):]
    end = next(i for i, t in enumerate(rest) if t in (enc(";")[0], tokenizer.eos_id)) + 1
    return tokenizer.decode(rest[:end]), rest[end - 1] == tokenizer.eos_id

  env = ScriptedEnvironment(observations, [0.5, None, 1.0])
  engine = ScriptedEngine(tokenizer, policy, version=3)
  (episode,) = envs.run_episodes(engine, env, tokenizer, [{}], [prompt], greedy(32, tokenizer),
                                 seed=0)
  assert episode.token_ids.tolist() == transcript
  policy_mask = [True] * 3 + [False] * 2 + [True] * 3 + [False] + [True] * 3
  assert episode.policy_mask.tolist() == policy_mask
  assert episode.finish_reason == "stop" and episode.turns == 3
  assert [t.text for t in env.turns] == ["ab;", "cd;", "ef"]
  assert [t.finish_reason for t in env.turns] == ["stop"] * 3
  assert episode.turn_ends == (3, 8, 12) and episode.turn_rewards == (0.5, None, 1.0)
  assert dict(episode.counts) == {"scripted": 3}
  np.testing.assert_array_equal(episode.logprobs[~episode.policy_mask], 0.0)
  assert (episode.logprobs[episode.policy_mask] < 0).all()
  assert episode.versions.tolist() == [3] * len(transcript)
  # Every continuation went to the same server (one affinity key per episode).
  assert {tuple(c["affinity"]) for c in engine.calls} == {(hash(tuple(prompt)) & 0x7FFFFFFF,)}
  # Training: the loss mask is the policy mask, shifted onto targets.
  masks = batch_lib.train_masks([episode], np.array([True]))
  batch, _ = trajectory_batch([prompt], [episode.token_ids], [episode.logprobs], [1.0], masks,
                              32, token_fields={
                                  "turn_rewards": [episode.turn_reward_tokens()],
                                  "versions": [episode.versions]})
  p, n = len(prompt), len(transcript)
  assert batch.loss_mask[0, p - 1:p - 1 + n].tolist() == policy_mask
  assert batch.loss_mask[0].sum() == sum(policy_mask)
  assert batch.targets[0, p - 1:p - 1 + n].tolist() == transcript
  rewards_at = {int(i): float(batch.turn_rewards[0, i]) for i in
                np.flatnonzero(batch.turn_rewards[0])}
  assert rewards_at == {p - 1 + 2: 0.5, p - 1 + 11: 1.0}
  # "mask" mode drops older tokens and still never trains on observations.
  older, _ = corrections.mask_stale().apply(batch, step=4, trainer_logp=None)
  assert not older.loss_mask.any()
  kept, _ = corrections.mask_stale().apply(batch, step=3, trainer_logp=None)
  assert kept.loss_mask[0, p - 1:p - 1 + n].tolist() == policy_mask


def _turn_credit(logp, batch):
  """A loss that wants the per-turn rewards: REINFORCE on each turn's reward, placed on its
  last policy token (a test of the plumbing, not a recipe)."""
  credit = batch.turn_rewards * batch.loss_mask
  rows = jnp.float32(batch.tokens.shape[0])
  return -credit * logp, {"turn_reward": losses.Weighted(credit.sum(), rows)}


def test_a_loss_reads_the_per_turn_rewards_in_the_train_step(tokenizer, tiny_cfg, tiny_params):
  env = ScriptedEnvironment([(), (), ()], [0.5, None, 1.0])
  turns = iter(["ab;", "cd;", "ef"])
  engine = ScriptedEngine(tokenizer, lambda context: (next(turns), False))
  prompt = tokenizer.encode("xy", add_bos=True)
  (episode,) = envs.run_episodes(engine, env, tokenizer, [{}], [prompt], greedy(8, tokenizer),
                                 seed=0)
  batch, _ = trajectory_batch([prompt], [episode.token_ids], [episode.logprobs], [1.0],
                              batch_lib.train_masks([episode], np.array([True])), 16,
                              token_fields={"turn_rewards": [episode.turn_reward_tokens()]})
  optimizer = loop.rl_optimizer(1e-2)
  # Registered for this test only: the tests over every registered loss run single-turn.
  losses.register("turn_credit", advantage="group_normalized",
                  reads=("turn_rewards",))(_turn_credit)
  try:
    step = make_train_step(tiny_cfg, optimizer, losses.bind("turn_credit"))
  finally:
    del losses.LOSSES["turn_credit"]
  state, metrics = step(init_train_state(tiny_params, optimizer), batch, None)
  assert float(metrics["turn_reward"]) == pytest.approx(1.5)
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state.params, tiny_params)
  assert max(jax.tree.leaves(moved)) > 0


def test_stop_strings_budgets_and_truncation(tokenizer):
  """A multi-token stop string stops at its last token and the turn goes on when the text
  does not end with it (`<calc>`); a turn budget cuts a turn; the sequence budget cuts the
  observation and truncates the episode."""
  task = ToolArithmetic(Arithmetic(digits=3, operands=2))
  records = [task.train[i] for i in range(3)]
  prompts = [rollout.prompt_ids(task, tokenizer, r) for r in records]
  engine = ScriptedEngine(tokenizer, calculator_policy)
  episodes = envs.run_episodes(engine, task.environment, tokenizer, records, prompts,
                               greedy(64, tokenizer), seed=0)
  for record, episode in zip(records, episodes):
    text = tokenizer.decode(episode.token_ids)
    assert text == f"<calc>{record['question']}</calc><result>{record['answer']}</result>" \
                   f"#{record['answer']}"
    assert task.verify(text, record) and episode.finish_reason == "stop"
    assert dict(episode.counts) == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    observed = tokenizer.decode(episode.token_ids[~episode.policy_mask])
    assert observed == f"<result>{record['answer']}</result>"
  # Three waves: to '>' of <calc>, on to </calc>, then the answer.
  assert len(engine.calls) == 3
  # A turn budget of 8 tokens: the call never closes, the episode is truncated (not by the
  # episode's budget).
  cut = envs.ToolEnvironment(("calc",), max_turn_tokens=8)
  (episode,) = envs.run_episodes(ScriptedEngine(tokenizer, calculator_policy), cut, tokenizer,
                                 records[:1], prompts[:1], greedy(64, tokenizer), seed=0)
  assert episode.finish_reason == "length" and not episode.budget_truncated
  assert len(episode.token_ids) == 8 and episode.turns == 1
  # The row holds the call and 3 observation tokens: truncated by the budget.
  call = len(f"<calc>{records[0]['question']}</calc>")
  (episode,) = envs.run_episodes(ScriptedEngine(tokenizer, calculator_policy),
                                 task.environment, tokenizer, records[:1], prompts[:1],
                                 greedy(64, tokenizer), seed=0,
                                 max_sequence_tokens=len(prompts[0]) + call + 3)
  assert episode.finish_reason == "length" and episode.budget_truncated
  assert tokenizer.decode(episode.token_ids[call:]) == "<re"
  # The policy's budget: 10 tokens in all, counted across turns.
  (episode,) = envs.run_episodes(ScriptedEngine(tokenizer, calculator_policy),
                                 task.environment, tokenizer, records[:1], prompts[:1],
                                 greedy(10, tokenizer), seed=0)
  assert envs.policy_tokens(episode) == 10 and episode.budget_truncated


def test_waves_batch_episodes_and_refill_slots(tokenizer):
  """max_in_flight=2 of 3 episodes: the third starts when the first ends; each wave is one
  generate call holding every active episode."""
  env = ScriptedEnvironment([(40,), ()], [None, None])
  plans = {"a": ["x;", "y"], "b": ["x;", "y"], "c": ["x;", "y"]}

  def policy(context):
    name, _, done = context.partition("=")
    turns = done.count(";")
    return plans[name][turns], turns == 1

  engine = ScriptedEngine(tokenizer, policy)
  prompts = [[tokenizer.bos_id] + tokenizer.encode(f"{n}=") for n in "abc"]
  episodes = envs.run_episodes(engine, env, tokenizer, [{}] * 3, prompts,
                               greedy(16, tokenizer), seed=0, max_in_flight=2)
  assert [len(c["prompts"]) for c in engine.calls] == [2, 2, 1, 1]
  assert all(e.finish_reason == "stop" and e.turns == 2 for e in episodes)


def test_pause_at_an_iteration_boundary_and_resume(tokenizer):
  """advance with a token budget pauses between waves; resumed after a weight update, the
  episodes finish as an uninterrupted run does, each token keeping its version."""
  task = ToolArithmetic(Arithmetic(digits=3, operands=2))
  records = [task.train[i] for i in range(4)]
  prompts = [rollout.prompt_ids(task, tokenizer, r) for r in records]
  whole = envs.run_episodes(ScriptedEngine(tokenizer, calculator_policy), task.environment,
                            tokenizer, records, prompts, greedy(64, tokenizer), seed=0)
  engine = ScriptedEngine(tokenizer, calculator_policy)
  states = envs.start(task.environment, records, prompts)
  first = envs.advance(engine, task.environment, tokenizer, states, greedy(64, tokenizer),
                       seed=0, pause=envs.Pause(token_budget=1))
  assert first["paused"] and first["waves"] == 1
  assert all(not s.over and s.episode().finish_reason == "abort" for s in states)
  engine.update_weights(None, 1)
  rest = envs.advance(engine, task.environment, tokenizer, states, greedy(64, tokenizer),
                      seed=1)
  assert not rest["paused"]
  for state, reference in zip(states, whole):
    episode = state.episode()
    assert episode.token_ids.tolist() == reference.token_ids.tolist()
    assert episode.policy_mask.tolist() == reference.policy_mask.tolist()
    assert episode.versions[:len("<calc>")].tolist() == [0] * len("<calc>")
    assert set(episode.versions[len("<calc>"):].tolist()) == {1}


def test_lambda_pause_waits_for_a_fraction_of_the_episodes(tokenizer):
  """finish_fraction (K3's lambda): the call returns at the first wave boundary where
  ceil(lambda * n) of its episodes are over, and the rest resume."""
  task = ToolArithmetic(Arithmetic(digits=3, operands=2))
  records = [task.train[i] for i in range(4)]
  prompts = [rollout.prompt_ids(task, tokenizer, r) for r in records]
  # Episodes 0 and 1 answer at once; 2 and 3 call the calculator (more waves).
  direct = lambda context: (("#1", True) if context.startswith(records[0]["question"]) or
                            context.startswith(records[1]["question"])
                            else calculator_policy(context))
  states = envs.start(task.environment, records, prompts)
  engine = ScriptedEngine(tokenizer, direct)
  first = envs.advance(engine, task.environment, tokenizer, states, greedy(64, tokenizer),
                       seed=0, pause=envs.Pause(finish_fraction=0.5))
  assert first["paused"] and first["finished"] == 2 and first["waves"] == 1
  assert [s.over for s in states] == [True, True, False, False]
  rest = envs.advance(engine, task.environment, tokenizer, states, greedy(64, tokenizer),
                      seed=1, pause=envs.Pause(finish_fraction=1.0))
  assert not rest["paused"] and all(s.over for s in states)
  assert [s.episode().turns for s in states] == [1, 1, 2, 2]


def test_partial_rollouts_pause_episodes_in_the_replay_buffer_and_resume(
    tokenizer, tiny_cfg, tiny_params, tmp_path):
  """Partial rollouts on an agentic task: episodes pause at the token budget, wait in the
  loop state's replay buffer (saved and restored with the checkpoint), and finish at later
  steps exactly as uninterrupted episodes, their tokens keeping each policy's version."""
  from rl.checkpoint import Checkpointer
  task = ToolArithmetic(Arithmetic(digits=3, operands=2, num_train=64, num_test=16))
  config = RLConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=32, seq_len=64)
  partial = sources.Partial(token_budget=12, replay_capacity=16)
  policy = mixed_policy
  engine = ScriptedEngine(tokenizer, policy)
  context = lambda task: sources.Context(engine, task, tokenizer, config, None)
  sources.check(partial, context(task))  # episodes pause between waves on any engine
  with pytest.raises(ConfigError, match="abort"):  # single-turn trajectories still need one
    sources.check(partial, context(Arithmetic()))
  make = lambda: helpers.parts(tiny_cfg, engine=engine, task=task, tokenizer=tokenizer,
                               loss="grpo", config=config, rollouts=partial,
                               ref_params=tiny_params)
  steps, parts = helpers.steps(tiny_params, tiny_cfg, engine=engine, task=task,
                               tokenizer=tokenizer, loss="grpo", config=config,
                               rollouts=partial, ref_params=tiny_params)
  records = [next(steps) for _ in range(3)]
  assert all(r.metrics["partial_aborted"] > 0 for r in records)  # the budget paused some
  assert records[0].metrics["replay_size"] > 0
  resumed = [t for r in records[1:] for t in r.trajectories if set(t.versions) != {
      r.step - 1}]
  assert resumed, "no episode spanned two policy versions"
  for record in records:
    assert record.metrics["accuracy"] == 1.0
    whole = envs.run_episodes(ScriptedEngine(tokenizer, policy), task.environment,
                              tokenizer, [t.record for t in record.trajectories],
                              [t.prompt_ids for t in record.trajectories],
                              greedy(32, tokenizer), seed=0)
    for got, want in zip(record.trajectories, whole):
      got = got.episode()
      assert got.token_ids.tolist() == want.token_ids.tolist()
      assert got.policy_mask.tolist() == want.policy_mask.tolist()
      assert got.turn_ends == want.turn_ends and dict(got.counts) == dict(want.counts)
      assert np.all(np.diff(got.versions) >= 0) and got.versions[-1] <= record.step - 1
  # The buffer survives a checkpoint: the same episodes, bookkeeping and all.
  state = records[-1].state
  buffer = state.rollout.source["replay"]
  buffered = buffer.trajectories(task.train)
  assert buffered and not all(t.over for t in buffered)
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
  checkpointer.save(3, state)
  like = loop.init_state(tiny_params, loop.rl_optimizer(1e-4), make(), 0)
  restored = checkpointer.restore(like).rollout.source["replay"].trajectories(task.train)
  checkpointer.close()
  assert [(t.group, t.record_index, t.sample) for t in restored] == [
      (t.group, t.record_index, t.sample) for t in buffered]
  for got, want in zip(restored, buffered):
    assert dataclasses.asdict(got) == dataclasses.asdict(want)
  with pytest.raises(TypeError, match="JSON"):
    buffered[0].env_state = object()
    buffer.store(buffered)


# --- formats, tools, registries


def test_tool_call_formats():
  tagged = envs.FORMATS["tagged"]
  assert tagged.stop_strings(("calc", "python")) == ("</calc>", "</python>")
  assert tagged.parse("so <calc>1+2</calc>", ("calc",)) == [envs.ToolCall("calc", "1+2")]
  assert tagged.parse("<calc>1+2</calc> and then", ("calc",)) == []
  assert tagged.parse("1+2</calc>", ("calc",))[0].error
  assert tagged.observation_text(["3"]) == "<result>3</result>"
  qwen = envs.FORMATS["qwen"]
  assert qwen.stop_strings(("calc",)) == ()
  turn = ('<tool_call>\n{"name": "calc", "arguments": {"expression": "2+2"}}\n</tool_call>'
          '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'
          '</tool_call>')
  assert qwen.parse(turn, ()) == [envs.ToolCall("calc", {"expression": "2+2"}),
                                  envs.ToolCall("python", {"code": "print(1)"})]
  assert "not JSON" in qwen.parse("<tool_call>{nope</tool_call>", ())[0].error
  assert "without </tool_call>" in qwen.parse("<tool_call>{", ())[0].error
  assert qwen.parse("just an answer", ()) == []
  call = qwen.call_text("calc", "2+2", "expression")
  assert qwen.parse(call, ()) == [envs.ToolCall("calc", {"expression": "2+2"})]
  assert qwen.observation_text(["4"]) == ("\n<|im_start|>user\n<tool_response>\n4\n"
                                          "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_calculator():
  assert envs.calc("123456789012345678901234567890+987654321098765432109876543210") == \
      "1111111110111111111011111111100"
  assert envs.calc(" (2+3)*4-6/3 ") == "18" and envs.calc("1/3") == "0.333333333333"
  for bad, message in (("1/0", "division by zero"), ("2**100000", "too large"),
                       ("__import__('os')", "only numbers"), ("1+", "cannot parse"),
                       ("9" * 1200, "too large")):
    with pytest.raises(envs.ToolError, match=message):
      envs.calc(bad)


def test_registries_fail_loudly():
  with pytest.raises(ValueError, match="'calc' is registered twice"):
    envs.register_tool("calc")(lambda arguments: "")
  with pytest.raises(ValueError, match="'tools' is registered twice"):
    envs.register_environment("tools")(envs.ToolEnvironment)
  with pytest.raises(ConfigError, match=r"unknown tool\(s\) \['abacus'\].*calc.*python"):
    envs.ToolEnvironment(("calc", "abacus"))
  with pytest.raises(ConfigError, match="unknown tool-call format 'xml'; valid: qwen, tagged"):
    envs.ToolEnvironment(call_format="xml")
  with pytest.raises(ConfigError, match="unknown environment 'gym'; registered .*tools"):
    envs.make_environment("gym")
  assert isinstance(envs.make_environment("tools", tools=("calc",)), envs.ToolEnvironment)


def _tool_episode(tokenizer, env, calls, *, max_sequence_tokens=None):
  """One episode whose policy makes `calls` (tagged texts) in turn, then answers #1."""
  def policy(context):  # the rest of the current turn: a call, or the answer at the end
    made = context.count("</result>")
    so_far = context.split("</result>")[-1] if made else context.partition("=")[2]
    turn = calls[made] if made < len(calls) else "#1"
    return turn[len(so_far):], made == len(calls)

  prompt = [tokenizer.bos_id] + tokenizer.encode("1=")
  (episode,) = envs.run_episodes(ScriptedEngine(tokenizer, policy), env, tokenizer, [{}],
                                 [prompt], greedy(200, tokenizer), seed=0,
                                 max_sequence_tokens=max_sequence_tokens)
  results = re.findall(r"<result>(.*?)</result>", tokenizer.decode(episode.token_ids))
  return episode, results


def test_a_tool_that_raises_hangs_or_floods_gives_an_observation(tokenizer):
  env = envs.ToolEnvironment(("calc", "boom", "hang", "flood"), max_turns=6,
                             max_result_tokens=40, tool_timeout=0.5)
  try:
    episode, results = _tool_episode(tokenizer, env, [
        "<boom>1</boom>", "<hang>1</hang>", "<flood>1</flood>", "<calc>1/0</calc>",
        "<nope>1</nope><calc>2*3</calc>"])
  finally:
    _RELEASE.set()
  assert episode.finish_reason == "stop" and episode.turns == 6
  assert results[0] == "error: runtimeerror: the tool broke"  # lower-cased for CharTokenizer
  assert results[1] == "error: hang did not answer within 0.5 s"
  assert results[2] == "x" * 37 + "..."
  assert results[3] == "error: division by zero"
  assert results[4] == "6"  # an unknown closing tag is text, not a call
  assert dict(episode.counts) == {"tool_calls": 5, "tool_errors": 2, "tool_timeouts": 1}
  # A flood that does not fit the row: the episode is truncated, not the run.
  episode, _ = _tool_episode(tokenizer, env, ["<flood>1</flood>"],
                             max_sequence_tokens=3 + len("<flood>1</flood>") + 10)
  assert episode.finish_reason == "length" and episode.budget_truncated
  # A call in the last allowed turn is not run: no turn would be left for the answer.
  short = envs.ToolEnvironment(("calc",), max_turns=1)
  episode, results = _tool_episode(tokenizer, short, ["<calc>1+1</calc>"])
  assert episode.finish_reason == "length" and results == []
  assert episode.counts["tool_calls"] == 0


def test_python_tool_runs_in_the_sandbox_and_kills_an_infinite_loop(tokenizer):
  env = envs.ToolEnvironment(("python",), max_turns=4, tool_options={
      "python": {"workers": 1, "limits": Limits(wall_seconds=1.0)}})
  try:
    episode, results = _tool_episode(tokenizer, env, [
        "<python>print(6*7)</python>", "<python>while 1: pass</python>",
        "<python>print(1/0)</python>"])
  finally:
    env.close()
  assert results[0] == "42 "  # its newline, as a CharTokenizer space
  assert results[1] == "error: the program ran past its 1 s limit and was killed"
  assert results[2] == "error: runtime error: zerodivisionerror: division by zero"
  assert dict(episode.counts) == {"tool_calls": 3, "tool_errors": 1, "tool_timeouts": 1}
  assert episode.finish_reason == "stop"


# --- training and evaluation on episodes


def test_trainer_logprobs_equal_engine_logprobs_on_a_multi_turn_episode(tokenizer, tiny_cfg,
                                                                         tiny_params):
  observations = [tuple(tokenizer.encode("<result>7</result>")), (30, 31, 32), ()]
  env = ScriptedEnvironment(observations, [None] * 3, stop_strings=(), max_turn_tokens=6)
  prompts = [[tokenizer.bos_id] + tokenizer.encode(q) for q in ("12+3=", "4+56=", "7=")] * 2
  episodes = envs.run_episodes(JaxEngine(tiny_cfg, tiny_params), env, tokenizer,
                               [{}] * len(prompts), prompts,
                               SamplingParams(18, temperature=1.0,
                                              stop_token_ids=(tokenizer.eos_id,)), seed=5)
  assert all(e.turns == 3 and (~e.policy_mask).sum() == 21 for e in episodes)
  masks = batch_lib.train_masks(episodes, np.ones(len(episodes), bool))
  batch, _ = trajectory_batch(prompts, [e.token_ids for e in episodes],
                              [e.logprobs for e in episodes], [0.0] * len(episodes), masks, 64)
  trainer = np.asarray(jax.jit(policy_logprobs, static_argnums=1)(
      tiny_params, tiny_cfg, jax.tree.map(jnp.asarray, batch))[0])
  mask = batch.loss_mask > 0
  assert mask.sum() == sum(envs.policy_tokens(e) for e in episodes)
  assert np.abs(trainer - batch.old_logp)[mask].max() < 1e-4


def test_rl_steps_train_on_episodes_and_log_their_metrics(tokenizer, tiny_cfg, tiny_params):
  task = ToolArithmetic(Arithmetic(digits=3, operands=2, num_train=64, num_test=16))
  seen = []

  def spy(inner):
    def train_step(state, batch, ref_params):
      seen.append(batch)
      return inner(state, batch, ref_params)
    return train_step

  reward = rewards.named_chain({"correctness": rewards.correctness(),
                                "length": rewards.k15_length_penalty()})
  # GRPO that reads the per-turn rewards: the loop fills exactly the fields a loss reads.
  losses.register("grpo_turns", advantage="group_normalized", aggregation="seq-mean-token-mean",
                  kl_coef=0.04, reads=("turn_rewards",))(losses.grpo)
  try:
    steps, _ = helpers.steps(tiny_params, tiny_cfg, engine=ScriptedEngine(tokenizer,
                                                                         calculator_policy),
                             task=task, tokenizer=tokenizer, loss="grpo_turns", reward=reward,
                             train_step=spy, ref_params=tiny_params,
                             config=RLConfig(prompts_per_step=2, samples_per_prompt=2,
                                             max_new_tokens=32, seq_len=64))
  finally:
    del losses.LOSSES["grpo_turns"]
  record = next(steps)
  m = record.metrics
  assert m["accuracy"] == 1.0 and m["episode_tool_calls"] == 1.0 and m["episode_turns"] == 2
  assert m["episode_tool_errors"] == m["episode_tool_timeouts"] == 0.0
  assert m["episode_budget_truncated"] == 0.0
  lengths = [envs.policy_tokens(t.episode()) for t in record.trajectories]
  assert m["completion_length"] == np.mean(lengths) == m["episode_policy_tokens"]
  assert m["episode_observation_tokens"] == np.mean(
      [len(t.token_ids) - n for t, n in zip(record.trajectories, lengths)])
  (batch,) = seen
  assert batch.loss_mask.sum() == sum(lengths) and batch.turn_rewards is not None
  assert batch.teacher_logp is None and batch.versions is None  # read by nothing here
  # Out of the loss: the prompts' targets and every observation token.
  placed = np.asarray(batch.segment_ids) > 0
  assert (placed & (np.asarray(batch.loss_mask) == 0)).sum() == sum(
      len(t.prompt_ids) - 1 for t in record.trajectories) + 4 * m["episode_observation_tokens"]
  assert np.isfinite(m["loss"]) and m["engine_logp_diff_max"] >= 0


def test_sampled_eval_reports_budgets_on_episodes(tokenizer):
  task = ToolArithmetic(Arithmetic(digits=2, operands=2))
  records = [task.test[i] for i in range(3)]
  spec = eval_lib.SampledEval(samples=2, ks=(1, 2), budgets=(8, 64))
  report = eval_lib.sampled_eval(ScriptedEngine(tokenizer, calculator_policy), task, tokenizer,
                                 records, spec)
  assert report["budgets"][64]["pass@2"] == 1.0 and report["budgets"][64]["maj@2"] == 1.0
  assert report["budgets"][8]["pass@1"] == 0.0  # the policy's tokens exceed 8
  assert all(n <= 30 for n in report["lengths"]["correct"])  # observations not counted


def test_sft_demonstrations_keep_observations_out_of_the_loss(tokenizer):
  task = ToolArithmetic(Arithmetic(digits=6, operands=2), call_fraction=1.0,
                        call_min_digits=1)
  record = task.train[0]
  prompt, targets, mask = sft.solution_example(task, tokenizer, record)
  text = tokenizer.decode(targets)
  observation = f"<result>{record['answer']}</result>"
  assert text == f"<calc>{record['question']}</calc>{observation}#{record['answer']}"
  assert targets[-1] == tokenizer.eos_id
  start = text.index(observation)
  assert mask.tolist() == ([True] * start + [False] * len(observation) +
                           [True] * (len(text) - start - len(observation) + 1))
  direct = ToolArithmetic(Arithmetic(digits=6, operands=2), call_fraction=0.0)
  _, targets, mask = sft.solution_example(direct, tokenizer, record)
  assert tokenizer.decode(targets) == f"#{record['answer']}" and mask.all()


# --- the server process, the recipe


def test_an_episode_on_the_embedded_engine_and_on_the_server_is_the_same(tokenizer, tiny_cfg,
                                                                          tiny_params,
                                                                          tmp_path):
  from rollouts.server.main import launch
  from rollouts.sglang import SGLangClient
  from rollouts.sglang_engine import SGLangEngine
  path = hf.save(tiny_params, tiny_cfg, str(tmp_path / "v0"))
  process, url = launch(["--hf_checkpoint", path, "--weight_version", "0",
                          "--dtype", "float32"])
  try:
    remote = SGLangEngine(SGLangClient([url]), tiny_cfg, weights_dir=str(tmp_path))
    env = ScriptedEnvironment([(30, 31), (32,), ()], [None] * 3, stop_strings=("5",),
                              max_turn_tokens=7)
    prompts = [[tokenizer.bos_id] + tokenizer.encode(q) for q in ("12+3=", "4+56=")]
    runs = [envs.run_episodes(engine, env, tokenizer, [{}, {}], prompts,
                              greedy(20, tokenizer), seed=0)
            for engine in (JaxEngine(tiny_cfg, tiny_params), remote)]
    for local, served in zip(*runs):
      assert local.token_ids.tolist() == served.token_ids.tolist()
      assert local.policy_mask.tolist() == served.policy_mask.tolist()
      np.testing.assert_allclose(local.logprobs, served.logprobs, atol=1e-5)
      assert local.turns == served.turns == 3
    # The client sends each episode's continuations with one affinity key.
    requests = remote.requests([[1, 2], [1, 2, 3]], 4, seed=0, affinity=[7, 7])
    assert [r.affinity for r in requests] == [7, 7]
    remote.close()
  finally:
    process.kill()
    process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("partial_rollouts", [False, True])
def test_agentic_config_runs_through_train_and_logs_episode_metrics(tmp_path, partial_rollouts):
  run_dir = tmp_path / "run"
  # Partial rollouts on the embedded engine: episodes pause between the driver's waves.
  partial = ["--gin_param", "train.rollouts = @Partial()",
             "--gin_param", "Partial.token_budget = 16"] if partial_rollouts else []
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments/run.py"),
       "--gin", os.path.join(ROOT, "experiments/configs/agentic.gin"),
       "--gin", os.path.join(ROOT, "experiments/configs/tiny.gin"),
       "--run_dir", str(run_dir), "--gin_param", "Hooks.progress = False", *partial],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  steps = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][1:]
  assert [m["step"] for m in steps] == [1, 2, 3]
  if partial_rollouts:
    assert all("replay_size" in m and m["partial_iterations"] >= 1 for m in steps)
  for key in ("episode_turns", "episode_tool_calls", "episode_tool_errors",
              "episode_tool_timeouts", "episode_policy_tokens", "episode_observation_tokens",
              "episode_budget_truncated"):
    assert all(key in m for m in steps), key
  assert all(m["episode_turns"] >= 1 for m in steps)
  # The held-out evaluations report the episodes too, and the last line the call rate.
  summary = json.load(open(run_dir / "summary.json"))
  for prefix in ("sft", "rl"):
    assert 0.0 <= summary[f"{prefix}_tool_calls_rate"] <= 1.0
    assert summary[f"{prefix}_turns"] >= 1
  assert "eval_tool_calls_rate" in json.loads(open(run_dir / "metrics.jsonl").readline())
  last = result.stdout.strip().splitlines()[-1]
  assert re.fullmatch(r"sft_accuracy=\d\.\d\d rl_accuracy=\d\.\d\d "
                      r"sft_tool_calls_rate=\d\.\d\d rl_tool_calls_rate=\d\.\d\d", last), last


# --- the Qwen format with a real BPE tokenizer

# Qwen2.5's chat template and pre-tokenizer split (experiments/tiny_checkpoint.py): a
# conversation rendered by the template and encoded whole is what a Qwen model was trained
# on, so an episode should be that.
from experiments.tiny_checkpoint import QWEN2_TEMPLATE as QWEN_TEMPLATE  # noqa: E402
from experiments.tiny_checkpoint import QWEN_SPLIT  # noqa: E402


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
  """An HFTokenizer shaped like Qwen2.5's: byte-level BPE with its split, <|im_start|> and
  <|im_end|> (the eos) special, the tool tags added tokens that are not special (so that
  decoding with special tokens skipped, as ChatPrompts does, keeps them)."""
  import tokenizers
  from models.tokenizer import HFTokenizer
  path = tmp_path_factory.mktemp("qwen_tok")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  corpus = ['{"name": "calc", "arguments": {"expression": "12+30"}}', "What is 7*8?",
            "The answer is 42.", "error: the tool call is not JSON", "user\nassistant\n"] * 20
  corpus += ["42\n\n"] * 200  # "\n\n" one token, as in Qwen's vocabulary
  tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in
                  ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "bos_token": None}))
  return HFTokenizer(str(path))


class _RecordingEngine(ScriptedEngine):
  """A ScriptedEngine that also keeps what each call returned and the stop tokens it got."""

  def generate(self, prompts, sampling, *, seed, **kwargs):
    out = super().generate(prompts, sampling, seed=seed, **kwargs)
    self.calls[-1].update(outputs=out, stop_token_ids=tuple(sampling.stop_token_ids))
    return out


def _qwen_calls(*expressions) -> str:
  """An assistant turn of calc calls, written as Qwen2.5's template writes them."""
  return "\n".join("<tool_call>\n" + json.dumps({"name": "calc", "arguments": {
      "expression": e}}) + "\n</tool_call>" for e in expressions)


def test_qwen_format_episodes_with_a_bpe_tokenizer_are_the_chat_template_token_for_token(
    qwen_tokenizer):
  """Episodes in the Qwen format through ChatPrompts (the tokenizer a Hugging Face run
  uses): each turn ends at <|im_end|>, the calls' JSON arguments reach calc, each observation
  is the encoding of QwenFormat.observation_text, a malformed call is an "error: ..."
  observation, and the episode is the engine's tokens and the observations' tokens, nothing
  re-tokenised: token for token the Qwen template's rendering of the same conversation."""
  from models.tokenizer import ChatPrompts
  hf_tok, fmt = qwen_tokenizer, envs.FORMATS["qwen"]
  chat = ChatPrompts(hf_tok)
  bad_call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}\n</tool_call>'
  bad_error = fmt.parse(bad_call, ())[0].error
  assert bad_error.startswith("the tool call is not JSON")
  # Per question: the policy's turns (None: answer with the last tool responses) and the
  # tool responses each observation holds.
  scripts = {"What is 12+30?": ([_qwen_calls("12+30"), None], [["42"]]),
             "What is 2*3?": ([bad_call, _qwen_calls("2*3"), None],
                              [[f"error: {bad_error}"], ["6"]]),
             "What are 12+30 and 7*8?": ([_qwen_calls("12+30", "7*8"), None], [["42", "56"]])}

  def policy(context):
    question = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", context).group(1)
    turns, _ = scripts[question]
    episode = context.split("<|im_start|>assistant\n", 1)[1]
    turn = turns[episode.count("<|im_start|>assistant\n")]
    if turn is None:
      last = episode.rsplit("<|im_start|>user", 1)[1]
      turn = "The answer is " + " and ".join(
          re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last)) + "."
    # Text past <|im_end|>: the engine must stop at the eos, so none of it is generated.
    return turn + "<|im_end|>never generated", False

  engine = _RecordingEngine(hf_tok, policy)
  prompts = [chat.encode(q) for q in scripts]
  env = envs.ToolEnvironment(("calc",), call_format="qwen")
  episodes = envs.run_episodes(engine, env, chat, [{}] * len(prompts), prompts,
                               SamplingParams(256, temperature=0.0,
                                              stop_token_ids=(chat.eos_id,)), seed=0)
  assert all(c["stop_token_ids"] == (hf_tok.eos_id,) for c in engine.calls)  # no stop strings
  eos = hf_tok.eos_id
  for prompt, (question, (turns, responses)), episode in zip(prompts, scripts.items(),
                                                             episodes):
    ids = episode.token_ids.tolist()
    assert episode.finish_reason == "stop" and episode.turns == len(turns)
    errors = sum(r.startswith("error: ") for rs in responses for r in rs)
    assert dict(episode.counts) == {"tool_calls": sum(map(len, responses)),
                                    "tool_errors": errors, "tool_timeouts": 0}
    # Each request is the prompt and every token so far; the episode is what the engine
    # returned and the observations between, in order.
    generated = [(request, output) for c in engine.calls
                 for request, output in zip(c["prompts"], c["outputs"])
                 if request[:len(prompt)] == tuple(prompt)]
    assert len(generated) == len(turns)
    rebuilt, policy_mask, logprobs, observations = [], [], [], []
    for request, output in generated:
      assert list(request) == prompt + ids[:len(request) - len(prompt)]
      observation = ids[len(rebuilt):len(request) - len(prompt)]
      if rebuilt:
        observations.append(observation)
      turn_ids = output.token_ids.tolist()
      assert turn_ids[-1] == eos and eos not in turn_ids[:-1]  # the turn ended at <|im_end|>
      rebuilt += observation + turn_ids
      policy_mask += [False] * len(observation) + [True] * len(turn_ids)
      logprobs += [0.0] * len(observation) + output.logprobs.tolist()
    assert rebuilt == ids and episode.policy_mask.tolist() == policy_mask
    np.testing.assert_array_equal(episode.logprobs, np.array(logprobs, np.float32))
    assert list(episode.turn_ends) == [i + 1 for i, t in enumerate(ids)
                                       if t == eos and policy_mask[i]]
    assert observations == [hf_tok.encode(fmt.observation_text(rs)) for rs in responses]
    # What the verifier reads (special tokens dropped) ends in the answer from the tool.
    assert chat.decode(ids).endswith("The answer is " + " and ".join(responses[-1]) + ".")
    # The whole sequence is the template's rendering of the conversation, encoded at once
    # (less the newline the template writes after the last <|im_end|>).
    messages = [{"role": "user", "content": question}]
    for turn, rs in zip(turns, responses):
      if turn == bad_call:
        messages.append({"role": "assistant", "content": turn})
      else:
        expressions = re.findall(r'"expression": "(.*?)"', turn)
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"name": "calc", "arguments": {"expression": e}} for e in expressions]})
      messages += [{"role": "tool", "content": r} for r in rs]
    messages.append({"role": "assistant", "content": "The answer is " + " and ".join(
        responses[-1]) + "."})
    rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=False)
    assert prompt + ids == hf_tok.encode(rendered.removesuffix("\n"))


@envs.register_tool("echo")
def _echo(text: str) -> str:
  return text


def test_an_observation_is_encoded_whole_as_the_chat_template_would(qwen_tokenizer):
  """A result ending in a newline meets the framing's newline: Qwen's vocabulary has "\n\n",
  so encoding the pieces apart would give the model a tokenisation it never saw."""
  from models.tokenizer import ChatPrompts
  env = envs.ToolEnvironment(("echo",), call_format="qwen", max_result_tokens=64)
  fmt = envs.FORMATS["qwen"]
  for result in ("42\n", "a\n\n", "plain"):
    call = fmt.call_text("echo", result, "text")
    _, observation = env.step(None, envs.Turn(0, np.zeros(0, np.int32), call, "stop"),
                              ChatPrompts(qwen_tokenizer))
    want = qwen_tokenizer.encode(fmt.observation_text([result]))
    assert list(observation.token_ids) == want, result
    if result == "42\n":
      pieces = [qwen_tokenizer.decode([t]) for t in want]
      assert "\n\n" in pieces, repr(pieces)  # the merge at the seam
