"""Tokenizers. `CharTokenizer` maps each character of a fixed alphabet to one id; it serves
the synthetic tasks, where a real vocabulary would only slow a tiny model down. `HFTokenizer`
is a real checkpoint's tokenizer: tokenizer.json through the `tokenizers` library, and the
chat template, special tokens and stop tokens from its tokenizer_config.json (or
chat_template.jinja) and generation_config.json. Both have encode / decode / pad_id / bos_id /
eos_id / vocab_size.
"""

import dataclasses
import datetime
import json
import os
import re
import string
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + "+-*/=()<>.,;:#? "
# Qwen2.5-VL's placeholder tokens (models.vision.PLACEHOLDER's, and its video's), as a
# CharTokenizer's extra_specials: ids 3 (vision start), 4 (image), 5 (vision end), 6 (video),
# models.config.tiny_vision's; and an alphabet that also spells the visual tasks' questions.
VISION_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
VISION_ALPHABET = DEFAULT_ALPHABET + string.ascii_uppercase + "\n'"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Ids 0, 1, 2 are <pad>, <bos>, <eos>, then the `extra_specials` (strings encoded as one
  token each wherever they appear in a text, e.g. a vision-language model's
  models.vision.PLACEHOLDER tokens); the alphabet follows in order."""

  alphabet: str = DEFAULT_ALPHABET
  extra_specials: tuple[str, ...] = ()

  def __post_init__(self):
    if len(set(self.alphabet)) != len(self.alphabet):
      raise ValueError(f"CharTokenizer alphabet has repeated characters: {self.alphabet!r}")

  @property
  def special_tokens(self) -> tuple[str, ...]:
    return (PAD, BOS, EOS) + tuple(self.extra_specials)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def vocab_size(self) -> int:
    return len(self.special_tokens) + len(self.alphabet)

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    offset = len(self.special_tokens)
    index = {c: i + offset for i, c in enumerate(self.alphabet)}
    ids = []
    for part in _split_specials(text, self.extra_specials):
      if part in self.extra_specials:
        ids.append(3 + self.extra_specials.index(part))
        continue
      unknown = sorted(set(part) - index.keys())
      if unknown:
        raise ValueError(f"CharTokenizer cannot encode characters {unknown} in {text[:60]!r}; "
                         f"its alphabet is {self.alphabet!r}")
      ids += [index[c] for c in part]
    return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, stopping at the first <eos> and skipping other special tokens."""
    offset = len(self.special_tokens)
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i >= offset:
        out.append(self.alphabet[i - offset])
    return "".join(out)


def vision_chars() -> CharTokenizer:
  """The CharTokenizer of a tiny vision-language model (models.config.tiny_vision's token
  ids): VISION_ALPHABET, and VISION_SPECIALS as single tokens."""
  return CharTokenizer(VISION_ALPHABET, VISION_SPECIALS)


def _split_specials(text: str, specials: Sequence[str]) -> list[str]:
  """`text` cut into the `specials` it holds and the text between them, in order."""
  if not specials:
    return [text]
  pattern = "(" + "|".join(re.escape(x) for x in specials) + ")"
  return [part for part in re.split(pattern, text) if part]


@dataclasses.dataclass(frozen=True)
class WithImages:
  """A vision-language model's tokenizer: `tokenizer`'s encode, decode and the rest, and
  `vision`, the model's VisionConfig (its image tokens and image bounds), by which prompts
  with images are encoded (rl.rollout.prompt_ids) and batched (rl.batch)."""
  tokenizer: Any
  vision: Any  # models.config.VisionConfig

  def __getattr__(self, name):
    if name in ("tokenizer", "vision"):  # not set yet (a copy being made)
      raise AttributeError(name)
    return getattr(self.tokenizer, name)


