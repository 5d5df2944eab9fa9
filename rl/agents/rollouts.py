"""Agent rollouts: a rollout source whose episodes are an agent's own program, run against the
agent endpoint over the run's engine; each episode's calls become the step's trajectories.

    AgentRollouts(agent, reward=None, ...)

Each step draws prompts_per_step records (the task's train split, the sampler's weights) and
runs samples_per_prompt episodes of each, concurrently, on threads: `agent(base_url, api_key,
record)` is any program that talks to an OpenAI-compatible server (it gets its session's
credentials and knows nothing of longrl) and returns what it concluded. The episode's reward
is `reward(record, result, session)`: a float (terminal), or one float per recorded call, in
the calls' order (per call, each branch's reward then the discounted sum over its calls,
`discount`); the default verifies the result's text with the task (1.0 when it is right).
Each branch of the session (sessions.py: one sequence per branch, exactly the tokens the
engine sampled, the agent's messages out of the loss) is a trajectory of the record's group,
with its branch's return as its reward (rl.trajectory.Trajectory.reward: train with
rewards.episode_reward()), `correct` when that reward is > 0, and each call's return on its
last token (Trajectory.turn_rewards); an episode's branches share its group and sample, so
the loop counts the episode once in its advantages (rl.advantages.per_episode). A call
`keep_call(call)` rejects (a title, a summary) is out of the loss; an episode that raises,
times out or has no call is dropped whole, never half-trained, and counted. A call whose
client left before its answer (a timeout the SDK does not retry) is in no branch (counted);
its generation runs to its end: the engine protocol cannot abort one request of a batch.

It owns running episodes and their conversion; the endpoint and sessions are endpoint.py's and
sessions.py's, rewards after the source the loop's.
"""

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rl import sources
from rl.agents.endpoint import AgentEndpoint, Limits
from rl.agents.sessions import Branch, Call, Session
from rl.trajectory import Trajectory


def verified(task) -> Callable[[dict, Any, Session], float]:
  """The default reward: 1.0 when the task verifies the agent's result as text, else 0.0."""
  def reward(record, result, session):
    del session
    return float(bool(task.verify(str(result), record)))
  return reward


