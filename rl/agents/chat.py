"""OpenAI chat messages as the checkpoint's tokens, and a sampled reply back as a message.

Owns: the messages an OpenAI client sends, made into what a chat template reads (`template_
messages`: text parts joined, tool-call arguments parsed from their JSON string as SGLang
does, entrypoints/openai/serving_chat.py L198-215); a whole conversation's prompt (`render`);
the tokens that follow a recorded reply's end of turn when more messages follow it
(`continuation`: only the new suffix is rendered, so a recorded call's exact tokens stay as
sampled); a reply's text read as OpenAI's assistant message (`reply_message`: reasoning,
content, tool calls in Qwen's Hermes format, as SGLang's qwen25 detector reads them,
function_call/qwen25_detector.py L55-56); and whether a message the agent sends back is the
reply it was given (`same_reply`).

It does not own sessions, HTTP or the engine (sessions.py, endpoint.py).
"""

import json
import re
import secrets
from typing import Any, Literal, Sequence

from models.tokenizer import ChatPrompts
from rl.envs.formats import FORMATS

# A private-use string no template writes: the stand-in reply whose end of turn `continuation`
# looks for.
_MARKER = "\ue000longrl-reply\ue000"
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


class ChatError(ValueError):
  """A request whose messages cannot be rendered; the endpoint answers 400 with it."""


def _text(content: Any, where: str) -> str:
  """A message's content as text: a string, None, or OpenAI's list of text parts."""
  if content is None or isinstance(content, str):
    return content or ""
  if isinstance(content, list):
    parts = []
    for part in content:
      if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ChatError(f"{where}: only text content parts are served, got {kind!r}")
      parts.append(str(part.get("text", "")))
    return "".join(parts)
  raise ChatError(f"{where}: content must be a string or a list of parts, got "
                  f"{type(content).__name__}")


def _arguments(value: Any, where: str) -> dict:
  if isinstance(value, dict):
    return value
  try:
    parsed = json.loads(value or "{}")
  except (TypeError, ValueError) as e:
    raise ChatError(f"{where}: tool-call arguments are not JSON ({e})") from None
  if not isinstance(parsed, dict):
    raise ChatError(f"{where}: tool-call arguments must be a JSON object")
  return parsed


def template_messages(messages: Any) -> list[dict]:
  """The request's `messages` as a chat template reads them: {role, content} with the text
  parts joined, an assistant's `tool_calls` with their arguments parsed to an object and
  given both as OpenAI's `function` and at the call's top level (Qwen2.5's template reads
  `call.function` where it is defined, some templates `call.name`), `reasoning_content`
  kept where given. ChatError names a malformed message."""
  if not isinstance(messages, list) or not messages:
    raise ChatError("messages must be a non-empty list")
  out = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
      raise ChatError(f"{where} must be an object with a role")
    role = message["role"]
    if role not in ("system", "developer", "user", "assistant", "tool"):
      raise ChatError(f"{where}: unknown role {role!r}")
    item = {"role": "system" if role == "developer" else role,
            "content": _text(message.get("content"), where)}
    if role == "assistant":
      calls = []
      for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
          raise ChatError(f"{where}.tool_calls[{j}] must hold function.name")
        name = function["name"]
        arguments = _arguments(function.get("arguments"), f"{where}.tool_calls[{j}]")
        # Both shapes: Qwen's templates read either the call or its `function`.
        calls.append({"type": "function", "function": {"name": name, "arguments": arguments},
                      "name": name, "arguments": arguments})
      if calls:
        item["tool_calls"] = calls
      if message.get("reasoning_content"):
        item["reasoning_content"] = str(message["reasoning_content"])
    if role == "tool" and message.get("tool_call_id") is not None:
      item["tool_call_id"] = str(message["tool_call_id"])
    out.append(item)
  return out


def _apply(chat: ChatPrompts, messages: list[dict], tools, add_generation_prompt: bool) -> str:
  extra = {} if not tools else {"tools": tools}
  try:
    return chat.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              **chat.template_args, **extra)
  except Exception as e:  # the template's own raise_exception, or a field it cannot read
    raise ChatError(f"the chat template cannot render these messages: {e}") from None