def _special_token(value) -> str | None:
  """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
  if isinstance(value, dict):
    return value.get("content")
  return value


def _chat_template(ckpt_dir: str, config: dict[str, Any]) -> str | None:
  """The checkpoint's default chat template, where transformers 5 finds it: chat_template.jinja
  first (what its save_pretrained writes, dropping the template from tokenizer_config.json;
  tokenization_utils_base.py's from_pretrained gives that file priority), then
  tokenizer_config.json's (a string, or named templates: the one named default), then the
  processor's legacy chat_template.json (where a vision-language checkpoint may keep its
  only one: the processor renders its chats, processing_utils.py reads that file)."""
  path = os.path.join(ckpt_dir, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  template = config.get("chat_template")
  if isinstance(template, list):
    return {t["name"]: t["template"] for t in template}.get("default")
  if template is None:
    template = HFTokenizer._read_json(ckpt_dir, "chat_template.json").get("chat_template")
  return template


def _template_environment() -> jinja2.Environment:
  """Jinja as Hugging Face runs chat templates: sandboxed (templates are untrusted code),
  trim_blocks and lstrip_blocks, loop controls, and their helper functions."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
      x, indent=indent, ensure_ascii=ensure_ascii)
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


class HFTokenizer:
  """The tokenizer of a Hugging Face checkpoint directory (no network access).

  Reads tokenizer.json (required), tokenizer_config.json (special tokens, chat template),
  the chat template from its own file where there is one (`_chat_template`), and the
  eos_token_id of generation_config.json and config.json (the stop tokens: SGLang stops at
  all of them, configs/model_config.py L2190-2208) when present.
  """

  def __init__(self, ckpt_dir: str):
    path = os.path.join(ckpt_dir, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no tokenizer.json in {ckpt_dir}")
    self._tok = tokenizers.Tokenizer.from_file(path)
    self._config = self._read_json(ckpt_dir, "tokenizer_config.json")
    self.special_tokens_map = {
        key: _special_token(self._config.get(key))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if _special_token(self._config.get(key)) is not None}
    self._template = None
    self.chat_template = _chat_template(ckpt_dir, self._config)
    eos = () if self.eos_id is None else (self.eos_id,)
    self.stop_token_ids = tuple(dict.fromkeys((*checkpoint_eos_ids(ckpt_dir), *eos)))

  @staticmethod
  def _read_json(ckpt_dir, name) -> dict[str, Any]:
    path = os.path.join(ckpt_dir, name)
    if not os.path.isfile(path):
      return {}
    with open(path) as f:
      return json.load(f)

  def _id(self, key):
    token = self.special_tokens_map.get(key)
    return None if token is None else self._tok.token_to_id(token)

  @property
  def bos_id(self) -> int | None:
    return self._id("bos_token")

  @property
  def eos_id(self) -> int | None:
    return self._id("eos_token")

  @property
  def pad_id(self) -> int:
    pad = self._id("pad_token")
    return pad if pad is not None else (self.eos_id or 0)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def encode_with_offsets(self, text: str) -> list[tuple[int, tuple[int, int]]]:
    """(id, (start, end) character offsets into `text`) of each token."""
    encoding = self._tok.encode(text, add_special_tokens=False)
    return list(zip(encoding.ids, encoding.offsets))

  def special_ids(self) -> set[int]:
    """Ids of the tokenizer's special added tokens."""
    return {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}

  def apply_chat_template(self, messages: list[dict[str, Any]], *,
                          add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text for `messages` under the checkpoint's chat template; extra keyword
    arguments (tools, enable_thinking, ...) go to the template. Encode it with `encode`: the
    template writes the special tokens itself."""
    if not self.chat_template:
      raise ValueError("this checkpoint has no chat template (chat_template.jinja, "
                       "tokenizer_config.json's chat_template or chat_template.json)")
    if self._template is None:  # compiled once: compiling costs more than rendering
      self._template = _template_environment().from_string(self.chat_template)
    return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           **self.special_tokens_map, **kwargs)


class ChatPrompts:
  """An HFTokenizer seen through the task interface (`encode(text, add_bos=..., add_eos=...)`,
  `decode`, `eos_id`, `vocab_size`). A prompt's text becomes one user message under the
  checkpoint's chat template (after `system_prompt` when given; `template_args` such as
  Qwen3's enable_thinking go to the template), plain text when it has none. A completion's
  text (`add_eos=True`, e.g. an SFT demonstration) is encoded as it is, then the token the
  template closes an assistant turn with (Qwen's <|im_end|>, Llama 3's <|eot_id|>), which is
  also `eos_id`, the stop token of generation. Decoding drops special tokens."""

  def __init__(self, tokenizer: HFTokenizer, *, system_prompt: str | None = None,
               template_args: dict[str, Any] | None = None):
    self.tokenizer = tokenizer
    self.system_prompt = system_prompt
    self.template_args = dict(template_args or {})
    self.eos_id = _end_of_turn(tokenizer) if tokenizer.chat_template else tokenizer.eos_id
    if self.eos_id is None:
      raise ValueError("the checkpoint's tokenizer has no eos_token and no chat template to "
                       "end a turn: generation would never stop")
    # The end of a turn first, then the checkpoint's own stop tokens.
    self.stop_token_ids = tuple(dict.fromkeys((self.eos_id, *tokenizer.stop_token_ids)))
    self.vocab_size = tokenizer.vocab_size

  def messages(self, text: str) -> list[dict[str, str]]:
    system = [] if self.system_prompt is None else [
        {"role": "system", "content": self.system_prompt}]
    return system + [{"role": "user", "content": text}]

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    del add_bos  # a prompt's special tokens are the chat template's
    if add_eos:
      return self.tokenizer.encode(text) + [self.eos_id]
    if self.tokenizer.chat_template:
      text = self.tokenizer.apply_chat_template(self.messages(text), **self.template_args)
    return self.tokenizer.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)

  def encode_conversation(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation under the chat template, and which of them are the
    assistant's: each assistant message's content up to and including the end-of-turn token
    (what an SFT demonstration trains on), not the template's text around it. ValueError when
    the template renders an earlier assistant turn differently once later turns follow
    (Qwen3's drops their thinking): give such demonstrations one assistant turn each."""
    whole = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                               **self.template_args)
    spans = []
    for i, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      before = self.tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True,
                                                  **self.template_args)
      through = self.tokenizer.apply_chat_template(messages[:i + 1],
                                                   add_generation_prompt=False,
                                                   **self.template_args)
      if not (through.startswith(before) and whole.startswith(through)):
        raise ValueError(f"the chat template renders assistant turn {i} differently once "
                         "later turns follow; give each demonstration one assistant turn")
      spans.append((len(before), len(through)))
    encoding = self.tokenizer.encode_with_offsets(whole)
    ids, mask = [], []
    for token, (start, _) in encoding:
      ids.append(token)
      mask.append(any(a <= start < b for a, b in spans))
    # A turn's text after its end-of-turn token (Qwen's "\n") is never generated.
    for k in range(1, len(ids)):
      if mask[k] and mask[k - 1] and ids[k - 1] == self.eos_id:
        mask[k] = False
    return ids, mask


