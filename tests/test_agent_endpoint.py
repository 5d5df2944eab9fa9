"""The agent endpoint (rl/agents/): an OpenAI-compatible server in front of the embedded
engine, driven by the official `openai` client as an agent that knows nothing of longrl
would drive it, on the untrained tiny Qwen2 / Qwen3 of experiments/tiny_checkpoint.py.

What must hold: the tokens of every recorded sequence are the tokens the engine saw and
sampled (checked by the engine itself: scoring a branch gives back the log-probs recorded as
it sampled), a later call extends an earlier one's exact tokens, drift is classified, a
thinking template follows the configured rule, an SDK retry replays, a fork is two sequences,
and every endpoint (streaming included) answers the official client."""

import dataclasses
import json
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from experiments import tiny_checkpoint
from rl.agents import chat as chatlib
from rl.agents.endpoint import AgentEndpoint, Limits
from rl.pretrained import HFCheckpoint
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine

SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0)
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


@dataclasses.dataclass(frozen=True)
class Model:
  path: str
  chat: object
  cfg: object
  params: object
  engine: JaxEngine


def _model(tmp_path_factory, family: str) -> Model:
  path = tiny_checkpoint.make(str(tmp_path_factory.mktemp(family)), family=family, sft_steps=0,
                              progress=False)
  checkpoint = HFCheckpoint(path, dtype="float32", template_args=(
      {"enable_thinking": False} if family == "qwen3" else None))
  cfg = checkpoint(0)
  params = checkpoint.load(cfg)
  return Model(path, checkpoint.tokenizer(), cfg, params, JaxEngine(cfg, params))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
  return _model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  return _model(tmp_path_factory, "qwen3")


def _client(endpoint, session, **options) -> openai.OpenAI:
  return openai.OpenAI(**{"base_url": endpoint.url, "api_key": session.key, "max_retries": 0,
                          **options})


def _sent(message) -> dict:
  """The assistant message as an agent appends it to its history."""
  return message.model_dump(exclude_none=True, exclude={"annotations", "refusal", "audio",
                                                        "function_call"})


class Recording:
  """An engine, the affinity keys of the prompts it was given recorded (with the prompt)."""

  def __init__(self, engine):
    self.engine, self.affinity = engine, []

  @property
  def capabilities(self):
    return self.engine.capabilities

  def generate(self, prompts, *args, affinity=None, **kwargs):
    self.affinity += list(zip(affinity, map(tuple, prompts)))
    return self.engine.generate(prompts, *args, affinity=affinity, **kwargs)


def test_a_sessions_calls_are_sticky_to_one_server(qwen2):
  """Every call of a session carries the session's affinity key (an engine of several
  servers sends the same key to the same server: its prefix cache holds the session), and
  sessions have keys of their own."""
  recording = Recording(qwen2.engine)
  with AgentEndpoint(recording, qwen2.chat, SAMPLING) as endpoint:
    sessions = [endpoint.open_session() for _ in range(3)]
    for session in sessions * 2:
      _client(endpoint, session).chat.completions.create(
          model="p", messages=[{"role": "user", "content": "What is 1+2?"}])
  keys = {}
  for key, prompt in recording.affinity:
    keys.setdefault(key, []).append(prompt)
  assert len(keys) == 3 and all(len(prompts) == 2 for prompts in keys.values())


def _assert_sampled(engine, session):
  """Every branch's policy tokens carry the log-probs the engine gives them in that very
  context: had a call's prompt not been the branch's prefix, they would differ."""
  for branch in session.branches():
    scored = engine.score([branch.prompt_ids.tolist()], [branch.token_ids.tolist()])[0]
    np.testing.assert_allclose(scored[branch.policy_mask], branch.logprobs[branch.policy_mask],
                               atol=2e-4)
    assert (branch.versions[branch.policy_mask] == 0).all()


