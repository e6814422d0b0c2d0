"""bytes -> tensors: shard reading, image transforms, precompute, synthetic data, concept statistics; `data.prep`:
the offline tools (shard writers, the precompute and concepts command lines), which a run never imports.

Never imports imba or train; only the precompute job and its command line import models (the job runs the frozen
VAE and T5, to which it passes the synthetic captions' words as the tiny-words tokenizer's vocabulary).
"""

import importlib

# name -> the submodule that defines it, imported on first use: reading a run's settings (`data.settings`, and so
# `train.py --help` and config errors) must not pay for torch and webdataset, which the readers import
_EXPORTS = {
    "buckets": ["assign_buckets", "bucket_sizes", "nearest_bucket", "resize_to_bucket"],
    "decode": ["sample_caption"],
    "images": ["IMAGE_EXTENSIONS", "image_to_tensor", "resize_center_crop", "to_rgb"],
    "index": ["ShardIndex", "load_or_build_index"],
    "indexed": ["IndexedLoader", "IndexedShards", "make_indexed_loader"],
    "order": ["BucketBatchSampler", "IndexedBatchSampler", "batches_per_epoch"],
    "streaming": ["make_image_text_loader"],
    "synthetic": ["COLOURS", "SAMPLE_PROMPTS", "SHAPES", "make_sample", "write_synthetic_shards"],
    "urls": ["expand_urls"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
