"""The bottom layer: what every other part of the project may use, importing nothing else of the project.

  text          English words and phrases: tokenising, plural folding, articles ("an apple", "some water")
  shapes_words  the synthetic shapes' names, head first: the synthetic set draws them, the tiny-words T5 tokenizes them
  plots         the project's figures (matplotlib), one colour per head / torso / tail bucket in all of them

Each is needed on both sides of a boundary the layers forbid crossing upwards: `data/` (the concept statistics, the
synthetic captions) and `imba/` (evaluation, the monitor plot, diagnostics), while `data/` never imports `imba` and
`imba.eval` never imports `data/`; `data/` and `models/` (the tiny-words tokenizer), while `models/` never imports
`data/`. The layers are checked by import-linter (`[tool.importlinter]` in pyproject.toml, tests/test_layers.py).
"""
