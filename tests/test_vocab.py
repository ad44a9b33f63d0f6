"""Vocabularies: SentencePiece with single-token protocol tags; the HF tokenizers adapter."""

import json

import pytest
import tensorflow as tf
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from pbsd_jax import protocol
from pbsd_jax.data import vocab as vocab_lib

_ACTION = "<think> I need the employer of Velora Quint. </think><search> Velora Quint </search>"


@pytest.fixture(scope="module")
def sp_vocab(kg):
  return kg.vocab


def test_protocol_tags_are_single_distinct_sentencepiece_tokens(sp_vocab):
  ids = vocab_lib.tag_ids(sp_vocab)
  assert set(ids) == set(protocol.TAGS)
  assert all(len(v) == 1 for v in ids.values())
  flat = [ids[tag][0] for tag in protocol.TAGS]
  assert flat == list(range(3, 11))
  assert len(set(flat)) == len(flat)
  assert not {sp_vocab.pad_id, sp_vocab.eos_id, sp_vocab.unk_id} & set(flat)
  assert sp_vocab.decode(flat) == "".join(protocol.TAGS)


def test_tags_stay_single_tokens_inside_an_action(sp_vocab):
  ids = vocab_lib.tag_ids(sp_vocab)
  encoded = sp_vocab.encode(_ACTION)
  for tag in (protocol.THINK_OPEN, protocol.THINK_CLOSE, protocol.SEARCH_OPEN,
              protocol.SEARCH_CLOSE):
    assert encoded.count(ids[tag][0]) == 1


def test_sentencepiece_special_ids(sp_vocab):
  assert (sp_vocab.pad_id, sp_vocab.eos_id, sp_vocab.unk_id) == (0, 1, 2)
  assert sp_vocab.vocab_size == 2048


def test_sentencepiece_round_trips_actions_documents_and_unseen_text(sp_vocab, kg):
  texts = [a for r in kg.records("sft")[:300] for a in r["actions"]]
  texts += [d["contents"].replace("\n", " ") for d in kg.corpus]
  texts.append("Ünïcode & symbols {never} seen ~ 42")
  for text in texts:
    ids = sp_vocab.encode(text)
    assert sp_vocab.unk_id not in ids
    assert sp_vocab.decode(ids) == text


def test_query_tokens_in_an_action_equal_the_tokens_of_the_name(sp_vocab):
  # The space after <search> gives the first word its word-initial piece, as in the corpus.
  ids = sp_vocab.encode(_ACTION)
  tags = vocab_lib.tag_ids(sp_vocab)
  start = ids.index(tags[protocol.SEARCH_OPEN][0]) + 1
  end = ids.index(tags[protocol.SEARCH_CLOSE][0])
  query = [i for i in ids[start:end] if sp_vocab.decode([i]).strip()]
  assert query == list(sp_vocab.encode("Velora Quint"))


def test_same_texts_give_byte_identical_models(tmp_path):
  texts = ["alpha beta gamma delta", "<think> beta </think><search> gamma </search>"] * 50
  (tmp_path / "x").mkdir()
  (tmp_path / "y").mkdir()
  a = vocab_lib.train_sentencepiece(texts, str(tmp_path / "x" / "spm"), 400)
  b = vocab_lib.train_sentencepiece(texts, str(tmp_path / "y" / "spm"), 400)
  with open(a, "rb") as fa, open(b, "rb") as fb:
    assert fa.read() == fb.read()


def test_too_small_vocab_size_is_rejected(tmp_path):
  with pytest.raises(ValueError, match="vocab_size"):
    vocab_lib.train_sentencepiece(["a b c"], str(tmp_path / "m"), 100)


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory, kg):
  """A tiny byte-level BPE tokenizer trained on the corpus, with `<|endoftext|>` only."""
  texts = [d["contents"] for d in kg.corpus]
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=500, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  path = str(tmp_path_factory.mktemp("hf") / "tokenizer.json")
  tokenizer.save(path)
  return path