@dataclasses.dataclass
class AgentRollouts(sources.Source):
  """See the module docstring. `workers`: episodes run at once (threads); `episode_timeout_s`:
  an episode still running then is dropped (its calls keep running to their end: an agent's
  thread cannot be killed; its session is closed, so its next call is refused with 409);
  `reasoning`, `limits`, `model_name`: the endpoint's."""
  agent: Callable[[str, str, dict], Any] = None
  reward: Callable[[dict, Any, Session], Any] | None = None
  discount: float = 1.0
  keep_call: Callable[[Call], bool] | None = None
  workers: int = 64
  episode_timeout_s: float = 600.0
  reasoning: str = "keep"
  model_name: str = "policy"
  limits: Limits = Limits()

  def __post_init__(self):
    self._endpoint: AgentEndpoint | None = None
    self._pool = None

  def refusals(self, context: sources.Context) -> list[str]:
    out = []
    if self.agent is None:
      out.append("AgentRollouts.agent is not set: give the function that runs one episode, "
                 "agent(base_url, api_key, record) -> result")
    if not getattr(getattr(context.tokenizer, "tokenizer", None), "chat_template", None):
      out.append("AgentRollouts needs a checkpoint's chat template (model=HFCheckpoint(...)): "
                 "the agent's messages are rendered with it")
    if jax.process_count() > 1:
      out.append("AgentRollouts runs on one JAX process")
    if not 0 < self.discount <= 1:
      out.append(f"AgentRollouts.discount={self.discount} must be in (0, 1]")
    return out

  def _start(self, context: sources.Context) -> AgentEndpoint:
    if self._endpoint is None:
      self._endpoint = AgentEndpoint(context.engine, context.tokenizer, context.sampling,
                                     model_name=self.model_name, reasoning=self.reasoning,
                                     limits=self.limits).start()
      self._pool = concurrent.futures.ThreadPoolExecutor(self.workers,
                                                         thread_name_prefix="agent")
    return self._endpoint

  def next(self, context, state, step, gate=sources.no_gate):
    gate()
    endpoint = self._start(context)
    indices, seed, state = sources.draw(context, state, step)
    del seed  # the endpoint's queue seeds each batch
    size = context.config.samples_per_prompt
    started = time.perf_counter()
    episodes = self._episodes(endpoint, context, indices, size)
    trajectories, metrics = self._trajectories(context, indices, episodes)
    metrics["generate_s"] = time.perf_counter() - started
    metrics.update(verify_s=0.0, verify_busy_s=0.0, generation_rounds=1)
    return sources.Made(trajectories, metrics), _record_stats(state, trajectories, step)

  def _episodes(self, endpoint: AgentEndpoint, context, indices, size: int) -> list:
    """[(group, sample, session, result or the exception)] of every episode."""
    running = []
    for group, index in enumerate(indices):
      record = context.task.train[int(index)]
      for sample in range(size):
        session = endpoint.open_session({"record_index": int(index), "sample": sample})
        future = self._pool.submit(self.agent, endpoint.session_url(session), session.key,
                                   record)
        running.append((group, sample, session, future))
    deadline = time.monotonic() + self.episode_timeout_s
    out = []
    for group, sample, session, future in running:
      try:
        result = future.result(timeout=max(0.0, deadline - time.monotonic()))
      except Exception as e:  # noqa: BLE001 - the agent's failure drops its episode
        result = e
      out.append((group, sample, endpoint.close_session(session), result))
    return out

  def _trajectories(self, context, indices, episodes) -> tuple[list[Trajectory], dict]:
    reward_of = self.reward or verified(context.task)
    trajectories, failed, rewards = [], 0, []
    metrics = {"agent_calls": 0, "agent_branches": 0, "agent_overrides": 0, "agent_replays": 0,
               "agent_calls_undelivered": 0}
    for drift in ("new", "clean", "realigned", "forked"):
      metrics[f"agent_drift_{drift}"] = 0
    for group, sample, session, result in episodes:
      record_index = int(indices[group])
      record = context.task.train[record_index]
      calls = session.calls
      if isinstance(result, BaseException) or not calls:
        failed += 1
        continue
      per_call = _call_rewards(reward_of(record, result, session), len(calls))
      rewards.append(float(per_call.sum()))
      for branch in session.branches():
        t = _trajectory(branch, calls, per_call, self.discount, self.keep_call,
                        record, record_index, group, sample, context.tokenizer)
        if t is not None:
          trajectories.append(t)
      metrics["agent_calls"] += len(calls)
      metrics["agent_overrides"] += sum(session.overrides.values())
      metrics["agent_replays"] += session.replays
      metrics["agent_calls_undelivered"] += session.undelivered
      for drift, count in session.drift.items():
        metrics[f"agent_drift_{drift}"] += count
    metrics["agent_tool_calls_rate"] = (
        sum(_called_tools(s) for _, _, s, r in episodes if not isinstance(r, BaseException))
        / max(1, len(episodes) - failed))
    metrics["agent_branches"] = len(trajectories)
    metrics["agent_episodes"] = len(episodes)
    metrics["agent_episodes_failed"] = failed
    metrics["agent_reward_mean"] = float(np.mean(rewards)) if rewards else 0.0
    return trajectories, metrics

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
    if self._endpoint is not None:
      self._endpoint.close()
    self._endpoint = self._pool = None


def _called_tools(session: Session) -> bool:
  """Whether any reply of the session called a tool."""
  return any(call.reply is not None and call.reply.get("tool_calls") for call in session.calls)


