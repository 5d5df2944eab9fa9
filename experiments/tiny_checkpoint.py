"""A tiny pretrained checkpoint to try the recipes on without a model hub:
`python -m experiments.tiny_checkpoint OUT_DIR [--family qwen2|qwen3|qwen2_5_vl]
[--sft_steps N]`.

Writes what a researcher brings to a run, at a size a CPU trains in minutes:
- OUT_DIR/data: column-addition word problems in GSM8K's shape (train.jsonl, test.jsonl:
  {"question", "answer": "<worked solution>\\n#### N"}) and sft.jsonl, chat demonstrations
  ({"messages": [user, assistant]}) from a sloppy demonstrator that drops the last column's
  carry from 60% of the answers that have one (as the quickstart's);
- OUT_DIR: a Qwen2, Qwen3 or Qwen2.5-VL checkpoint written by transformers (config.json,
  safetensors; the Qwen2.5-VL's preprocessor_config.json), with a byte-level BPE tokenizer
  trained here with `tokenizers` (Qwen's digit-by-digit split, <|im_start|> / <|im_end|> /
  <|endoftext|>, Qwen2.5-VL's vision tokens) and the family's chat template (Qwen3's with its
  enable_thinking switch, Qwen2.5-VL's with image parts);
- then made competent outside the RL loop: SFT on the demonstrations under the chat template,
  loss on the assistant's tokens (rl.sft.read_demonstrations, as WarmStart.demonstrations
  reads them), saved back over the weights, so that RL starts from a model that is right
  about half the time and sloppy in a way a verifier of the true sum can unlearn.

Needs torch and transformers (the test extras). Nothing is downloaded.
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl.tasks.math import TEMPLATE  # noqa: E402

# Qwen2.5's chat template: its message loop, tool calls and tool responses included (the
# tools' system prompt left out: ChatPrompts gives the template no tools).
QWEN2_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + "
    "(call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3's, its message loop without tools: no default system prompt; the last assistant turn
# opens with its thinking block (empty here: these demonstrations do not think), and with
# enable_thinking=false the generation prompt opens an empty one.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + "
    "'<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
# Qwen2.5-VL's (its chat_template.json, as transformers' Qwen2-VL processor tests hold it): a
# message's content is a string, or parts of which an image part becomes the placeholder
# <|vision_start|><|image_pad|><|vision_end|> that the processor expands per image.
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {"qwen2": QWEN2_TEMPLATE, "qwen3": QWEN3_TEMPLATE, "qwen2_5_vl": QWEN2_5_VL_TEMPLATE}
# Qwen2's pre-tokenizer split: digits one by one, newlines apart from the text around them.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2.5-VL's image bounds shrunk: a rendered problem is a few dozen image tokens.
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64


def _problem(rng: random.Random, operands: int, digits: int) -> list[int]:
  """`operands` numbers of `digits` digits each (two two-digit numbers: the last column
  carries 45% of the time, so a sloppy demonstrator is wrong often enough to unlearn)."""
  return [rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(operands)]


def _worked(numbers: list[int], *, drop_final_carry: bool) -> tuple[str, str]:
  """(column steps, final answer) for sum(numbers), optionally forgetting the last carry."""
  from rl.tasks.arithmetic import column_solution
  steps = column_solution(numbers, drop_final_carry=drop_final_carry)
  return "".join(steps[:-1]), steps[-1][1:]


def _tool_demonstration(problem: str, numbers: list[int]) -> list[dict]:
  """A demonstration that calls the `calc` tool (Qwen's tool call, as the chat template reads
  it) and answers with its result."""
  total = str(sum(numbers))
  return [{"role": "user", "content": problem},
          {"role": "assistant", "content": "", "tool_calls": [
              {"name": "calc", "arguments": {"expression": "+".join(map(str, numbers))}}]},
          {"role": "tool", "content": total},
          {"role": "assistant", "content": f"The answer is \\boxed{{{total}}}."}]


def write_data(out_dir: str, *, num_train: int = 4000, num_test: int = 200, operands: int = 3,
               digits: int = 2, sloppy: float = 0.6, tool_calls: float = 0.0,
               seed: int = 0) -> str:
  """OUT_DIR/data/{train,test,sft}.jsonl (see the module docstring); returns the folder.
  `tool_calls`: the fraction of demonstrations that call a `calc` tool instead of working
  the sum out (each right: the tool is exact)."""
  data = os.path.join(out_dir, "data")
  os.makedirs(data, exist_ok=True)
  rng = random.Random(seed)
  seen, splits = set(), {"train": [], "test": []}
  while len(splits["train"]) < num_train or len(splits["test"]) < num_test:
    numbers = _problem(rng, operands, digits)
    question = f"What is {'+'.join(map(str, numbers))}?"
    if question in seen:
      continue
    seen.add(question)
    split = "test" if len(splits["test"]) < num_test and rng.random() < 0.1 else "train"
    if len(splits[split]) < (num_test if split == "test" else num_train):
      splits[split].append(numbers)
  for split, problems in splits.items():
    with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
      for numbers in problems:
        steps, answer = _worked(numbers, drop_final_carry=False)
        f.write(json.dumps({"question": f"What is {'+'.join(map(str, numbers))}?",
                            "answer": f"{steps}\n#### {answer}"}) + "\n")
  tools = random.Random(seed + 1)  # its own stream: without tools the data is as it was
  with open(os.path.join(data, "sft.jsonl"), "w") as f:
    for numbers in splits["train"]:
      steps, answer = _worked(numbers, drop_final_carry=rng.random() < sloppy)
      problem = TEMPLATE.format(problem=f"What is {'+'.join(map(str, numbers))}?")
      if tool_calls and tools.random() < tool_calls:
        f.write(json.dumps({"messages": _tool_demonstration(problem, numbers)}) + "\n")
        continue
      f.write(json.dumps({"messages": [
          {"role": "user", "content": problem},
          {"role": "assistant",
           "content": f"{steps}\nThe answer is \\boxed{{{answer}}}."}]}) + "\n")
  return data


def corpus(data_dir: str) -> list[str]:
  """Texts to train the tokenizer on: the demonstrations and the chat templates' words."""
  with open(os.path.join(data_dir, "sft.jsonl")) as f:
    texts = [m["content"] for line in f for m in json.loads(line)["messages"]]
  return texts + [QWEN2_TEMPLATE, "system\nuser\nassistant\n<think>\n\n</think>\n\n"] * 50


