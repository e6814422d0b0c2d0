"""Evaluation of composition: prompt sets, VQA success rate, CLIP score, and their summary tables.

    python -m imba.eval vqa  --images samples/step1200 --model llava-hf/llava-1.5-7b-hf --out vqa.jsonl
    python -m imba.eval clip --images samples/step1200 --model openai/clip-vit-large-patch14 --out clip.jsonl

`prompts` and `summary` need only the standard library (and numpy); `vqa` and `clip_score` load transformers
models. Of the rest of the project, it uses `data.text`'s English-word helpers (the articles of the prompts, which
`data.prep.benchmark` writes with the same functions) and nothing else of `data/` or `models/`: the sampler's
manifest and the benchmark JSON are the contract. Like `imba.training`, it is run from the checkout, where `data/` is;
import-linter and tests/test_layers.py check the imports.
"""