def test_a_multi_call_episode_with_tools_is_one_sequence_of_the_sampled_tokens(qwen2):
  chat, engine = qwen2.chat, qwen2.engine
  with AgentEndpoint(engine, chat, SAMPLING) as endpoint:
    session = endpoint.open_session()
    client = _client(endpoint, session)
    messages = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 12+30?"}]
    prompts, replies = [], []
    for turn in range(3):
      answer = client.chat.completions.create(
          model="policy", messages=messages, tools=TOOLS,
          extra_body={"return_prompt_token_ids": True, "return_token_ids": True})
      choice = answer.choices[0]
      prompts.append(choice.prompt_token_ids)
      replies.append(choice.response_token_ids)
      assert answer.usage.completion_tokens == len(choice.response_token_ids)
      messages.append(_sent(choice.message))
      # A tool's result as the harness writes it, then the user's next turn.
      messages += [{"role": "tool", "tool_call_id": "call_0", "content": str(42 + turn)},
                   {"role": "user", "content": f"Check it, step {turn}."}]
    endpoint.close_session(session)
  assert session.drift == {"new": 1, "clean": 2}
  [branch] = session.branches()
  assert branch.calls == (0, 1, 2)
  whole = branch.prompt_ids.tolist() + branch.token_ids.tolist()
  for prompt, reply in zip(prompts, replies):  # each call's prompt extends the one before
    assert whole[:len(prompt)] == prompt
    assert whole[len(prompt):len(prompt) + len(reply)] == reply
    assert branch.policy_mask[len(prompt) - len(prompts[0]):][:len(reply)].all()
  assert branch.policy_mask.sum() == sum(map(len, replies))
  # What the agent sent in between is the template's suffix, and out of the loss.
  tail = chat.tokenizer.decode(whole[len(prompts[0]) + len(replies[0]):len(prompts[1])])
  assert "<tool_response>\n42\n</tool_response>" in tail and "Check it, step 0." in tail
  _assert_sampled(engine, session)


def test_a_reply_with_tool_calls_reads_back_and_renders_as_the_template_writes_it(qwen2):
  chat = qwen2.chat
  text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": '
          '"12+30"}}\n</tool_call>')
  message, reason = chatlib.reply_message(text, "stop", tools_offered=True)
  assert reason == "tool_calls" and message["content"] == "Let me compute."
  [call] = message["tool_calls"]
  assert call["function"] == {"name": "calc", "arguments": '{"expression": "12+30"}'}
  assert chatlib.reply_message(text, "stop", tools_offered=False)[0]["content"] == text
  thought, _ = chatlib.reply_message("<think>\nhmm\n</think>\n\nIt is 42.", "length",
                                     tools_offered=False)
  assert thought == {"role": "assistant", "reasoning_content": "hmm", "content": "It is 42."}
  # The agent sends the call back: the template writes it as Qwen's Hermes block.
  [sent] = chatlib.template_messages([message])
  assert sent["tool_calls"][0]["arguments"] == {"expression": "12+30"}
  rendered = chat.tokenizer.apply_chat_template(
      [{"role": "user", "content": "q"}, sent], add_generation_prompt=False)
  assert ('<tool_call>\n{"name": "calc", "arguments": {"expression": "12+30"}}\n</tool_call>'
          in rendered)
  # A harness that re-serialises the arguments, or re-spaces the text, rewrote the reply.
  respaced = dict(message, content="Let  me compute.")
  assert chatlib.same_reply(chatlib.given_reply(respaced), chatlib.given_reply(message)) == (
      "rewritten")
  assert chatlib.same_reply(chatlib.given_reply(message), chatlib.given_reply(message)) == "same"
  other = dict(message, content="Something else.")
  assert chatlib.same_reply(chatlib.given_reply(other), chatlib.given_reply(message)) == "other"


def test_the_continuation_is_what_the_template_writes_after_a_reply(qwen2):
  chat = qwen2.chat
  history = [{"role": "user", "content": "What is 1+2?"},
             {"role": "assistant", "content": "3"}]
  following = [{"role": "user", "content": "And 2+2?"}]
  whole = chat.tokenizer.apply_chat_template(history + following)
  before = chat.tokenizer.apply_chat_template(history, add_generation_prompt=False)
  end = before.rindex("<|im_end|>") + len("<|im_end|>")
  assert chat.tokenizer.decode(chatlib.continuation(chat, following)) == whole[end:]