def write_tokenizer(out_dir: str, corpus: list[str], *, family: str,
                    vocab_size: int = 512) -> int:
  """tokenizer.json, tokenizer_config.json and generation_config.json in OUT_DIR; returns
  the vocabulary size."""
  import tokenizers
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  specials = SPECIALS + (VISION_SPECIALS if family == "qwen2_5_vl" else ())
  tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(specials),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATES[family],
               "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, f)
  if family == "qwen2_5_vl":  # the hub's Qwen2.5-VL holds it in the processor's file too
    with open(os.path.join(out_dir, "chat_template.json"), "w") as f:
      json.dump({"chat_template": TEMPLATES[family]}, f)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                tok.token_to_id("<|endoftext|>")]}, f)
  return tok.get_vocab_size(with_added_tokens=True)


def write_model(out_dir: str, vocab_size: int, *, family: str, hidden_size: int = 128,
                num_layers: int = 2, seed: int = 0) -> None:
  """A randomly initialised Qwen2 / Qwen3 / Qwen2.5-VL checkpoint written by transformers
  (Qwen2.5-VL's: a 2-block vision tower, the second with full attention, and its
  preprocessor_config.json)."""
  import torch
  import transformers
  torch.manual_seed(seed)
  shape = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=3 * hidden_size,
               max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6)
  if family == "qwen2":
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
  elif family == "qwen2_5_vl":
    with open(os.path.join(out_dir, "tokenizer.json")) as f:
      ids = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 6, 6]}, **shape),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=hidden_size, window_size=56,
                           fullatt_block_indexes=[1]),
        tie_word_embeddings=True, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"]))
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
                             ).save_pretrained(out_dir)
  else:
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        head_dim=hidden_size // 4, **shape))
  model.save_pretrained(out_dir, safe_serialization=True)


def make(out_dir: str, *, family: str = "qwen2", sft_steps: int = 400, batch_size: int = 64,
         operands: int = 2, tool_calls: float = 0.0, seed: int = 0,
         progress: bool = True) -> str:
  """The whole checkpoint (see the module docstring; `tool_calls`: write_data's); returns
  OUT_DIR."""
  from models import hf
  from rl import sft
  from rl.pretrained import HFCheckpoint
  os.makedirs(out_dir, exist_ok=True)
  data = write_data(out_dir, operands=operands, tool_calls=tool_calls, seed=seed)
  vocab = write_tokenizer(out_dir, corpus(data), family=family)
  write_model(out_dir, vocab, family=family, seed=seed)
  checkpoint = HFCheckpoint(out_dir, dtype="float32",
                            template_args={"enable_thinking": False} if family == "qwen3"
                            else None)
  if not sft_steps:  # as transformers initialised it
    return out_dir
  cfg = checkpoint(0)
  examples = sft.read_demonstrations(os.path.join(data, "sft.jsonl"), checkpoint.tokenizer())
  # Rows of 256 tokens hold three demonstrations: a third of the padding of 128.
  params, _ = sft.fit(checkpoint.load(cfg), cfg, examples.__getitem__, len(examples),
                      steps=sft_steps, batch_size=batch_size, learning_rate=3e-3, seq_len=256,
                      seed=seed, progress=progress, desc="SFT on demonstrations")
  hf.save(params, cfg, out_dir)
  return out_dir


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out_dir")
  parser.add_argument("--family", choices=tuple(TEMPLATES), default="qwen2")
  parser.add_argument("--sft_steps", type=int, default=600)
  parser.add_argument("--tool_calls", type=float, default=0.0,
                      help="the fraction of demonstrations that call a calc tool")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  print(make(args.out_dir, family=args.family, sft_steps=args.sft_steps,
             tool_calls=args.tool_calls, seed=args.seed))


if __name__ == "__main__":
  main()
