"""Frozen T5 text encoder and its tokenizer.

Real runs load T5 v1.1 XXL (4096-d) from a hub id or a local folder, e.g. `google/t5-v1_1-xxl`, or the
`text_encoder`/`tokenizer` subfolders of a PixArt repository. `"tiny"` builds a small random T5 encoder with a
byte-level tokenizer (`ByT5Tokenizer`, which needs no vocabulary file): the same classes, no download, for tests,
for any text. Its weights come from a fixed seed, so every process and every resume gets the same encoder.
`"tiny-words"` is the same random T5 over a word-level tokenizer of a closed vocabulary the caller passes (`words`:
one token per word, `<unk>` for any other), the CPU default run's with the synthetic captions' words: a shape's name
is then one vector of its own rather than a run of bytes it shares with other words. The vocabulary is an argument
because models/ imports nothing of the project; the callers that know the data pass it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast, T5Config, T5EncoderModel

from models.settings import TINY, TINY_WORDS
TINY_SEED = 1234
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2


def word_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `words` (e.g. the synthetic captions' "a red circle and an orange square"):
    lower-cased, split on whitespace and punctuation, `</s>` appended as T5 does. Ids: T5's special tokens 0-2, then
    `words` in the order given."""
    if not words:
        raise ValueError("the word-level tokenizer needs a vocabulary: pass the words of the captions")
    words = [*SPECIAL_TOKENS, *words]
    if len(set(words)) != len(words):
        raise ValueError("the word-level tokenizer's vocabulary repeats a word (or names a special token)")
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512)


def _tiny_t5(vocab_size: int) -> T5EncoderModel:
    config = T5Config(
        vocab_size=vocab_size,
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu",  # T5 v1.1 style
        is_encoder_decoder=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return T5EncoderModel(config)


def load_tokenizer(spec: str, tokenizer_subfolder: str = "", words: Sequence[str] = ()):
    """The tokenizer of `load_text_encoder(spec, ...)`, without loading the encoder's weights."""
    if spec in (TINY, TINY_WORDS):
        return ByT5Tokenizer() if spec == TINY else word_tokenizer(words)
    try:
        return AutoTokenizer.from_pretrained(spec, subfolder=tokenizer_subfolder or "")
    except OSError as err:
        raise OSError(f"cannot load the tokenizer of {spec!r} (subfolder {tokenizer_subfolder!r}): set "
                      "model.text_encoder to a local folder or a reachable hub id, or 'tiny' for tests") from err


def load_text_encoder(spec: str, subfolder: str = "", tokenizer_subfolder: str = "",
                      dtype: torch.dtype = torch.float32, words: Sequence[str] = ()):
    """(tokenizer, frozen T5EncoderModel in eval mode) from "tiny", "tiny-words", a hub id or a local path.

    `words`: the vocabulary of "tiny-words" (`word_tokenizer`), ignored by the others."""
    tokenizer = load_tokenizer(spec, tokenizer_subfolder, words)
    if spec in (TINY, TINY_WORDS):
        # ByT5: 256 bytes + 3 special tokens + 125 sentinel ids
        encoder = _tiny_t5(384 if spec == TINY else len(tokenizer)).to(dtype)
    else:
        try:
            encoder = T5EncoderModel.from_pretrained(spec, subfolder=subfolder or "", torch_dtype=dtype)
        except OSError as err:
            raise OSError(f"cannot load the text encoder from {spec!r} (subfolder {subfolder!r}): set "
                          "model.text_encoder to a local folder or a reachable hub id, or 'tiny' for tests") from err
    encoder.eval().requires_grad_(False)
    return tokenizer, encoder


@dataclass(frozen=True)
class CaptionReading:
    """How a tokenizer reads a sample of captions (`read_captions`)."""

    captions: int
    tokens: int  # the captions' tokens, special tokens left out
    unknown: int  # of those, the tokenizer's unknown token
    unknown_words: tuple[str, ...]  # the words read as unknown, most frequent first (fast tokenizers only)
    truncated: int  # captions whose tokens (special tokens included) exceed the sequence length
    longest: int  # the most tokens of one caption, special tokens included

    @property
    def unknown_share(self) -> float:
        return self.unknown / self.tokens if self.tokens else 0.0


def read_captions(tokenizer, captions: Sequence[str], max_length: int) -> CaptionReading:
    """Count what `tokenizer` cannot read of `captions` (unknown tokens) and which captions a sequence length of
    `max_length` cuts short, as `TextConditioner.encode` tokenizes them."""
    unk = tokenizer.unk_token_id
    special = set(tokenizer.all_special_ids) - {unk}  # padding, end of sequence, sentinels
    tokens = unknown = truncated = longest = 0
    words: Counter = Counter()
    for caption in captions:
        encoded = tokenizer(caption, add_special_tokens=True, return_offsets_mapping=tokenizer.is_fast)
        ids = encoded["input_ids"]
        longest, truncated = max(longest, len(ids)), truncated + (len(ids) > max_length)
        tokens += sum(i not in special for i in ids)
        positions = [k for k, i in enumerate(ids) if i == unk]
        unknown += len(positions)
        if positions and tokenizer.is_fast:
            words.update(caption[slice(*encoded["offset_mapping"][k])].lower() for k in positions)
    return CaptionReading(len(captions), tokens, unknown, tuple(w for w, _ in words.most_common()), truncated,
                          longest)


class TextConditioner:
    """Turns captions into (embeddings, attention mask) with a frozen encoder; holds the null (empty) caption.

    Put the encoder on its device before constructing: the null embedding is computed there, once.
    """

    def __init__(self, tokenizer, encoder: T5EncoderModel, max_length: int):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_length = max_length
        # Computed once through the same encoder, exactly as the pipeline encodes its negative prompt "".
        self.null_embeds, self.null_mask = self.encode([""])

    @property
    def hidden_size(self) -> int:
        return self.encoder.config.d_model

    @torch.no_grad()
    def encode(self, captions: list[str]):
        device = next(self.encoder.parameters()).device
        tokens = self.tokenizer(captions, padding="max_length", max_length=self.max_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        embeds = self.encoder(ids, attention_mask=mask)[0]
        return embeds.float(), mask  # float32 like the DiT's weights; autocast lowers it where enabled

    def null_like(self, batch_size: int):
        return self.null_embeds.expand(batch_size, -1, -1), self.null_mask.expand(batch_size, -1)

