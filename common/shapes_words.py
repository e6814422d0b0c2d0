"""The words of the synthetic shapes world: its shapes and its colours, each listed head first.

The synthetic data set (`data.synthetic`) draws its scenes and writes its captions with them, index 0 the most
frequent, and gives each colour its RGB value; the word-level tiny T5 (`model.text_encoder=tiny-words`,
`models.text_encoder.word_tokenizer`) gives each word a token, with ids in this order. The names live here, below
both, so that `models/` builds that tokenizer without importing `data/`, and `data/` reads shards without `models/`.
"""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "cross", "hexagon", "ring")
COLOURS: tuple[str, ...] = ("red", "blue", "green", "yellow", "purple", "orange", "black", "cyan")
