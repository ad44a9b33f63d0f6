"""Chat templates of Hugging Face tokenizer directories, rendered as transformers renders them.

A tokenizer directory carries its prompt format as a Jinja template (`chat_template.jinja`, or
the `chat_template` field of `tokenizer_config.json`). `apply_chat_template` renders a list of
messages with it in the same sandboxed Jinja environment transformers uses, so the prompt text is
identical to `tokenizer.apply_chat_template(..., tokenize=False)` without importing transformers.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Sequence

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _token_text(token: Any) -> Any:
  return token.get("content") if isinstance(token, dict) else token


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
  # The same sandboxed environment, filters and globals transformers uses, so a template renders
  # identically here and in `tokenizer.apply_chat_template(..., tokenize=False)`.
  import datetime  # pylint: disable=g-import-not-at-top
  import jinja2  # pylint: disable=g-import-not-at-top
  import jinja2.ext  # pylint: disable=g-import-not-at-top
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


def chat_template_source(model_dir: str) -> str:
  """The default chat template of a tokenizer directory.

  `chat_template.jinja` wins over the `chat_template` field of `tokenizer_config.json` (as in
  transformers); a list of named templates yields the one named "default".
  """
  jinja_path = os.path.join(model_dir, "chat_template.jinja")
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read()
  config_path = os.path.join(model_dir, "tokenizer_config.json")
  template = None
  if os.path.exists(config_path):
    with open(config_path, encoding="utf-8") as f:
      template = json.load(f).get("chat_template")
  if isinstance(template, list):
    template = {t.get("name"): t.get("template") for t in template}
  if isinstance(template, dict):
    template = template.get("default")
  if not isinstance(template, str):
    raise ValueError(f"{model_dir}: no chat template (neither chat_template.jinja nor a "
                     "default 'chat_template' in tokenizer_config.json)")
  return template


def _special_tokens(model_dir: str) -> dict[str, str]:
  tokens: dict[str, str] = {}
  for file_name in ("special_tokens_map.json", "tokenizer_config.json"):
    file_path = os.path.join(model_dir, file_name)
    if os.path.exists(file_path):
      with open(file_path, encoding="utf-8") as f:
        data = json.load(f)
      for key in _SPECIAL_TOKENS:
        text = _token_text(data.get(key))
        if isinstance(text, str):
          tokens[key] = text
  return tokens


def apply_chat_template(model_dir: str, messages: Sequence[dict],
                        add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
  """Renders `messages` with the tokenizer directory's chat template, as transformers does.

  Args:
    model_dir: directory with `tokenizer_config.json` (and optionally `chat_template.jinja`).
    messages: `[{"role": ..., "content": ...}, ...]`; keys whose value is None are dropped.
    add_generation_prompt: append the header that opens the assistant's turn.
    **template_kwargs: extra template variables (`tools`, `documents`, `enable_thinking`...).

  Returns:
    The prompt text; special tokens appear as text (tokenise it without adding more).
  """
  if not messages:
    raise ValueError("apply_chat_template: messages is empty")
  chat = []
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise ValueError(f"apply_chat_template: messages[{i}] must be a dict, got {message!r}")
    chat.append({key: value for key, value in message.items() if value is not None})
  variables = {**_special_tokens(model_dir), "tools": None, "documents": None,
               **template_kwargs}
  return _compile_template(chat_template_source(model_dir)).render(
      messages=chat, add_generation_prompt=add_generation_prompt, **variables)
