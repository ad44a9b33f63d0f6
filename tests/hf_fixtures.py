"""Tiny Hugging Face checkpoints written by `transformers` itself, and the logits of both
sides, for the interop tests.

Every parameter (norm scales and biases included) is random, so a wrong mapping of any single
tensor changes the logits.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import torch
import transformers

from pbsd_jax.models.config import ModelConfig
from pbsd_jax.models.transformer import Transformer

# The models are tiny: one thread is fastest, and several threads contending with XLA's on a
# shared CPU make generation orders of magnitude slower.
torch.set_num_threads(1)

_BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, max_position_embeddings=256)

# name -> (model_type, config overrides). Together: QKV bias, q/k norm, head_dim != D/H, MoE with
# and without renormalised top-k, tied and untied embeddings, 1 and 2 KV heads, theta 1e4 and 1e6.
CASES = {
    "qwen2": ("qwen2", dict(num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen2_tied_mqa": ("qwen2", dict(num_key_value_heads=1, rope_theta=1e4,
                                     tie_word_embeddings=True)),
    "qwen3_wide_heads": ("qwen3", dict(num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                                       tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=1, head_dim=16, rope_theta=1e6,
                                    num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, norm_topk_prob=True,
                                    tie_word_embeddings=False)),
    "qwen3_moe_unnormed_tied": ("qwen3_moe", dict(num_key_value_heads=2, rope_theta=1e4,
                                                  num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=16,
                                                  norm_topk_prob=False,
                                                  tie_word_embeddings=True)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1, rope_theta=1e4,
                                tie_word_embeddings=False)),
    "llama_tied_gqa": ("llama", dict(num_key_value_heads=2, rope_theta=1e6,
                                     tie_word_embeddings=True)),
    "llama_attention_bias": ("llama", dict(num_key_value_heads=2, rope_theta=1e4,
                                           attention_bias=True, tie_word_embeddings=False)),
    # Scaled RoPE over an original context of 8 positions, so that the 12-token rows reach past
    # it: Llama 3.1's frequency bands, and Qwen3's YaRN (with its cos / sin multiplier) plus
    # attention_bias (q/k/v and output biases).
    "llama31_rope": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_parameters=dict(
                                       rope_type="llama3", rope_theta=1e4, factor=8.0,
                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=8))),
    "qwen3_yarn_bias": ("qwen3", dict(num_key_value_heads=2, head_dim=16, attention_bias=True,
                                      tie_word_embeddings=False, rope_parameters=dict(
                                          rope_type="yarn", rope_theta=1e4, factor=4.0,
                                          original_max_position_embeddings=8))),
}


def hf_config(case: str) -> transformers.PretrainedConfig:
  model_type, overrides = CASES[case]
  return transformers.AutoConfig.for_model(model_type, **{**_BASE, **overrides})


def randomize_(model: torch.nn.Module, seed: int) -> None:
  """Noise on every parameter: norm scales 1 + 0.2 N(0,1), everything else 0.2 N(0,1)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = 0.2 * torch.randn(param.shape, generator=generator)
      param.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def make_model(case: str, seed: int = 0):
  """A random f32 eager-attention model of `case`, in eval mode."""
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(
      hf_config(case), dtype=torch.float32, attn_implementation="eager")
  randomize_(model, seed)
  return model.eval()


def write_checkpoint(case: str, path: str, seed: int = 0, max_shard_size: str = "5GB"):
  """`save_pretrained` of `make_model(case)` into `path`; returns the torch model."""
  model = make_model(case, seed)
  model.save_pretrained(path, max_shard_size=max_shard_size)
  return model


def from_pretrained(path: str):
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()


def torch_logits(model, tokens, mask):
  """HF logits with our position convention: positions count real (mask True) tokens only."""
  tokens = torch.as_tensor(tokens, dtype=torch.long)
  mask = torch.as_tensor(mask, dtype=torch.long)
  positions = torch.clamp(torch.cumsum(mask, -1) - 1, min=0)
  with torch.no_grad():
    return model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits.numpy()


@functools.partial(jax.jit, static_argnames=("model",))
def _forward(model: ModelConfig, params: Any, tokens: jax.Array, mask: jax.Array) -> jax.Array:
  return Transformer(model).apply({"params": params}, tokens, mask).logits


def forward_logits(model: ModelConfig, params: Any, tokens: jax.Array,
                   mask: jax.Array | None = None) -> jax.Array:
  """Our full-vocabulary logits `f32[B, T, V]` of `tokens: i32[B, T]` (mask `bool[B, T]`).

  Position `t` holds the logits of the token after `tokens[:, t]`; left padding (mask False)
  never shifts positions, so a left-padded row equals the unpadded one on its real tokens.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask, bool)
  return _forward(model, params, tokens, mask)


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_chatml_tokenizer(path: str) -> None:
  """A tiny byte-level BPE `tokenizer.json` (Qwen-style, lossless) with ChatML special tokens,
  plus a `tokenizer_config.json` holding the chat template and special-token names."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top

  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  corpus = ["You are a helpful assistant.", "Who founded the city of Varnhollow?",
            "<search> Varnhollow founder </search>", "be brief", "hello there"]
  tokenizer.train_from_iterator(corpus * 4, trainer)
  os.makedirs(path, exist_ok=True)
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
               "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
