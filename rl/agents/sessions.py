"""Sessions: one agent episode's calls, each recorded with the exact tokens the engine saw and
sampled, linked into the sequences a trainer trains on.

A call's prompt is planned from the calls before it: when its messages extend an earlier
call's messages and the reply that call gave (or its text prompt extends that call's prompt
and completion), the prompt is that call's exact tokens (prompt, then completion) and only the
new suffix is rendered, so the prompt extends the earlier sequence token for token. Each
plan's drift is classified and counted, never silent:
  "new"        the session's first conversation;
  "clean"      the agent sent back the reply as given;
  "realigned"  a harness re-serialised the reply (whitespace, tool-call arguments): the
               recorded tokens stand in for its rewrite;
  "forked"     no recorded call extends to these messages (a new conversation in the
               session, an edited history, or, under reasoning="template", a history the
               template renders otherwise than it was sampled): a sequence of its own.
A thinking template (Qwen3) drops earlier turns' reasoning when later turns follow; the
`reasoning` rule says what that becomes: "keep" (the history keeps the reasoning as sampled,
one sequence per conversation) or "template" (the history as the template renders it: each
call whose history it re-renders starts a sequence of its own).

`Session.branches()` gives one Branch per leaf of the call tree: a forked conversation is two.
It owns no HTTP, engine or training (endpoint.py; the loop).
"""

import collections
import dataclasses
import hashlib
import threading
from typing import Literal

import numpy as np

from models.tokenizer import ChatPrompts
from rl.agents import chat as chatlib
from rollouts.engine import Completion

Drift = Literal["new", "clean", "realigned", "forked"]
Reasoning = Literal["keep", "template"]
REASONING_RULES = ("keep", "template")


@dataclasses.dataclass(frozen=True)
class Plan:
  """A call's prompt before it is sampled: prompt_ids i32[p]; parent: the call whose exact
  tokens it extends (None: a sequence of its own); why: the fork's reason ("" otherwise)."""
  prompt_ids: np.ndarray
  parent: int | None
  drift: Drift
  why: str = ""