def test_hf_vocabulary_round_trips_text_exactly(hf_file):
  vocab = vocab_lib.HfTokenizerVocabulary(hf_file)
  for text in (_ACTION, "Question: Where was X born?\n", "  two  spaces\nand Ünïcode"):
    assert vocab.decode(vocab.encode(text)) == text


def test_hf_tags_may_be_several_tokens_that_decode_back(hf_file):
  vocab = vocab_lib.HfTokenizerVocabulary(hf_file)
  ids = vocab_lib.tag_ids(vocab)
  assert any(len(v) > 1 for v in ids.values())
  for tag, tag_tokens in ids.items():
    assert vocab.decode(tag_tokens) == tag


def test_hf_special_ids_default_to_endoftext(hf_file):
  vocab = vocab_lib.HfTokenizerVocabulary(hf_file)
  eos = vocab.tokenizer.token_to_id("<|endoftext|>")
  assert (vocab.eos_id, vocab.pad_id, vocab.unk_id, vocab.bos_id) == (eos, eos, None, None)
  assert vocab.vocab_size == vocab.tokenizer.get_vocab_size(with_added_tokens=True)


def test_hf_decode_stops_at_eos_and_drops_it(hf_file):
  vocab = vocab_lib.HfTokenizerVocabulary(hf_file)
  ids = list(vocab.encode("first part")) + [vocab.eos_id] + list(vocab.encode("never"))
  assert vocab.decode(ids) == "first part"


def test_hf_tf_encode_and_decode_agree_with_python(hf_file):
  vocab = vocab_lib.HfTokenizerVocabulary(hf_file)
  texts = [_ACTION, "short"]
  assert vocab.encode_tf(tf.constant(texts[0])).numpy().tolist() == vocab.encode(texts[0])
  batch = vocab.encode_tf(tf.constant(texts))
  assert batch.to_list() == [vocab.encode(t) for t in texts]
  ids = vocab.encode(texts[0])
  assert vocab.decode_tf(tf.constant(ids)).numpy().decode() == texts[0]
  ab = list(vocab.encode("ab"))
  batch_ids = tf.constant([ab + [vocab.eos_id, 7], ab + [7, 7]])
  assert vocab.decode_tf(batch_ids).numpy().tolist() == [
      b"ab", vocab.decode(ab + [7, 7]).encode()]


def test_hf_special_tokens_are_read_from_tokenizer_config(hf_file, tmp_path):
  tokenizer = tokenizers.Tokenizer.from_file(hf_file)
  tokenizer.add_special_tokens(["<|im_end|>", "<pad>"])
  tokenizer.save(str(tmp_path / "tokenizer.json"))
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": {"content": "<pad>"}}, f)
  vocab = vocab_lib.HfTokenizerVocabulary(str(tmp_path / "tokenizer.json"))
  assert vocab.eos_id == tokenizer.token_to_id("<|im_end|>")
  assert vocab.pad_id == tokenizer.token_to_id("<pad>")


def test_hf_without_an_eos_token_fails_naming_the_file(tmp_path):
  tokenizer = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
  path = str(tmp_path / "tokenizer.json")
  tokenizer.save(path)
  with pytest.raises(ValueError, match="tokenizer.json: no end-of-sequence token"):
    vocab_lib.HfTokenizerVocabulary(path)


def test_load_vocabulary_dispatches_on_the_file_type(kg, hf_file):
  sp = vocab_lib.load_vocabulary(kg.paths["spm_model"])
  hf = vocab_lib.load_vocabulary(hf_file)
  assert isinstance(hf, vocab_lib.HfTokenizerVocabulary)
  assert sp.encode(_ACTION) != hf.encode(_ACTION)
  with pytest.raises(ValueError, match="unknown vocabulary file type"):
    vocab_lib.load_vocabulary("vocab.txt")