def render(chat: ChatPrompts, messages: list[dict], tools=None) -> list[int]:
  """i32 ids of the whole conversation under the chat template, the assistant's turn opened."""
  return chat.tokenizer.encode(_apply(chat, messages, tools, True))


def continuation(chat: ChatPrompts, following: list[dict], tools=None) -> list[int]:
  """The ids that follow an assistant reply's end-of-turn token when `following` (messages
  after the reply: tool results, the user's next turn) come next, the next turn opened.

  Only this suffix is rendered: the reply and everything before it stay the exact tokens
  recorded. It is what the template writes after a stand-in reply, found by its end-of-turn
  token, so a template that renders earlier replies differently once later turns follow
  (Qwen3 drops their thinking) still gives the suffix it would give."""
  stand_in = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
              {"role": "assistant", "content": _MARKER}]
  text = _apply(chat, stand_in + following, tools, True)
  end = chat.tokenizer.decode([chat.eos_id])
  at = text.find(_MARKER)
  close = text.find(end, at) if at >= 0 else -1
  if close < 0:
    raise ChatError("the chat template does not close an assistant turn with "
                    f"{end!r}: a reply cannot be continued token for token")
  return chat.tokenizer.encode(text[close + len(end):])


def reply_message(text: str, finish: Literal["stop", "length", "abort"], *,
                  tools_offered: bool) -> tuple[dict, str]:
  """(OpenAI's assistant message, its finish_reason) for a reply's text (special tokens
  dropped). A leading <think>...</think> is `reasoning_content`; when tools were offered,
  complete `<tool_call>` blocks are `tool_calls` (ids `call_<hex>`, arguments a JSON string)
  and the text before the first is the content, stripped, as SGLang's detector gives it;
  finish_reason is then "tool_calls" (serving_chat.py L2645-2652)."""
  message: dict[str, Any] = {"role": "assistant"}
  thought = _THINK.match(text)
  if thought:
    message["reasoning_content"] = thought.group(1).strip("\n")
    text = text[thought.end():]
  reason = {"stop": "stop", "length": "length", "abort": "abort"}[finish]
  calls = [c for c in FORMATS["qwen"].parse(text, ()) if not c.error] if tools_offered else []
  if calls:
    text = text[:text.find("<tool_call>")].strip()
    message["tool_calls"] = [
        {"id": f"call_{secrets.token_hex(12)}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)
                      if isinstance(c.arguments, dict) else c.arguments}} for c in calls]
    reason = "tool_calls" if finish == "stop" else reason
  message["content"] = text
  return message, reason


def _loosely(text: str) -> str:
  return " ".join(text.split())


def same_reply(sent: dict, given: dict) -> Literal["same", "rewritten", "other"]:
  """Whether the assistant message an agent sends back (template_messages' shape) is the
  reply it was given: "same" (its content and tool calls, arguments compared as objects;
  reasoning when it sends reasoning), "rewritten" (a harness re-serialised it: the same text
  but for whitespace, the same calls' names), "other"."""
  if sent.get("role") != "assistant":
    return "other"
  calls = [(c["name"], c["arguments"]) for c in sent.get("tool_calls", [])]
  given_calls = [(c["name"], c["arguments"]) for c in given.get("tool_calls", [])]
  reasoning_kept = ("reasoning_content" not in sent
                    or sent["reasoning_content"] == given.get("reasoning_content"))
  if sent["content"] == given["content"] and calls == given_calls and reasoning_kept:
    return "same"
  if (_loosely(sent["content"]) == _loosely(given["content"])
      and [n for n, _ in calls] == [n for n, _ in given_calls]):
    return "rewritten"
  return "other"


def given_reply(message: dict) -> dict:
  """An assistant message as the endpoint returned it, in template_messages' shape."""
  return template_messages([message])[0]


def stop_at(text: str, stops: Sequence[str]) -> int | None:
  """Where the first of `stops` begins in `text` (OpenAI's `stop`: the text ends before it)."""
  found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
  return min(found) if found else None