def test_a_rewritten_reply_is_realigned_and_a_new_conversation_is_forked(qwen2):
  chat, engine = qwen2.chat, qwen2.engine
  with AgentEndpoint(engine, chat, SAMPLING) as endpoint:
    session = endpoint.open_session()
    client = _client(endpoint, session)
    first = [{"role": "user", "content": "What is 12+30?"}]
    answer = client.chat.completions.create(model="policy", messages=first, n=2)
    b = _sent(answer.choices[1].message)
    # The agent goes on from the second choice, its text re-spaced by a harness.
    rewritten = dict(b, content="  " + b["content"] + "  ")
    client.chat.completions.create(model="policy", messages=first + [
        rewritten, {"role": "user", "content": "Sure?"}])
    # ...and starts a conversation of its own (a summary, a sub-agent).
    client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": "Summarise the task."}])
    endpoint.close_session(session)
  assert session.drift == {"new": 2, "realigned": 1, "forked": 1}
  assert [c.plan.parent for c in session.calls] == [None, None, 1, None]
  branches = session.branches()
  assert [br.calls for br in branches] == [(0,), (1, 2), (3,)]
  _assert_sampled(engine, session)


def test_a_thinking_templates_dropped_reasoning_follows_the_rule(qwen3):
  """Qwen3's template (enable_thinking=False) opens each turn with an empty think block and
  drops it from turns that later turns follow: under "keep" the history keeps it as sampled
  (one sequence), under "template" the second call's prompt is the template's own rendering,
  a sequence of its own."""
  chat, engine = qwen3.chat, qwen3.engine
  prompts = {}
  for rule in ("keep", "template"):
    with AgentEndpoint(engine, chat, SAMPLING, reasoning=rule) as endpoint:
      session = endpoint.open_session()
      client = _client(endpoint, session)
      messages = [{"role": "user", "content": "What is 12+30?"}]
      answer = client.chat.completions.create(model="policy", messages=messages)
      messages += [_sent(answer.choices[0].message), {"role": "user", "content": "Sure?"}]
      second = client.chat.completions.create(
          model="policy", messages=messages, extra_body={"return_prompt_token_ids": True})
      endpoint.close_session(session)
    prompts[rule] = second.choices[0].prompt_token_ids
    _assert_sampled(engine, session)
    if rule == "keep":
      assert session.drift == {"new": 1, "clean": 1}
      assert [b.calls for b in session.branches()] == [(0, 1)]
    else:
      assert session.drift == {"new": 1, "forked": 1}
      assert [b.calls for b in session.branches()] == [(0,), (1,)]
      assert session.calls[1].plan.why.startswith("the template renders the history")
      assert prompts[rule] == chatlib.render(chat, chatlib.template_messages(messages))
  assert chat.tokenizer.decode(prompts["keep"]).count("<think>") == 2
  assert chat.tokenizer.decode(prompts["template"]).count("<think>") == 1


def test_an_sdk_retry_replays_the_first_answer_instead_of_sampling_again(qwen2):
  chat, engine = qwen2.chat, qwen2.engine
  with AgentEndpoint(engine, chat, SAMPLING) as endpoint:
    session = endpoint.open_session()
    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 1+2?"}]}
    headers = {"Authorization": f"Bearer {session.key}"}
    url = endpoint.url + "/chat/completions"
    first = httpx.post(url, json=body, headers=headers, timeout=60).json()
    retry = httpx.post(url, json=body, timeout=60,
                       headers={**headers, "x-stainless-retry-count": "1"}).json()
    again = httpx.post(url, json=body, headers=headers, timeout=60).json()
    assert retry == first and again["id"] != first["id"]
    assert len(session.calls) == 2 and session.replays == 1

    # The official client's own retry: its first try times out while the engine is held,
    # its retry (x-stainless-retry-count: 1, the same body) waits for that try's answer.
    other = endpoint.open_session()
    client = _client(endpoint, other, max_retries=1, timeout=1.0)
    held = endpoint.queue.hold()
    try:
      started = time.monotonic()
      threading.Timer(1.5, held.release).start()
      answer = client.chat.completions.create(model="policy", messages=body["messages"])
    finally:
      held.release()
    assert time.monotonic() - started > 1.0
    assert len(other.calls) == 1 and other.replays == 1
    assert answer.choices[0].longrl["call"] == 0
    # The first try's client left, the retry got the reply: the call is the agent's.
    assert [b.calls for b in other.branches()] == [(0,)] and other.undelivered == 0

    # A client that times out and does not retry: its reply reached nobody, so no branch
    # holds it (and the next call, from the same history, is a new conversation).
    gone = endpoint.open_session()
    held = endpoint.queue.hold()
    try:
      with pytest.raises(openai.APITimeoutError):
        _client(endpoint, gone, timeout=0.5).chat.completions.create(
            model="policy", messages=body["messages"])
    finally:
      held.release()
    deadline = time.monotonic() + 60
    while not gone.calls and time.monotonic() < deadline:
      time.sleep(0.05)
    time.sleep(0.2)  # the handler's check, after the call is recorded
    assert len(gone.calls) == 1 and gone.branches() == [] and gone.undelivered == 1


