"""ToolEnvironment: the policy calls tools until it answers; the task's verifier scores the
answer (the outcome reward; no per-turn rewards).

Each turn that ends in a tool call (formats.py) gets the call's result as its observation; a
turn without a call is the answer and ends the episode, as does a turn cut by its token budget
(truncated) or a call in the last allowed turn (truncated: no turn is left to use the result).
Every call runs on a thread of its own with a wall clock; what a tool returns is cut to
`max_result_tokens` tokens (give or take a merge at the cut, with a BPE tokenizer: the
observation is encoded whole, as the model's chat template would render it). A tool that
raises, hangs past the clock or floods its output gives an observation that says so ("error:
...", or the cut output ending in "...") and the episode goes on; it never ends the run. A hung
in-process tool's thread is abandoned, not killed (Python cannot kill a thread): tools that may
hang for real run their work in a subprocess, as `python` does in the sandbox.

Counters per turn: tool_calls, tool_errors (malformed calls, unknown tools, raised errors),
tool_timeouts.
"""

import threading
from typing import Any, Mapping, Sequence

from rl import ConfigError
from rl.envs.base import Observation, Turn, encode_text, register_environment
from rl.envs.formats import FORMATS, ToolCall
from rl.envs.tools import ToolError, ToolTimeout, open_tools

TRUNCATED_MARK = "..."


@register_environment("tools")
class ToolEnvironment:
  """Tools `tools` (names registered in rl.envs.tools) called in `call_format` (a key of
  rl.envs.formats.FORMATS), at most `max_turns` policy turns per episode, each at most
  `max_turn_tokens` tokens (None: only the episode's budget). `tool_options` maps a tool's
  name to the options of its factory, e.g. {"python": {"workers": 4}}."""

  def __init__(self, tools: Sequence[str] = ("calc",), *, call_format: str = "tagged",
               max_turns: int = 4, max_turn_tokens: int | None = None,
               max_result_tokens: int = 64, tool_timeout: float = 30.0,
               tool_options: Mapping[str, Mapping[str, Any]] | None = None):
    if call_format not in FORMATS:
      raise ConfigError(f"unknown tool-call format {call_format!r}; valid: "
                        f"{', '.join(sorted(FORMATS))}")
    if max_turns < 1 or (max_turn_tokens is not None and max_turn_tokens < 1):
      raise ConfigError(f"ToolEnvironment: max_turns={max_turns} and max_turn_tokens="
                        f"{max_turn_tokens} must be >= 1")
    if max_result_tokens <= len(TRUNCATED_MARK):
      raise ConfigError(f"ToolEnvironment.max_result_tokens={max_result_tokens} must exceed "
                        f"{len(TRUNCATED_MARK)}")
    self.tool_names = tuple(tools)
    self.format = FORMATS[call_format]
    self.max_turns, self.max_turn_tokens = max_turns, max_turn_tokens
    self.max_result_tokens, self.tool_timeout = max_result_tokens, tool_timeout
    self.tools = open_tools(self.tool_names, tool_options)
    self.stop_strings = self.format.stop_strings(self.tool_names)

  def reset(self, record: dict[str, Any]) -> None:
    del record
    return None  # stateless: the turn's index is all it needs

  def step(self, state, turn: Turn, tokenizer) -> tuple[None, Observation]:
    counts = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}
    calls = self.format.parse(turn.text, self.tool_names) if turn.finish_reason == "stop" \
        else []
    if not calls:  # the answer, or a turn its budget cut off
      return state, Observation(done=True, truncated=turn.finish_reason != "stop",
                                counts=counts)
    if turn.index + 1 >= self.max_turns:
      return state, Observation(done=True, truncated=True, counts=counts)
    results = [self._result(self._call(call, counts), tokenizer) for call in calls]
    # One encoding of the whole observation, as a chat template renders it: pieces encoded
    # apart would split merges at their seams (a result's last "\n" and the framing's first
    # are one token "\n\n" in Qwen's vocabulary, not two).
    ids = encode_text(tokenizer, self.format.observation_text(results))
    return state, Observation(tuple(ids), counts=counts)

  def _call(self, call: ToolCall, counts: dict[str, int]) -> str:
    """The text a call returns, or "error: ..."; counts it."""
    counts["tool_calls"] += 1
    if call.error:
      counts["tool_errors"] += 1
      return f"error: {call.error}"
    tool = self.tools.get(call.name)
    if tool is None:
      counts["tool_errors"] += 1
      return f"error: unknown tool {call.name!r}; tools: {', '.join(self.tool_names)}"
    outcome: dict[str, Any] = {}

    def run():
      try:
        args = call.arguments
        outcome["value"] = tool(**args) if isinstance(args, dict) else tool(args)
      except Exception as e:  # a tool's failure is the model's observation, not a crash
        outcome["error"] = e

    worker = threading.Thread(target=run, daemon=True, name=f"tool-{call.name}")
    worker.start()
    worker.join(self.tool_timeout)
    if worker.is_alive():
      counts["tool_timeouts"] += 1
      return f"error: {call.name} did not answer within {self.tool_timeout:g} s"
    error = outcome.get("error")
    if isinstance(error, ToolTimeout):
      counts["tool_timeouts"] += 1
      return f"error: {error}"
    if isinstance(error, ToolError):
      counts["tool_errors"] += 1
      return f"error: {error}"
    if error is not None:
      counts["tool_errors"] += 1
      return f"error: {type(error).__name__}: {error}"
    if not isinstance(outcome["value"], str):
      counts["tool_errors"] += 1
      return f"error: {call.name} returned {type(outcome['value']).__name__}, not text"
    return outcome["value"]

  def _result(self, text: str, tokenizer) -> str:
    """The result's text, cut to max_result_tokens tokens (ending in "...") when longer."""
    budget = self.max_result_tokens
    # Cut the text first: a flood of megabytes need not be tokenised to be thrown away.
    ids = encode_text(tokenizer, text[:16 * budget])
    if len(ids) <= budget and len(text) <= 16 * budget:
      return text
    mark = encode_text(tokenizer, TRUNCATED_MARK)
    return tokenizer.decode(ids[:budget - len(mark)]) + TRUNCATED_MARK

  def close(self) -> None:
    for tool in self.tools.values():
      close = getattr(tool, "close", None)
      if close is not None:
        close()
