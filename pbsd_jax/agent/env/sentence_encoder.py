"""A sentence-embedding model: a Hugging Face encoder, mean-pooled and L2-normalised.

This is the encoder of Search-R1's dense retriever (e5-base-v2, `pooling_method="mean"`): a
text's embedding is the encoder's last hidden states averaged over its attention mask, scaled
to unit length, so the inner product of two embeddings is their cosine. e5 models are trained
with a `query: ` prefix on queries and `passage: ` on passages (`PREFIXES["e5"]`); other models
read the text as it is (`"none"`). Texts are truncated to `max_length` tokens (Search-R1's:
256, for queries and passages alike).

torch and transformers (the `hf` extra) are imported when an encoder is built, not with this
module.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

# name -> (query prefix, passage prefix).
PREFIXES = {"e5": ("query: ", "passage: "), "none": ("", "")}
MAX_LENGTH = 256


class SentenceEncoder:
  """A Hugging Face encoder directory (`AutoModel` + `AutoTokenizer`, local files only) that
  maps texts to unit-length mean-pooled embeddings `f32[N, D]`."""

  def __init__(self, model_dir: str, prefixes: str = "e5", max_length: int = MAX_LENGTH):
    """Loads the model and tokenizer of `model_dir` for inference.

    Args:
      model_dir: a directory written by `save_pretrained` (config, weights, tokenizer).
      prefixes: a `PREFIXES` name: what is put before queries and passages.
      max_length: tokens kept of each text (with the prefix and special tokens).
    """
    if prefixes not in PREFIXES:
      raise ValueError(f"prefixes must be one of {sorted(PREFIXES)}, got {prefixes!r}")
    if max_length < 1:
      raise ValueError(f"max_length must be >= 1, got {max_length!r}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
      raise ValueError(f"encoder {model_dir!r} is not a Hugging Face model directory (no "
                       "config.json)")
    import transformers  # pylint: disable=g-import-not-at-top
    self.model_dir = os.path.abspath(model_dir)
    self.prefixes = prefixes
    self.max_length = max_length
    self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    self.model = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True).eval()

  @property
  def query_prefix(self) -> str:
    return PREFIXES[self.prefixes][0]

  @property
  def passage_prefix(self) -> str:
    return PREFIXES[self.prefixes][1]

  def embed(self, texts: Sequence[str], prefix: str) -> np.ndarray:
    """`f32[N, D]` unit-length embeddings of `prefix + text` for the `N` texts, in one forward
    pass (right-padded to the longest; padding is outside every mask)."""
    import torch  # pylint: disable=g-import-not-at-top
    inputs = self.tokenizer([prefix + t for t in texts], max_length=self.max_length,
                            padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
      hidden = self.model(**inputs).last_hidden_state  # f32[N, L, D]
      mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # f32[N, L, 1]
      # An empty row (no special tokens, no prefix, no text) pools to zeros, not NaN.
      pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
      return torch.nn.functional.normalize(pooled, dim=-1).float().numpy()
