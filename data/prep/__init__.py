"""The offline data tools: commands run by hand before (or beside) training, which a run never imports.

    python -m data.prep.writers folder|table SRC OUT ...    images or a table -> checked tar shards and their index
    python -m data.prep.precompute SHARDS OUT --resolution R ...    the shards -> VAE latents and T5 states
    python -m data.prep.concepts [stats] --shards SPEC --out DIR    concept statistics of the captions
    python -m data.prep.concepts build-benchmark --stats concepts.json --out prompts.json

  writers     the shard writers (folder or table -> img2dataset-layout shards)
  precompute  the command line of `data.precompute.precompute_shards` (the job itself is run-time: a run with
              `data.precompute=true` encodes its own shards with it)
  concepts    the command line of the concept statistics (`data.concepts`, which a run reads back)
  benchmark   the inert-concept composition prompts built from concepts.json

They import the run-time modules of data/; no run-time module imports them (the "prep" contract of
[tool.importlinter] in pyproject.toml).
"""
