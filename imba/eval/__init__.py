"""Evaluation of composition: prompt sets, VQA success rate, CLIP score, and their summary tables.

    python -m imba.eval vqa  --images samples/step1200 --model llava-hf/llava-1.5-7b-hf --out vqa.jsonl
    python -m imba.eval clip --images samples/step1200 --model openai/clip-vit-large-patch14 --out clip.jsonl

`prompts` and `summary` need only the standard library (and numpy); `vqa` and `clip_score` load transformers
models. Nothing here imports `models/` or `data/` (the English articles are `common.text`'s, which `data.concepts`
shares): the sampler's manifest and the benchmark JSON are the contract; import-linter checks it.
"""