@dataclasses.dataclass(frozen=True)
class Call:
  """One sampled completion. messages / reply: a chat call's request messages and the
  assistant message it was given (chat.template_messages' shape); text: a text call's prompt
  and completion as returned (None for chat calls), which a later text prompt extends."""
  index: int
  plan: Plan
  completion: Completion
  messages: list | None = None
  reply: dict | None = None
  text: str | None = None

  @property
  def tokens(self) -> np.ndarray:
    """i32[p + n] the prompt, then the completion."""
    return np.concatenate([self.plan.prompt_ids, self.completion.token_ids]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Branch:
  """One sequence to train on: the calls from a root to a leaf (`calls`, their indices).
  prompt_ids: i32[p] the root's prompt; token_ids: i32[n] everything after it; policy_mask:
  bool[n] True on the tokens the engine sampled (each call's completion), False on what the
  agent sent (tool results, user turns, the template's framing); logprobs: f32[n] and
  versions: i32[n] the engine's, 0 and -1 off the policy's tokens."""
  calls: tuple[int, ...]
  prompt_ids: np.ndarray
  token_ids: np.ndarray
  policy_mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray


class SessionClosed(Exception):
  """A call on a session that has ended; the endpoint answers 409."""


class Session:
  """One episode's calls. Thread-safe: an agent may call from several threads at once."""

  def __init__(self, key: str, chat: ChatPrompts, *, reasoning: Reasoning = "keep",
               metadata: dict | None = None):
    if reasoning not in REASONING_RULES:
      raise ValueError(f"reasoning must be one of {REASONING_RULES}, got {reasoning!r}")
    self.key = key
    self.metadata = dict(metadata or {})
    self._chat = chat
    self._reasoning = reasoning
    self._lock = threading.Lock()
    self._calls: list[Call] = []
    self._answers: dict[str, tuple[threading.Event, list]] = {}
    self._delivered: set[int] = set()  # calls whose answer reached the agent
    self.closed = False
    self.drift = collections.Counter()
    self.overrides = collections.Counter()
    self.replays = 0

  @property
  def calls(self) -> list[Call]:
    with self._lock:
      return list(self._calls)

  def plan_chat(self, messages: list[dict], tools=None) -> Plan:
    """The prompt of a chat call with `messages` (chat.template_messages' shape)."""
    with self._lock:
      self._check_open()
      found = self._extended(messages)
      chat_calls = any(c.messages is not None for c in self._calls)
    if found is None:
      return Plan(np.asarray(chatlib.render(self._chat, messages, tools), np.int32), None,
                  "forked" if chat_calls else "new",
                  "no recorded call extends to these messages" if chat_calls else "")
    call, verdict = found
    following = messages[len(call.messages) + 1:]
    ids = np.concatenate([self._closed_turn(call),
                          chatlib.continuation(self._chat, following, tools)]).astype(np.int32)
    if self._reasoning == "template":
      fresh = chatlib.render(self._chat, messages, tools)
      if self._chat.tokenizer.decode(ids) != self._chat.tokenizer.decode(fresh):
        return Plan(np.asarray(fresh, np.int32), None, "forked",
                    "the template renders the history otherwise than it was sampled")
    return Plan(ids, call.index, "clean" if verdict == "same" else "realigned")

  def _extended(self, messages: list[dict]) -> tuple[Call, str] | None:
    """The recorded chat call whose messages and reply `messages` extend, deepest first; a
    reply sent back as given before one a harness re-serialised."""
    best, best_key = None, None
    for call in self._calls:
      m = len(call.messages) if call.messages is not None else -1
      if m < 0 or len(messages) <= m + 1 or messages[:m] != call.messages:
        continue
      verdict = chatlib.same_reply(messages[m], call.reply)
      if verdict == "other":
        continue
      key = (m, verdict == "same", call.index)
      if best_key is None or key > best_key:
        best, best_key = (call, verdict), key
    return best

  def _closed_turn(self, call: Call) -> np.ndarray:
    """The call's tokens with its turn closed: a reply cut by its length or a stop string
    did not sample the end-of-turn token the template writes after it."""
    tokens = call.tokens
    if tokens[-1] != self._chat.eos_id:
      tokens = np.append(tokens, np.int32(self._chat.eos_id))
    return tokens

  def plan_text(self, prompt: str | list[int]) -> Plan:
    """The prompt of a text completion: ids as given, or text encoded; either extends the
    recorded text call it starts with."""
    with self._lock:
      self._check_open()
      best = None
      for call in self._calls:
        if call.messages is not None:
          continue
        tokens = call.tokens
        extends = (prompt[:len(tokens)] == tokens.tolist() if isinstance(prompt, list)
                   else prompt.startswith(call.text))
        if extends and (best is None or len(tokens) > len(best.tokens)):
          best = call
      any_text = any(c.messages is None for c in self._calls)
    if isinstance(prompt, list):
      ids = np.asarray(prompt, np.int32)
    elif best is not None:
      rest = self._chat.tokenizer.encode(prompt[len(best.text):])
      ids = np.concatenate([best.tokens, np.asarray(rest, np.int32)]).astype(np.int32)
    else:
      ids = np.asarray(self._chat.tokenizer.encode(prompt), np.int32)
    if best is not None:
      return Plan(ids, best.index, "clean")
    return Plan(ids, None, "forked" if any_text else "new",
                "no recorded call extends this prompt" if any_text else "")

  def record(self, plan: Plan, completion: Completion, *, messages=None, reply=None,
             text=None) -> int:
    """Records a sampled call; its index."""
    with self._lock:
      self._check_open()
      if plan.parent is not None:
        parent = self._calls[plan.parent].tokens
        assert np.array_equal(plan.prompt_ids[:len(parent)], parent), "a plan lost its prefix"
      index = len(self._calls)
      self._calls.append(Call(index, plan, completion, messages, reply, text))
      self.drift[plan.drift] += 1
      return index

  def answer_slot(self, body: bytes, retry: bool) -> tuple[threading.Event, list, bool]:
    """(done, [response], first) for a request body: an SDK's retry (`retry`: its
    x-stainless-retry-count > 0) of a body already sent gets that call's slot, to replay its
    response (or wait for it) rather than sample again, unless that call failed; any other
    request a fresh slot (a repeated body without the header is a new sample)."""
    digest = hashlib.blake2b(body, digest_size=16).hexdigest()
    with self._lock:
      self._check_open()
      done, answer = self._answers.get(digest, (None, None))
      if retry and done is not None and (answer or not done.is_set()):
        self.replays += 1
        return (*self._answers[digest], False)
      slot = (threading.Event(), [])
      self._answers[digest] = slot
      return (*slot, True)

  def delivered(self, calls) -> None:
    """The answer of `calls` (indices) reached the agent. A call never delivered (its client
    left first, and no retry of it came) is in no branch: the agent never saw its reply."""
    with self._lock:
      self._delivered.update(calls)

  @property
  def undelivered(self) -> int:
    with self._lock:
      return len(self._calls) - len(self._delivered)

  def close(self) -> None:
    with self._lock:
      self.closed = True

  def _check_open(self):
    if self.closed:
      raise SessionClosed(f"session {self.key[:12]}... has ended")

  def branches(self) -> list[Branch]:
    """One Branch per delivered leaf call (a call no later call extends), in their order."""
    calls = self.calls
    with self._lock:
      delivered = set(self._delivered)
    parents = {c.plan.parent for c in calls}
    branches = []
    for leaf in calls:
      if leaf.index in parents or leaf.index not in delivered:
        continue
      path = [leaf]
      while path[-1].plan.parent is not None:
        path.append(calls[path[-1].plan.parent])
      path.reverse()
      branches.append(_branch(path))
    return branches


def _branch(path: list[Call]) -> Branch:
  """The sequence of a root-to-leaf path: the leaf's tokens, each call's completion marked."""
  prompt = path[0].plan.prompt_ids
  tokens = path[-1].tokens[len(prompt):]
  mask = np.zeros(len(tokens), bool)
  logprobs = np.zeros(len(tokens), np.float32)
  versions = np.full(len(tokens), -1, np.int32)
  for call in path:
    start = len(call.plan.prompt_ids) - len(prompt)
    done = call.completion
    span = slice(start, start + len(done.token_ids))
    mask[span] = True if done.policy_mask is None else done.policy_mask
    logprobs[span] = done.logprobs
    versions[span] = done.versions
  return Branch(tuple(c.index for c in path), prompt, tokens, mask, logprobs, versions)