def evaluate(engine, chat, agent: Callable[[str, str, dict], Any], records: list,
             reward: Callable[[dict, Any, Session], Any], sampling, *,
             workers: int = 64) -> dict:
  """The agent's episodes on `records` (one each, e.g. held-out ones), through an endpoint
  over `engine` sampling with `sampling` (temperature 0: greedy): {"success": the fraction
  of episodes whose reward (its sum, for per-call rewards) is > 0, "tool_calls_rate": of
  those that called a tool, "failed": episodes that raised}."""
  with AgentEndpoint(engine, chat, sampling) as endpoint, \
      concurrent.futures.ThreadPoolExecutor(workers) as pool:
    sessions = [endpoint.open_session() for _ in records]
    futures = [pool.submit(agent, endpoint.session_url(s), s.key, r)
               for s, r in zip(sessions, records)]
    wins, called, failed = 0, 0, 0
    for session, record, future in zip(sessions, records, futures):
      try:
        result = future.result()
      except Exception:  # noqa: BLE001 - counted
        failed += 1
        continue
      endpoint.close_session(session)
      wins += float(np.sum(reward(record, result, session))) > 0
      called += _called_tools(session)
  return {"success": wins / len(records), "tool_calls_rate": called / len(records),
          "failed": failed}


def _call_rewards(value, calls: int) -> np.ndarray:
  """f32[calls]: a terminal reward on the last call, or the given per-call rewards."""
  if np.ndim(value) == 0:
    out = np.zeros(calls, np.float32)
    out[-1] = float(value)
    return out
  out = np.asarray(value, np.float32)
  if out.shape != (calls,):
    raise ValueError(f"AgentRollouts.reward gave {out.shape[0] if out.ndim else 0} rewards "
                     f"for an episode of {calls} calls: give a float or one per call")
  return out


def _trajectory(branch: Branch, calls: list[Call], per_call: np.ndarray, discount: float,
                keep_call, record, record_index: int, group: int, sample: int,
                tokenizer) -> Trajectory | None:
  """The trajectory of one branch; None when keep_call rejects every call of it."""
  mask = branch.policy_mask.copy()
  ends = []
  for index in branch.calls:
    call = calls[index]
    start = len(call.plan.prompt_ids) - len(branch.prompt_ids)
    end = start + len(call.completion.token_ids)
    if keep_call is not None and not keep_call(call):
      mask[start:end] = False
    ends.append(end)
  if not mask.any():
    return None
  returns = np.zeros(len(branch.calls), np.float32)
  later = 0.0
  for k in reversed(range(len(branch.calls))):  # each call's discounted return on its branch
    later = float(per_call[branch.calls[k]]) + discount * later
    returns[k] = later
  leaf = calls[branch.calls[-1]].completion
  reward = float(returns[0])
  return Trajectory(
      record, tuple(int(t) for t in branch.prompt_ids), record_index=record_index, group=group,
      sample=sample, token_ids=branch.token_ids.tolist(), logprobs=branch.logprobs.tolist(),
      versions=branch.versions.tolist(), policy_mask=mask.tolist(),
      policy_count=int(mask.sum()), turn_ends=ends, turn_rewards=returns.tolist(),
      counts={"calls": len(branch.calls)},
      finish="stop" if leaf.finish_reason == "stop" else "length",
      text=tokenizer.decode(branch.token_ids), correct=reward > 0, well_formed=True,
      reward=reward)


def _record_stats(state, trajectories: list[Trajectory], step: int):
  """The prompt statistics with each record's episodes counted (an episode succeeds when its
  first branch is correct; failed episodes are not counted)."""
  episodes: dict[tuple[int, int], bool] = {}
  for t in trajectories:
    episodes.setdefault((t.group, t.sample), t.correct)
  groups: dict[int, list] = {}
  record_of = {t.group: t.record_index for t in trajectories}
  for (group, _), correct in episodes.items():
    groups.setdefault(group, []).append(correct)
  order = sorted(groups)
  return state.replace(prompt_stats=state.prompt_stats.record(
      jnp.asarray([record_of[g] for g in order], jnp.int32),
      jnp.asarray([len(groups[g]) for g in order], jnp.int32),
      jnp.asarray([sum(groups[g]) for g in order], jnp.int32), step=step))
