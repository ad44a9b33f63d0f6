"""Chat templates: prompts rendered exactly as `transformers` renders them.

The torch-backed tests need the `hf` extra (torch, transformers); the others write their own
tokenizer directory.
"""

import json

import pytest

from pbsd_jax.models.hf import chat_template

try:
  import hf_fixtures  # needs torch + transformers
except ImportError:
  hf_fixtures = None

requires_torch = pytest.mark.skipif(hf_fixtures is None, reason="needs the hf extra")


@requires_torch
def test_chat_template_renders_like_transformers(tmp_path):
  import transformers
  hf_fixtures.write_chatml_tokenizer(str(tmp_path))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  conversations = [
      [{"role": "user", "content": "who are you ?"}],
      [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
       {"role": "assistant", "content": "hello", "tool_calls": None},
       {"role": "user", "content": "who are you ?"}],
  ]
  for messages in conversations:
    for add_generation_prompt in (True, False):
      expected = tokenizer.apply_chat_template(
          messages, tokenize=False, add_generation_prompt=add_generation_prompt)
      assert chat_template.apply_chat_template(
          str(tmp_path), messages, add_generation_prompt=add_generation_prompt) == expected


@requires_torch
def test_chat_prompt_encodes_like_transformers_through_the_seqio_vocabulary(tmp_path):
  import transformers
  from pbsd_jax.data.vocab import HfTokenizerVocabulary  # imports TensorFlow (seqio)
  hf_fixtures.write_chatml_tokenizer(str(tmp_path))
  messages = [{"role": "user", "content": "Who founded the city of Varnhollow?"},
              {"role": "assistant", "content": "<search> Varnhollow founder </search>"}]
  text = chat_template.apply_chat_template(str(tmp_path), messages, add_generation_prompt=True)
  vocab = HfTokenizerVocabulary(str(tmp_path / "tokenizer.json"))
  ids = vocab.encode(text)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
  assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 4
  assert vocab.decode(ids) == text.split("<|im_end|>")[0]  # seqio decodes up to the first eos


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": "config", "eos_token": {"content": "</s>"}}))
  (tmp_path / "chat_template.jinja").write_text(
      "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
      "{% if add_generation_prompt %}[assistant]{% endif %}")
  text = chat_template.apply_chat_template(str(tmp_path), [{"role": "user", "content": "hi"}])
  assert text == "[user]hi</s>[assistant]"


def test_missing_chat_template_names_the_directory(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ValueError, match="no chat template"):
    chat_template.apply_chat_template(str(tmp_path), [{"role": "user", "content": "hi"}])
