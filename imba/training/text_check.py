"""Whether the run's text encoder can read its captions, judged before any long work.

A text encoder that turns most words of a caption into its unknown token trains a nearly unconditional model
without a sign in the loss: the word-level `tiny-words` encoder knows only the synthetic set's words. Read from the
first `SAMPLE` captions of each training source (shard order; shards on object storage read through the run's
shard cache), with the run's tokenizer alone:

- more than `REFUSE_UNKNOWN` of their tokens unknown: refused with one line naming the encoder and what to set;
- more than `WARN_UNKNOWN`: a warning with the words it cannot read;
- more than `WARN_TRUNCATED` of the captions longer than model.max_text_tokens (special tokens counted): a
  warning, since their ends never reach the model.
"""

from __future__ import annotations

import logging
from itertools import islice

from accelerate import Accelerator

from data.concepts.captions import iter_shard_captions
from data.remote import ShardCache, StoreUnreachable
from data.sources import Source
from data.synthetic import CAPTION_WORDS
from imba.training.config import Config, ConfigError
from models.settings import TINY
from models.text_encoder import CaptionReading, load_tokenizer, read_captions

log = logging.getLogger(__name__)

# what a token is where it is not a T5 word piece (about 0.8 of a word): the `tiny` encoder reads bytes
BYTE_TOKENS = {TINY: " (tiny reads bytes: a token is a character, about a fifth of a word)"}
SAMPLE = 256  # captions read per source
REFUSE_UNKNOWN = 0.5  # share of unknown tokens that refuses the run
WARN_UNKNOWN = 0.05
WARN_TRUNCATED = 0.25  # share of captions cut short that warns


def sample_captions(sources: list[Source] | list[list[str]], caption_field: str,
                    per_source: int = SAMPLE, cache: ShardCache | None = None) -> list[str]:
    """The first `per_source` captions of each source (a `Source`, or a list of shard URLs), its shards in order, no
    image read; a shard on object storage from its copy in `cache` (downloaded there first, as the reader would)."""
    def captions(urls: list[str]):
        for url in urls:  # a shard the store does not give is skipped here, as the reader will
            try:
                yield from iter_shard_captions(url, caption_field, cache=cache)
            except StoreUnreachable as exn:  # the reader decides: its complete cached copies, or the store's line
                log.warning("the caption check skips %s: %s", url, exn)

    return [caption for source in sources
            for caption in islice(captions(source.urls if isinstance(source, Source) else source), per_source)]


def judge(reading: CaptionReading, text_encoder: str, max_text_tokens: int) -> tuple[str | None, list[str]]:
    """(the refusal or None, the warnings) for what `read_captions` found with `text_encoder`."""
    unknown = (f"model.text_encoder={text_encoder} reads {reading.unknown:,} of the {reading.tokens:,} tokens of "
               f"{reading.captions} captions as unknown ({reading.unknown_share:.0%}"
               + (f"; e.g. {', '.join(map(repr, reading.unknown_words[:5]))})" if reading.unknown_words else ")"))
    fix = ("set model.text_encoder to a T5 (google/t5-v1_1-xxl, or a local folder) or to tiny (a random T5 over "
           "bytes: reads any text)")
    refusal = f"{unknown}: {fix}" if reading.unknown_share > REFUSE_UNKNOWN else None
    warnings = []
    if refusal is None and reading.unknown_share > WARN_UNKNOWN:
        warnings.append(f"warning: {unknown}; to read them, {fix}")
    if reading.captions and reading.truncated / reading.captions > WARN_TRUNCATED:
        warnings.append(f"warning: {reading.truncated} of {reading.captions} captions are longer than "
                        f"model.max_text_tokens={max_text_tokens} tokens{BYTE_TOKENS.get(text_encoder, '')} (the "
                        f"longest {reading.longest}): their ends never reach the model; raise model.max_text_tokens")
    return refusal, warnings


def check_captions_readable(cfg: Config, accelerator: Accelerator, sources: list[Source]) -> None:
    """Refuse (`ConfigError`) or warn, by the rules above, on every rank alike (each reads the same captions)."""
    captions = sample_captions(sources, cfg.data.caption_field, cache=cfg.data.cache())
    if not captions:  # e.g. precomputed shards without their captions: nothing to judge
        return
    m = cfg.model
    try:
        tokenizer = load_tokenizer(m.text_encoder, m.tokenizer_subfolder, words=CAPTION_WORDS)
    except OSError as err:
        raise ConfigError(str(err)) from err
    refusal, warnings = judge(read_captions(tokenizer, captions, m.max_text_tokens), m.text_encoder,
                              m.max_text_tokens)
    if refusal:
        raise ConfigError(refusal)
    for line in warnings:
        accelerator.print(line)
