"""The word-level tokenizer's promises, token by token: lower-cased, split on whitespace and punctuation, `</s>`
appended, T5's special ids 0-2 then the words in the order given, `<unk>` for anything else."""

import pytest

from models.text_encoder import SPECIAL_TOKENS, TextConditioner, load_text_encoder, word_tokenizer

WORDS = ["a", "red", "circle", "and", "an", "orange", "square", "."]


def ids(tokenizer, text):
    return tokenizer(text).input_ids


def test_ids_are_the_special_tokens_then_the_words_in_order():
    tok = word_tokenizer(WORDS)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert [tok.convert_tokens_to_ids(w) for w in WORDS] == list(range(3, 3 + len(WORDS)))
    assert len(tok) == 3 + len(WORDS)
    assert ids(tok, "a red circle") == [3, 4, 5, 1]  # </s> appended, as T5 does


def test_capitals_read_as_the_lower_case_word_not_unknown():
    tok = word_tokenizer(WORDS)
    assert ids(tok, "A Red CIRCLE") == ids(tok, "a red circle") == [3, 4, 5, 1]
    assert ids(tok, "An ORANGE Square") == [7, 8, 9, 1]


def test_punctuation_and_whitespace_split_and_unknown_words_are_unk():
    tok = word_tokenizer(WORDS)
    assert ids(tok, "a red circle.") == [3, 4, 5, 10, 1]  # "." split off the word: a token of its own
    assert ids(tok, "  a\tred\n circle ") == [3, 4, 5, 1]
    assert ids(tok, "a blue circle, and") == [3, 2, 5, 2, 6, 1]  # "blue" and "," are not in the vocabulary
    assert ids(tok, "") == [1]


def test_a_vocabulary_that_repeats_or_is_empty_is_refused():
    with pytest.raises(ValueError, match="needs a vocabulary"):
        word_tokenizer([])
    with pytest.raises(ValueError, match="repeats"):
        word_tokenizer(["red", "blue", "red"])
    with pytest.raises(ValueError, match="repeats"):
        word_tokenizer(["red", "<unk>"])
    assert ids(word_tokenizer(["only"]), "only") == [3, 1]


def test_the_conditioner_pads_on_the_right_and_masks_exactly_the_tokens():
    tok, encoder = load_text_encoder("tiny-words", words=WORDS)
    conditioner = TextConditioner(tok, encoder, max_length=6)
    embeds, mask = conditioner.encode(["A red circle", "an orange square and a red circle"])
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]  # truncated at max_length
    assert embeds.shape == (2, 6, 64)
    tokens = tok(["A red circle"], padding="max_length", max_length=6).input_ids
    assert tokens == [[3, 4, 5, 1, 0, 0]]
    assert conditioner.null_mask.tolist() == [[1, 0, 0, 0, 0, 0]]  # the empty caption: </s> alone