def test_every_endpoint_answers_the_official_client(qwen2):
  chat, engine = qwen2.chat, qwen2.engine
  with AgentEndpoint(engine, chat, SAMPLING) as endpoint:
    session = endpoint.open_session()
    client = _client(endpoint, session)
    assert [m.id for m in client.models.list()] == ["longrl"]
    # Streaming: synthesised from the recorded call, nothing lost.
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is 1+2?"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [call] = session.calls
    assert content == endpoint.decode(call.completion.token_ids)
    assert chunks[-1].usage.completion_tokens == len(call.completion.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # A text prompt, then one that extends it token for token (its ids as given).
    text = client.completions.create(model="policy", prompt="What is 1+2?", max_tokens=4,
                                     extra_body={"return_token_ids": True,
                                                 "return_prompt_token_ids": True})
    ids = text.choices[0].prompt_token_ids + text.choices[0].response_token_ids
    longer = client.completions.create(model="policy", prompt=ids + [5, 6], max_tokens=4,
                                       stream=True)
    assert "".join(c.choices[0].text for c in longer)
    # Log-probs in OpenAI's shape, one per recorded token.
    logprobs = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Go"}], logprobs=True)
    assert len(logprobs.choices[0].logprobs.content) == len(session.calls[-1].completion.token_ids)
    endpoint.close_session(session)
  assert [c.plan.parent for c in session.calls] == [None, None, 1, None]
  assert session.drift == {"new": 2, "clean": 1, "forked": 1}
  _assert_sampled(engine, session)


def test_stop_strings_cut_the_reply_and_its_tokens(qwen2):
  """Greedy, the same reply twice: the second, asked to stop at a string of the first, ends
  before it, and its recorded tokens end at the token that completes it."""
  chat, engine = qwen2.chat, qwen2.engine
  greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
  with AgentEndpoint(engine, chat, greedy) as endpoint:
    session = endpoint.open_session()
    client = _client(endpoint, session)
    messages = [{"role": "user", "content": "What is 1+2?"}]
    full = client.chat.completions.create(model="policy", messages=messages, seed=7)
    text = full.choices[0].message.content
    assert len(text) > 4 and full.choices[0].finish_reason == "length"
    stop = text[2:4]
    cut = client.chat.completions.create(model="policy", messages=messages, stop=[stop])
    endpoint.close_session(session)
  [whole, call] = session.calls
  reply = cut.choices[0].message.content
  assert cut.choices[0].finish_reason == "stop" and reply == text[:text.index(stop)]
  tokens = call.completion.token_ids
  assert tokens.tolist() == whole.completion.token_ids[:len(tokens)].tolist()
  assert stop in endpoint.decode(tokens) and stop not in endpoint.decode(tokens[:-1])
  assert session.overrides["seed"] == 1


def test_bad_calls_get_openai_errors_that_name_what_is_wrong(qwen2):
  chat, engine = qwen2.chat, qwen2.engine
  AgentEndpoint(engine, chat, SAMPLING).close()  # never started: closes without waiting
  with AgentEndpoint(engine, chat, SAMPLING, limits=Limits(max_body_bytes=2000)) as endpoint:
    session = endpoint.open_session()
    client = _client(endpoint, session)
    with pytest.raises(openai.AuthenticationError, match="unknown or ended session key"):
      _client(endpoint, session, api_key="sk-wrong").models.list()
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]: unknown role 'robot'"):
      client.chat.completions.create(model="p", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\]"):
      client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                     n=99)
    with pytest.raises(openai.APIStatusError, match="takes at most 2000") as e:
      client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x" * 3000}])
    assert e.value.status_code == 413
    # A session's own base URL works with any key; an ended session is refused.
    by_url = openai.OpenAI(base_url=endpoint.session_url(session), api_key="unused",
                           max_retries=0)
    by_url.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    endpoint.close_session(session)
    with pytest.raises(openai.AuthenticationError):
      by_url.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    assert json.loads(httpx.get(endpoint.url + "/nothing", headers={
        "Authorization": "Bearer x"}).text)["error"]["code"] == 401
  assert len(session.calls) == 1


