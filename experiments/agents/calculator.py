"""An agent that answers an arithmetic question, with a calculator it may call through
function calling. It knows nothing of longrl: an OpenAI-compatible server, its key and the
question are all it is given.

  python -m experiments.agents.calculator BASE_URL API_KEY "What is 12+34+56?"
"""

import json
import re
import sys

import openai

INSTRUCTION = ("\nPlease reason step by step, and put your final answer within \\boxed{}.")
CALCULATOR = {"type": "function", "function": {
    "name": "calc", "description": "Adds, subtracts and multiplies whole numbers.",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. 12+34+56"}}}}}
_EXPRESSION = re.compile(r"\s*\d+(\s*[-+*]\s*\d+)*\s*")


def calc(expression: str) -> str:
  """The calculator: whole numbers joined by +, - and *; anything else is an error."""
  if not isinstance(expression, str) or not _EXPRESSION.fullmatch(expression):
    return "error: give whole numbers joined by +, - or *"
  return str(eval(expression, {"__builtins__": {}}))  # checked above: digits and operators


def solve(base_url: str, api_key: str, question: str, *, max_calls: int = 3,
          temperature: float | None = None) -> dict:
  """Asks the model, runs the calculator for every call it makes, asks again, until it
  answers without calling or has made `max_calls` calls. Returns its answer and how many
  times it called the calculator."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=600)
  messages = [{"role": "user", "content": question + INSTRUCTION}]
  tool_calls = 0
  for _ in range(max_calls):
    reply = client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR],
        **({} if temperature is None else {"temperature": temperature}))
    message = reply.choices[0].message
    if not message.tool_calls:
      return {"answer": message.content or "", "tool_calls": tool_calls}
    messages.append({"role": "assistant", "content": message.content or "",
                     "tool_calls": [call.model_dump() for call in message.tool_calls]})
    for call in message.tool_calls:
      tool_calls += 1
      try:
        result = calc(json.loads(call.function.arguments).get("expression"))
      except (ValueError, AttributeError):
        result = "error: the arguments are not a JSON object"
      messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
  return {"answer": "", "tool_calls": tool_calls}


def calculator_agent(base_url: str, api_key: str, record: dict) -> str:
  """The agent on a task record ({"question": ...}): its answer's text."""
  return solve(base_url, api_key, record["question"])["answer"]


if __name__ == "__main__":
  print(json.dumps(solve(*sys.argv[1:4])))
