"""Vocabularies as `seqio.Vocabulary`: a SentencePiece model trained on the synthetic corpus
(protocol tags are single tokens) and an adapter for Hugging Face `tokenizers` files (tags may
be several tokens; stop sequences handle that).

This module imports seqio, hence TensorFlow: import it from data-side code (tasks, scripts,
the host loop that tokenises prompts), never at import time of the model, rollout or learner
modules.

SentencePiece ids: pad = 0, eos = 1, unk = 2, no bos; then the eight protocol tags (3..10, in
`protocol.TAGS` order); then 256 byte-fallback pieces (so any text encodes without unk); then
the learned pieces. The default (NFKC) normaliser maps newlines and runs of spaces to one
space, so `decode(encode(s)) == s` for NFKC-normal text with single spaces, no newline and no
leading or trailing space. Every encoded text starts with a word-start piece, so a word right
after a tag gets its word-initial piece only if a space separates them ("<search> Name").
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import numpy as np
import seqio
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
import tensorflow as tf
import tokenizers

from pbsd_jax import protocol

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe") -> str:
  """Trains a SentencePiece model with the protocol tags as single tokens.

  Training is single-threaded over the texts in the given order, so the same texts give a
  byte-identical model, wherever it is written.

  Args:
    texts: training sentences (documents, prompts, oracle actions).
    model_prefix: writes `{model_prefix}.model` and `{model_prefix}.vocab`.
    vocab_size: the target number of pieces (an upper bound: a small corpus may give fewer).
    model_type: "bpe" (default: on the small synthetic corpus it keeps names and common
      words whole, so confusable names differ in a whole-word token) or "unigram".

  Returns:
    The path of the `.model` file.
  """
  if model_type not in ("unigram", "bpe"):
    raise ValueError(f"model_type must be 'unigram' or 'bpe', got {model_type!r}")
  # 3 special ids + the tags + 256 byte-fallback pieces must leave room for learned pieces.
  minimum = 3 + len(protocol.TAGS) + 256 + 64
  if vocab_size < minimum:
    raise ValueError(f"vocab_size must be at least {minimum}, got {vocab_size}")
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(list(texts)), model_prefix=model_prefix, vocab_size=vocab_size,
      model_type=model_type, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
      user_defined_symbols=list(protocol.TAGS), byte_fallback=True, split_digits=True,
      character_coverage=1.0, hard_vocab_limit=False, num_threads=1,
      shuffle_input_sentence=False, input_sentence_size=0, minloglevel=2)
  # The trainer records the output path in the model; keep only the base name so the same
  # texts give the same bytes wherever the model is written.
  model_file = f"{model_prefix}.model"
  with open(model_file, "rb") as f:
    model = sentencepiece_model_pb2.ModelProto.FromString(f.read())
  model.trainer_spec.model_prefix = os.path.basename(model_prefix)
  with open(model_file, "wb") as f:
    f.write(model.SerializeToString(deterministic=True))
  return model_file


def sentencepiece_vocabulary(model_file: str) -> seqio.SentencePieceVocabulary:
  """The seqio vocabulary of a SentencePiece model written by `train_sentencepiece`."""
  if not os.path.exists(model_file):
    raise FileNotFoundError(f"SentencePiece model not found: {model_file}")
  return seqio.SentencePieceVocabulary(model_file)


def load_vocabulary(path: str) -> seqio.Vocabulary:
  """A vocabulary from a file: `*.model` is SentencePiece, `*.json` a HF `tokenizer.json`."""
  if path.endswith(".model"):
    return sentencepiece_vocabulary(path)
  if path.endswith(".json"):
    return HfTokenizerVocabulary(path)
  raise ValueError(f"unknown vocabulary file type (want .model or .json): {path}")


def model_vocabulary(directory: str) -> seqio.Vocabulary:
  """A model's own tokenizer: `tokenizer.json` (Hugging Face `tokenizers`) or
  `tokenizer.model` (SentencePiece). The end-of-sequence token is the tokenizer config's
  `eos_token` when `generation_config.json` lists it among its `eos_token_id`s (or lists
  none), else the first id listed there (the token that ends a turn of an instruct model)."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    return sentencepiece_vocabulary(os.path.join(directory, "tokenizer.model"))
  vocab = HfTokenizerVocabulary(path)
  generation = os.path.join(directory, "generation_config.json")
  eos = None
  if os.path.isfile(generation):
    with open(generation) as f:
      eos = json.load(f).get("eos_token_id")
  eos = [eos] if isinstance(eos, int) else list(eos or [])
  if eos and vocab.eos_id not in eos:
    token = vocab.tokenizer.id_to_token(eos[0])
    if token is None:
      raise ValueError(f"{generation}: eos_token_id {eos[0]} is not in {path}")
    vocab = HfTokenizerVocabulary(path, eos_token=token)
  return vocab