def test_agent_episodes_train_through_the_loop_on_the_tokens_sampled(qwen2, tmp_path):
  """Two RL steps whose rollouts are an agent's episodes (AgentRollouts): each episode asks,
  then asks again in the same conversation, and writes an auxiliary title in a conversation
  of its own, which keep_call leaves out of the loss (one episode writes a note instead,
  kept: a second branch); one agent crashes and its episode is dropped. The trainer's
  log-probs of every trained token equal the engine's (had a branch's tokens not been the
  ones sampled, in that context, they would not), each trajectory carries its branch's
  discounted return, and the two-branch episode counts once in the advantages."""
  from rl import rewards
  from rl.agents.rollouts import AgentRollouts
  from rl.config import RLConfig
  from rl.tasks.math import MathTask
  from tests import helpers
  chat = qwen2.chat
  engine = JaxEngine(qwen2.cfg, qwen2.params)  # the run syncs its weights into it
  episodes = {"started": 0}
  lock = threading.Lock()

  def agent(base_url, api_key, record):
    with lock:
      episodes["started"] += 1
      crash, note = episodes["started"] == 3, episodes["started"] == 2
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": record["question"]}]
    first = client.chat.completions.create(model="policy", messages=messages)
    if crash:
      raise RuntimeError("the agent's harness failed")
    messages += [_sent(first.choices[0].message), {"role": "user", "content": "Are you sure?"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": ("Note: " if note else "Title: ") + record["question"]}])
    return second.choices[0].message.content

  def reward(record, result, session):
    del record, result
    # Per call (ask, ask again, title): the title's reward goes nowhere (its call is
    # filtered), the others are discounted back to the episode's first call.
    return [0.5, float(session.metadata["sample"] % 2), 7.0]

  config = RLConfig(num_steps=2, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8,
                    seq_len=160, learning_rate=1e-4, temperature=1.0)
  task = MathTask(train_path=f"{qwen2.path}/data/train.jsonl",
                  test_path=f"{qwen2.path}/data/test.jsonl",
                  fields={"problem": "question"})
  source = AgentRollouts(agent=agent, reward=reward, discount=0.5,
                         keep_call=lambda call: not call.messages[0]["content"].startswith(
                             "Title"))
  steps, _ = helpers.steps(qwen2.params, qwen2.cfg, copy=True, engine=engine, task=task,
                           tokenizer=chat, config=config, rollouts=source,
                           reward=rewards.named_chain({"episode": rewards.episode_reward()}))
  try:
    records = [next(steps) for _ in range(2)]
  finally:
    source.close()
  first = records[0]
  assert first.metrics["agent_episodes"] == 4 and first.metrics["agent_episodes_failed"] == 1
  assert first.metrics["agent_drift_clean"] == 3 and first.metrics["agent_drift_forked"] == 3
  # The crashed episode and the titles are not trained; the note is an episode's second branch.
  assert len(first.trajectories) == 4
  for t, r in zip(first.trajectories, first.rewards):
    assert r == t.reward
    if t.counts == {"calls": 1}:
      assert r == 7.0 and t.turn_rewards == [7.0]
    else:
      assert r == pytest.approx(0.5 + 0.5 * (t.sample % 2)) and len(t.turn_ends) == 2
      assert t.turn_rewards == pytest.approx([r, t.sample % 2])
  from rl import advantages
  keys = [(t.group, t.sample) for t in first.trajectories]
  [shared] = {k for k in keys if keys.count(k) == 2}
  ids = [sorted(set(keys)).index(k) for k in keys]
  groups = jnp.asarray([t.group for t in first.trajectories])
  np.testing.assert_allclose(first.advantages, advantages.per_episode(
      advantages.mean_baseline, jnp.asarray(first.rewards), groups, 2, ids), rtol=1e-6)
  pair = [a for k, a in zip(keys, first.advantages) if k == shared]
  assert pair[0] == pair[1]
  for record in records:
    assert record.metrics["engine_logp_diff_max"] < 1e-3, record.metrics
  assert records[1].metrics["agent_episodes_failed"] == 0


def test_tool_demonstrations_train_qwen_tool_calls(tmp_path):
  """tiny_checkpoint's tool demonstrations: a share of them call `calc` in the chat
  template's Hermes block, which the endpoint reads back as OpenAI's tool call; without
  tools the data is as it was."""
  from rl import sft
  from models.tokenizer import ChatPrompts, HFTokenizer
  plain = tiny_checkpoint.write_data(str(tmp_path / "plain"), num_train=200, num_test=10)
  tools = tiny_checkpoint.write_data(str(tmp_path / "tools"), num_train=200, num_test=10,
                                     tool_calls=0.3)
  read = lambda d: [json.loads(line) for line in open(f"{d}/sft.jsonl")]
  plain_demos, tool_demos = read(plain), read(tools)
  called = [d for d in tool_demos if len(d["messages"]) == 4]
  assert not any(len(d["messages"]) == 4 for d in plain_demos)
  assert 0.2 < len(called) / len(tool_demos) < 0.4
  # The demonstrations that do not call are the plain data's, demonstrator's slips included.
  kept = [d for d in tool_demos if len(d["messages"]) == 2]
  assert all(d in plain_demos for d in kept)
  tiny_checkpoint.write_tokenizer(str(tmp_path), tiny_checkpoint.corpus(tools), family="qwen2")
  chat = ChatPrompts(HFTokenizer(str(tmp_path)))
  example = called[0]
  assert len(sft.read_demonstrations(f"{tools}/sft.jsonl", chat)) == len(tool_demos)
  ids, mask = chat.encode_conversation(example["messages"])
  trained = chat.tokenizer.decode([t for t, m in zip(ids, mask) if m])
  numbers = example["messages"][0]["content"].split("What is ")[1].split("?")[0]
  assert trained.startswith('<tool_call>\n{"name": "calc", "arguments": {"expression": "'
                            + numbers + '"}}\n</tool_call><|im_end|>')
  message, reason = chatlib.reply_message(trained.split("<|im_end|>")[0], "stop",
                                          tools_offered=True)
  assert reason == "tool_calls"
  assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"expression": numbers}


def test_the_calculator_agent_computes_and_refuses_code():
  from experiments.agents import calculator
  assert calculator.calc("12+3*2 - 4") == "14"
  assert calculator.calc("__import__('os')").startswith("error")
  assert calculator.calc("2**99999").startswith("error")


@pytest.mark.slow
def test_the_agent_demo_runs_end_to_end(tmp_path):
  """experiments/agent_demo.py at the size of a test: the checkpoint with tool
  demonstrations, the agent's held-out success before and after, one RL step of its
  episodes, the figure and results."""
  from experiments import agent_demo
  agent_demo.main(["--out", str(tmp_path), "--steps", "1", "--prompts", "2", "--samples",
                   "2", "--held_out", "4", "--sft_steps", "10"])
  results = json.load(open(tmp_path / "results.json"))
  assert set(results["before"]) == {"success", "tool_calls_rate", "failed"}
  assert results["before"]["failed"] == results["after"]["failed"] == 0
  assert len(results["reward_per_step"]) == 1
  assert (tmp_path / "agent_demo.png").stat().st_size > 10_000


def test_the_endpoint_serves_over_our_sglang_server(qwen2):
  """Any engine: the endpoint in front of SGLangEngine over our server (SGLang's /generate,
  token ids in and out), a two-call episode extending its first call's tokens; the recorded
  branch is what the embedded engine scores it as."""
  from rollouts.sglang import SGLangClient
  from rollouts.sglang_engine import SGLangEngine
  from tests import helpers
  with helpers.serving(qwen2.cfg, qwen2.params) as (url, _):
    engine = SGLangEngine(SGLangClient([url]), qwen2.cfg, weights_dir="unused")
    try:
      with AgentEndpoint(engine, qwen2.chat, SAMPLING) as endpoint:
        session = endpoint.open_session()
        client = _client(endpoint, session)
        messages = [{"role": "user", "content": "What is 12+30?"}]
        first = client.chat.completions.create(model="policy", messages=messages)
        messages += [_sent(first.choices[0].message), {"role": "user", "content": "Sure?"}]
        client.chat.completions.create(model="policy", messages=messages)
        endpoint.close_session(session)
    finally:
      engine.close()
  assert session.drift == {"new": 1, "clean": 1}
  assert [b.calls for b in session.branches()] == [(0, 1)]
  _assert_sampled(qwen2.engine, session)


def test_calls_during_a_weight_update_wait_or_get_429_with_retry_after(qwen2):
  chat, engine = qwen2.chat, qwen2.engine
  messages = [{"role": "user", "content": "What is 1+2?"}]
  with AgentEndpoint(engine, chat, SAMPLING, limits=Limits(retry_after_s=0.5)) as endpoint:
    session = endpoint.open_session()
    held = endpoint.queue.hold()
    try:
      with pytest.raises(openai.RateLimitError) as refused:
        _client(endpoint, session).chat.completions.create(model="p", messages=messages)
      assert refused.value.response.headers["retry-after"] == "0.5"
      # The SDK's own retry honours Retry-After; by then the update is over.
      threading.Timer(0.3, held.release).start()
      _client(endpoint, session, max_retries=2).chat.completions.create(
          model="p", messages=messages)
    finally:
      held.release()
    assert len(session.calls) == 1
  # The default: a call made while the engine takes new weights waits, then runs on them.
  with AgentEndpoint(JaxEngine(qwen2.cfg, qwen2.params), chat, SAMPLING) as endpoint:
    session = endpoint.open_session()
    held = endpoint.queue.hold()  # the update's own hold comes and goes inside ours
    try:
      endpoint.update_weights(qwen2.params, 1)
      answers = []
      call = threading.Thread(target=lambda: answers.append(_client(
          endpoint, session).chat.completions.create(model="p", messages=messages)))
      call.start()
      call.join(timeout=0.5)
      assert call.is_alive() and not session.calls
    finally:
      held.release()
    call.join(timeout=60)
    assert answers[0].choices[0].longrl["weight_versions"] == [1]


@pytest.mark.parametrize("name", ["mean_baseline", "group_normalized", "leave_one_out"])
def test_an_episode_of_many_branches_counts_once_in_its_advantage(name):
  """Group 0: episode a (two branches, reward 1), b and c (one each, reward 0); group 1:
  d, e. Per episode, the estimator sees a, b, c once each, and a's branches share a's
  advantage; with one branch an episode, per_episode is the estimator itself."""
  from rl import advantages
  estimator = advantages.ESTIMATORS[name]
  reward = jnp.asarray([1.0, 1.0, 0.0, 0.0, 0.5, 1.5])
  groups = jnp.asarray([0, 0, 0, 0, 1, 1])
  got = np.asarray(advantages.per_episode(estimator, reward, groups, 2, [0, 0, 1, 2, 3, 4]))
  once = np.asarray(estimator(jnp.asarray([1.0, 0.0, 0.0, 0.5, 1.5]),
                              jnp.asarray([0, 0, 0, 1, 1]), 2))
  np.testing.assert_allclose(got, [once[0] / 2, once[0] / 2, *once[1:]], rtol=1e-6)
  alone = advantages.per_episode(estimator, reward, groups, 2, np.arange(6))
  np.testing.assert_allclose(alone, estimator(reward, groups, 2), rtol=1e-6)


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory) -> Model:
  """The tiny Qwen2 after 60 SFT steps on demonstrations that all call `calc`: greedy, it
  calls the tool (with whatever arguments it has learnt)."""
  path = tiny_checkpoint.make(str(tmp_path_factory.mktemp("tools")), sft_steps=60,
                              tool_calls=1.0, progress=False)
  checkpoint = HFCheckpoint(path, dtype="float32")
  cfg = checkpoint(0)
  params = checkpoint.load(cfg)
  return Model(path, checkpoint.tokenizer(), cfg, params, JaxEngine(cfg, params))


