"""HFTokenizer against transformers' own tokenizer on a checkpoint the test writes: a small BPE
trained with `tokenizers`, Qwen-style special tokens and chat template."""

import json

import pytest
import tokenizers
import transformers

from models.tokenizer import ChatPrompts, CharTokenizer, HFTokenizer, stop_ids

# The shape of Qwen2.5's template: default system prompt, roles, generation prompt.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nPlease reason step by step.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["What is 12 + 30? The answer is 42.", "Let me think step by step about x^2 = 4.",
          "\\boxed{42} is the final answer", "Résumé: naïve café, 数学 problems, emoji 🙂"] * 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
  (path / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}))
  return str(path)


MESSAGES = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "x^2 = 4, x = ?"},
     {"role": "assistant", "content": "x = 2 or x = -2"},
     {"role": "user", "content": "Résumé 🙂"}],
]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_chat_template_equals_transformers(ckpt, messages, kwargs):
  ours = HFTokenizer(ckpt)
  theirs = transformers.AutoTokenizer.from_pretrained(ckpt)
  text = ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
  assert text == theirs.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True, **kwargs)
  assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
  assert text.count("<|im_start|>") == len([m for m in messages]) + 1 + (
      messages[0]["role"] != "system")


def test_encode_decode_round_trip_and_special_tokens(ckpt):
  tok = HFTokenizer(ckpt)
  for text in CORPUS[:4] + ["<|im_start|>user\nhi<|im_end|>"]:
    assert tok.decode(tok.encode(text)) == text
  im_end = tok.encode("<|im_end|>")
  assert len(im_end) == 1 and tok.eos_id == im_end[0]
  assert tok.pad_id == tok.encode("<|endoftext|>")[0]
  assert tok.bos_id is None
  assert set(tok.stop_token_ids) == {tok.eos_id, tok.pad_id}
  assert tok.vocab_size == len(transformers.AutoTokenizer.from_pretrained(ckpt))
  assert tok.decode(tok.encode("a<|im_end|>"), skip_special_tokens=True) == "a"


def test_template_cannot_escape_the_sandbox(tmp_path, ckpt):
  import shutil
  for name in ("tokenizer.json", "generation_config.json"):
    shutil.copy(f"{ckpt}/{name}", tmp_path / name)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}))
  import jinja2
  with pytest.raises(jinja2.exceptions.SecurityError):
    HFTokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_files_fail_clearly(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    HFTokenizer(str(tmp_path))


def test_generation_stops_where_an_sglang_server_would(tmp_path, ckpt):
  """SGLang stops every request at the eos ids of config.json and generation_config.json
  besides the ones it is sent: the trainer sends them all (the end of a turn first)."""
  import shutil
  tok = HFTokenizer(ckpt)
  im_end, end_of_text = tok.eos_id, tok.pad_id
  assert stop_ids(ChatPrompts(tok)) == (im_end, end_of_text)
  assert stop_ids(CharTokenizer()) == (CharTokenizer().eos_id,)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(f"{ckpt}/{name}", tmp_path / name)
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
  assert set(stop_ids(ChatPrompts(HFTokenizer(str(tmp_path))))) == {im_end, end_of_text, 7}


def test_the_chat_template_is_read_where_transformers_saves_it(ckpt, tmp_path):
  """transformers 5's save_pretrained moves the template to chat_template.jinja (a fine-tuned
  model a researcher brings); that file wins over tokenizer_config.json's, as in
  transformers; a vision-language checkpoint may hold its only one in chat_template.json."""
  saved = tmp_path / "saved"
  transformers.AutoTokenizer.from_pretrained(ckpt).save_pretrained(saved)
  assert (saved / "chat_template.jinja").is_file()
  assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
  theirs = transformers.AutoTokenizer.from_pretrained(saved)
  for messages in MESSAGES:
    assert HFTokenizer(str(saved)).apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
  config = json.loads((saved / "tokenizer_config.json").read_text())
  (saved / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "x"}))
  assert HFTokenizer(str(saved)).chat_template == CHAT_TEMPLATE
  assert transformers.AutoTokenizer.from_pretrained(saved).chat_template == CHAT_TEMPLATE
  (saved / "chat_template.jinja").unlink()
  (saved / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="no chat template"):
    HFTokenizer(str(saved)).apply_chat_template(MESSAGES[0])
  (saved / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
  assert HFTokenizer(str(saved)).apply_chat_template(MESSAGES[0]) == \
      HFTokenizer(ckpt).apply_chat_template(MESSAGES[0])