def tag_ids(vocab: seqio.Vocabulary) -> dict[str, list[int]]:
  """Each protocol tag's token ids: one id with our SentencePiece model, possibly several
  with a HF tokenizer. The tag is encoded on its own, with any leading whitespace-only token
  (SentencePiece's word-start marker) dropped."""
  out = {}
  for tag in protocol.TAGS:
    ids = list(vocab.encode(tag))
    while len(ids) > 1 and not vocab.decode(ids[:1]).strip():
      ids = ids[1:]
    out[tag] = ids
  return out


def token_bytes(vocab: seqio.Vocabulary) -> list[bytes]:
  """The bytes each token id appends to the decoded text, for `stop_strings.build`.

  Special and added tokens append their own text (as `decode(..., skip_special_tokens=False)`
  writes them); SentencePiece control tokens append nothing.
  """
  if isinstance(vocab, HfTokenizerVocabulary):
    pieces = _tokenizer_bytes(vocab.tokenizer)
  elif isinstance(vocab, seqio.SentencePieceVocabulary):
    pieces = _sentencepiece_bytes(vocab.tokenizer)
  else:
    raise TypeError(f"token_bytes: unsupported vocabulary type {type(vocab).__name__}")
  return pieces + [b""] * (vocab.vocab_size - len(pieces))


def _sentencepiece_bytes(sp: spm.SentencePieceProcessor) -> list[bytes]:
  out = []
  for i in range(sp.get_piece_size()):
    piece = sp.id_to_piece(i)
    if sp.is_control(i):
      out.append(b"")
    elif sp.is_unknown(i):
      out.append(" \u2047 ".encode())  # what SentencePiece decodes it as
    else:
      out.append(_piece_bytes(piece, sp.is_byte(i)))
  return out


def _piece_bytes(piece: str, is_byte: bool) -> bytes:
  """A SentencePiece-style piece's bytes: a byte-fallback piece `<0x0A>` is its byte, `\u2581`
  starts a word (a space)."""
  return bytes([int(piece[3:5], 16)]) if is_byte else piece.replace("\u2581", " ").encode()


def _byte_level_alphabet() -> dict[str, int]:
  """GPT-2's byte -> printable character map, inverted (ByteLevel pre-tokenizer/decoder)."""
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def _tokenizer_bytes(tokenizer: tokenizers.Tokenizer) -> list[bytes]:
  """Token bytes of a `tokenizers` model with a ByteLevel or SentencePiece-style decoder."""
  spec = json.loads(tokenizer.to_str()).get("decoder") or {}
  kinds = [d.get("type") for d in spec.get("decoders", [spec])]
  byte_level = "ByteLevel" in kinds
  spaces = bool({"Metaspace", "Replace"} & set(kinds))  # SentencePiece's word-start marker
  known = {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}
  if set(kinds) - known or not (byte_level or spaces):
    raise ValueError(f"tokenizer decoder {kinds} is not supported for stop strings (ByteLevel "
                     "or SentencePiece-style Metaspace / Replace + ByteFallback)")
  alphabet = _byte_level_alphabet()
  added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
  out = []
  for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
    piece = tokenizer.id_to_token(i)
    if i in added or piece is None:
      out.append((added.get(i) or "").encode())
    elif byte_level:
      out.append(bytes(alphabet[c] for c in piece))
    else:
      byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
      out.append(_piece_bytes(piece, byte))
  return out


def _special_tokens_from_config(tokenizer_file: str) -> dict[str, str]:
  """`eos_token` / `pad_token` / `unk_token` from a sibling `tokenizer_config.json`."""
  config_file = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
  if not os.path.exists(config_file):
    return {}
  with open(config_file) as f:
    config = json.load(f)
  out = {}
  for key in ("eos_token", "pad_token", "unk_token"):
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...}
      value = value.get("content")
    if isinstance(value, str):
      out[key] = value
  return out


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
_UNK_CANDIDATES = ("<unk>", "[UNK]", "<|unk|>")