@pytest.mark.slow
def test_tool_calls_made_and_answered_stay_the_tokens_sampled(tool_caller):
  """The calculator agent (experiments/agents/calculator.py) on a model that calls the tool:
  each episode is one sequence, the model's tool call, the tool's answer (out of the loss) and
  its next turn, exactly as the engine sampled and scores them; a harness that re-serialises
  the call's arguments (indented, keys reordered) still extends the call cleanly."""
  from experiments.agents import calculator
  greedy = SamplingParams(max_new_tokens=40, temperature=0.0)
  with AgentEndpoint(tool_caller.engine, tool_caller.chat, greedy) as endpoint:
    sessions = []
    for question in ("What is 12+34?", "What is 56+78?"):
      session = endpoint.open_session()
      result = calculator.solve(endpoint.url, session.key, question)
      endpoint.close_session(session)
      sessions.append(session)
      assert result["tool_calls"] >= 1
      assert session.drift["new"] == 1 and session.drift["clean"] == len(session.calls) - 1
      [branch] = session.branches()
      text = tool_caller.chat.tokenizer.decode(branch.token_ids)
      assert text.startswith("<tool_call>\n") and "<tool_response>\n" in text
      _assert_sampled(tool_caller.engine, session)
    # A harness that writes the call back its own way: the same call, clean.
    session = endpoint.open_session()
    client = _client(endpoint, session)
    messages = [{"role": "user", "content": "What is 12+34?" + calculator.INSTRUCTION}]
    first = client.chat.completions.create(model="p", messages=messages,
                                           tools=[calculator.CALCULATOR])
    [call] = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "calc", "arguments": json.dumps(arguments, indent=2, sort_keys=True)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "46"}]
    client.chat.completions.create(model="p", messages=messages, tools=[calculator.CALCULATOR])
    endpoint.close_session(session)
  assert session.drift == {"new": 1, "clean": 1}
  _assert_sampled(tool_caller.engine, session)