def _end_of_turn(tokenizer: HFTokenizer) -> int | None:
  """The special token the chat template writes right after an assistant message's content;
  the tokenizer's eos token when it writes none."""
  marker = "\ue000longrl\ue000"  # private-use characters: no template writes them
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
      add_generation_prompt=False)
  after = text.split(marker, 1)[1] if marker in text else ""
  ids = tokenizer.encode(after)
  special = tokenizer.special_ids()
  return ids[0] if ids and ids[0] in special else tokenizer.eos_id


def checkpoint_eos_ids(path: str) -> tuple[int, ...]:
  """The eos_token_id(s) of generation_config.json, then config.json, in checkpoint directory
  `path` (none for ""): SGLang stops every request at them too, besides its stop_token_ids,
  unless ignore_eos (configs/model_config.py L2190-2208, managers/schedule_batch.py
  L1856-1871)."""
  ids = []
  for name in ("generation_config.json", "config.json"):
    file = os.path.join(path, name)
    if path and os.path.isfile(file):
      with open(file) as f:
        found = json.load(f).get("eos_token_id")
      ids += [] if found is None else [found] if isinstance(found, int) else list(found)
  return tuple(dict.fromkeys(ids))


def stop_ids(tokenizer) -> tuple[int, ...]:
  """The tokens generation stops at: a checkpoint's set where the tokenizer has one
  (ChatPrompts and HFTokenizer: the end of a turn and the eos ids of generation_config.json and
  config.json, which SGLang servers stop at too), else its eos_id."""
  return tuple(getattr(tokenizer, "stop_token_ids", None) or (tokenizer.eos_id,))