class HfTokenizerVocabulary(seqio.Vocabulary):
  """A Hugging Face `tokenizers` `tokenizer.json` as a `seqio.Vocabulary`.

  Special tokens come from the arguments, else from a `tokenizer_config.json` next to the
  file, else from common names (`<|endoftext|>`, `</s>`, ...). Without a pad token, pad is
  eos (so padding never collides with a real text token). Encoding adds no special tokens
  (no BOS); decoding drops eos and pad ids and keeps everything else, protocol tags
  included.
  """

  def __init__(self, tokenizer_file: str, eos_token: str | None = None,
               pad_token: str | None = None, unk_token: str | None = None,
               extra_ids: int = 0):
    if not os.path.exists(tokenizer_file):
      raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file}")
    self._tokenizer_file = tokenizer_file
    self._tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
    config = _special_tokens_from_config(tokenizer_file)
    self._eos_token = eos_token or config.get("eos_token") or self._first_known(_EOS_CANDIDATES)
    if self._eos_token is None or self._tokenizer.token_to_id(self._eos_token) is None:
      raise ValueError(f"{tokenizer_file}: no end-of-sequence token found "
                       f"(tried {self._eos_token or _EOS_CANDIDATES}); pass eos_token=")
    self._pad_token = pad_token or config.get("pad_token") or self._eos_token
    if self._tokenizer.token_to_id(self._pad_token) is None:
      raise ValueError(f"{tokenizer_file}: pad token {self._pad_token!r} is not in the vocab")
    self._unk_token = unk_token or config.get("unk_token") or self._first_known(
        _UNK_CANDIDATES)
    super().__init__(extra_ids=extra_ids)

  def _first_known(self, candidates: Sequence[str]) -> str | None:
    for token in candidates:
      if self._tokenizer.token_to_id(token) is not None:
        return token
    return None

  @property
  def tokenizer(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._tokenizer

  @property
  def eos_id(self) -> int:
    return self._tokenizer.token_to_id(self._eos_token)

  @property
  def pad_id(self) -> int:
    return self._tokenizer.token_to_id(self._pad_token)

  @property
  def unk_id(self) -> int | None:
    if self._unk_token is None:
      return None
    return self._tokenizer.token_to_id(self._unk_token)

  @property
  def bos_id(self) -> int | None:
    return None

  @property
  def _base_vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  def _encode(self, s: str) -> list[int]:
    return self._tokenizer.encode(s, add_special_tokens=False).ids

  def _decode(self, ids: Iterable[int]) -> str:
    drop = {self.eos_id, self.pad_id}
    return self._tokenizer.decode([int(i) for i in ids if int(i) not in drop],
                                  skip_special_tokens=False)

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    """str[] -> int32[L], or str[B] -> int32 ragged [B, None]."""
    def encode_flat(strings):
      texts = np.asarray(strings.numpy(), dtype=object).reshape(-1)
      batch = [self._encode(x.decode("utf-8")) for x in texts]
      lengths = np.array([len(b) for b in batch], np.int64)
      flat = np.array([i for b in batch for i in b], np.int32)
      return flat, lengths

    flat, lengths = tf.py_function(encode_flat, [s], (tf.int32, tf.int64))
    flat.set_shape([None])
    if s.shape.rank == 0:
      return flat
    return tf.RaggedTensor.from_row_lengths(flat, lengths)

  def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    """int[..., T] -> str[...]."""
    def decode_rows(rows):
      rows = rows.numpy()
      texts = [self._decode(r) for r in rows.reshape(-1, rows.shape[-1])]
      return np.array(texts, dtype=object).reshape(rows.shape[:-1])

    out = tf.py_function(decode_rows, [ids], tf.string)
    out.set_shape(ids.shape[:-1])
    return out

  def __eq__(self, other) -> bool:
    return (isinstance(other, HfTokenizerVocabulary)
            and self._tokenizer_file == other._tokenizer_file
            and (self._eos_token, self._pad_token, self._unk_token, self.extra_ids)
            == (other._eos_token, other._pad_token, other._unk_token, other.extra_ids))

  def __hash__(self) -> int:
    return hash((self._tokenizer_file, self._eos_token, self._pad_token, self._unk_token))

  def __str__(self) -> str:
    return (f"HfTokenizerVocabulary(file={self._tokenizer_file}, vocab_size={self.vocab_size},"
            f" eos_id={self.eos_id}, pad_id={self.pad_id}, unk_id={self.unk_id})")


def whitespace_ids(vocab: seqio.Vocabulary) -> tuple[int, ...]:
  """Ids whose text is empty or whitespace (SentencePiece's lone word-start piece, control
  ids): dropped when answers are compared token by token."""
  return tuple(i for i in range(vocab.vocab_size) if not vocab.decode([i]).strip())


def non_term_ids(vocab: seqio.Vocabulary) -> tuple[int, ...]:
  """Ids that are not search terms: whitespace-only and control pieces and the protocol
  tags (the `ignore_ids` of a `BM25Index` over this vocabulary)."""
  tags = {i for ids in tag_ids(vocab).values() for i in ids}
  return tuple(sorted(set(whitespace_ids(vocab)) | tags))