class Concurrency:
  """An engine, its generate calls' sizes and the most that ran at once recorded."""

  def __init__(self, engine):
    self.engine, self.sizes, self.running, self.most = engine, [], 0, 0
    self._lock = threading.Lock()

  @property
  def capabilities(self):
    return self.engine.capabilities

  def generate(self, prompts, *args, **kwargs):
    with self._lock:
      self.sizes.append(len(prompts))
      self.running += 1
      self.most = max(self.most, self.running)
    try:
      return self.engine.generate(prompts, *args, **kwargs)
    finally:
      with self._lock:
        self.running -= 1


def _six_agents_at_once(endpoint):
  start = threading.Barrier(6)

  def agent():
    session = endpoint.open_session()
    start.wait(timeout=60)
    _client(endpoint, session).chat.completions.create(
        model="p", messages=[{"role": "user", "content": "What is 1+2?"}])

  threads = [threading.Thread(target=agent) for _ in range(6)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=120)


def test_servers_get_each_call_as_it_arrives_the_embedded_engine_batches(qwen2):
  """Servers batch continuously: each call goes to them on its own, at once (none waits for
  another's end). The embedded engine decodes a batch at a time: the calls waiting go
  together, one generate after another."""
  from rollouts.sglang import SGLangClient
  from rollouts.sglang_engine import SGLangEngine
  from tests import helpers
  with helpers.serving(qwen2.cfg, qwen2.params) as (url, _):
    served = SGLangEngine(SGLangClient([url]), qwen2.cfg, weights_dir="unused")
    try:
      servers = Concurrency(served)
      with AgentEndpoint(servers, qwen2.chat, SAMPLING) as endpoint:
        _six_agents_at_once(endpoint)
    finally:
      served.close()
  assert servers.sizes == [1] * 6 and servers.most > 1
  embedded = Concurrency(qwen2.engine)
  with AgentEndpoint(embedded, qwen2.chat, SAMPLING) as endpoint:
    _six_agents_at_once(endpoint)
  assert sum(embedded.sizes) == 6 and embedded.most == 1
