"""Tool-call formats: how the policy writes a tool call in its turn, and how the results are
written back into the sequence.

"tagged", the default (every character of it is in CharTokenizer's alphabet): a call is a block
named after the tool, at the end of the turn, and its result follows as a result block:

    <calc>123456+654321</calc><result>777777</result>

The closing tags of the environment's tools are its stop strings, so the turn ends where the
call does and the result comes from the tool, not from the model.

"qwen", the Hermes style of Qwen2.5 / Qwen3 chat templates: one or more JSON calls in an
assistant turn that ends at <|im_end|> (the tokenizer's eos; no stop strings), the results as a
user message of tool responses, then the next assistant turn opened:

    <tool_call>
    {"name": "calc", "arguments": {"expression": "2+2"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    4
    </tool_response><|im_end|>
    <|im_start|>assistant

Owns parsing and the observation's framing; it does not run tools (tool_env.py does).
"""

import dataclasses
import json
import re
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """name: the tool; arguments: a tagged block's text (the tool's one argument) or a JSON
  call's arguments object (the tool's keyword arguments); error: what is wrong with a
  malformed call ("" when it is well formed)."""
  name: str
  arguments: str | dict
  error: str = ""


@dataclasses.dataclass(frozen=True)
class Framing:
  """The observation of a turn's calls: observation_open, then each result between
  result_open and result_close, then observation_close."""
  observation_open: str = ""
  result_open: str = ""
  result_close: str = ""
  observation_close: str = ""

  def observation_text(self, results: Sequence[str]) -> str:
    return self.observation_open + "".join(
        self.result_open + r + self.result_close for r in results) + self.observation_close


@dataclasses.dataclass(frozen=True)
class TaggedFormat(Framing):
  """`<NAME>ARGUMENTS</NAME>` ending the turn; results as `<result>TEXT</result>`."""
  result_open: str = "<result>"
  result_close: str = "</result>"

  def stop_strings(self, tools: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"</{name}>" for name in tools)

  def call_text(self, name: str, argument: str, parameter: str) -> str:
    """How the policy calls tool `name` with one argument (a demonstration's call)."""
    del parameter  # a tagged block's text is the tool's one argument
    return f"<{name}>{argument}</{name}>"

  def parse(self, text: str, tools: Sequence[str]) -> list[ToolCall]:
    """The call that ends `text`, or [] when it does not end in a tool's closing tag."""
    for name in tools:
      close = f"</{name}>"
      if text.endswith(close):
        body_end = len(text) - len(close)
        start = text.rfind(f"<{name}>", 0, body_end)
        if start < 0:
          return [ToolCall(name, "", error=f"{close} without an opening <{name}>")]
        return [ToolCall(name, text[start + len(name) + 2:body_end])]
    return []


_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class QwenFormat(Framing):
  """Hermes-style `<tool_call>` JSON blocks; results as `<tool_response>` blocks of a user
  message (the framing of Qwen2.5's chat template)."""
  observation_open: str = "\n<|im_start|>user"
  result_open: str = "\n<tool_response>\n"
  result_close: str = "\n</tool_response>"
  observation_close: str = "<|im_end|>\n<|im_start|>assistant\n"

  def stop_strings(self, tools: Sequence[str]) -> tuple[str, ...]:
    del tools  # the turn ends at <|im_end|>, the tokenizer's eos
    return ()

  def call_text(self, name: str, argument: str, parameter: str) -> str:
    """How the policy calls tool `name` with `parameter`=`argument`, its turn's end included."""
    return ("<tool_call>\n" + json.dumps({"name": name, "arguments": {parameter: argument}})
            + "\n</tool_call><|im_end|>")

  def parse(self, text: str, tools: Sequence[str]) -> list[ToolCall]:
    """Every `<tool_call>` block of the turn, in order."""
    del tools
    calls = []
    for block in _QWEN_CALL.findall(text):
      try:
        call = json.loads(block)
      except ValueError as e:
        calls.append(ToolCall("", "", error=f"the tool call is not JSON ({e})"))
        continue
      name = call.get("name") if isinstance(call, dict) else None
      arguments = call.get("arguments", {}) if isinstance(call, dict) else None
      if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
          arguments = json.loads(arguments)
        except ValueError:
          pass
      if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        calls.append(ToolCall("", "", error='a tool call is {"name": str, "arguments": {...}}'))
      else:
        calls.append(ToolCall(name, arguments))
    if not calls and "<tool_call>" in text:
      calls.append(ToolCall("", "", error="<tool_call> without </tool_call>"))
    return calls


FORMATS = {"tagged": TaggedFormat(), "qwen": QwenFormat()}
