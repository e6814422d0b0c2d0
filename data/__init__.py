"""bytes -> tensors: shard reading, image transforms, writers, precompute, synthetic data, concept statistics.

Never imports imba or train; only the precompute command imports models (it runs the frozen VAE and T5), to which
it passes the synthetic captions' words as the tiny-words tokenizer's vocabulary.
"""

from .buckets import assign_buckets, bucket_sizes, nearest_bucket, resize_to_bucket
from .decode import sample_caption
from .images import IMAGE_EXTENSIONS, image_to_tensor, resize_center_crop, to_rgb
from .index import ShardIndex, load_or_build_index
from .indexed import IndexedLoader, IndexedShards, make_indexed_loader
from .order import BucketBatchSampler, IndexedBatchSampler, batches_per_epoch
from .streaming import make_image_text_loader
from .synthetic import COLOURS, SAMPLE_PROMPTS, SHAPES, make_sample, write_synthetic_shards
from .urls import expand_urls

__all__ = [
    "assign_buckets",
    "bucket_sizes",
    "nearest_bucket",
    "resize_to_bucket",
    "BucketBatchSampler",
    "IndexedBatchSampler",
    "IndexedLoader",
    "IndexedShards",
    "ShardIndex",
    "batches_per_epoch",
    "load_or_build_index",
    "make_indexed_loader",
    "IMAGE_EXTENSIONS",
    "expand_urls",
    "image_to_tensor",
    "make_image_text_loader",
    "resize_center_crop",
    "sample_caption",
    "to_rgb",
    "COLOURS",
    "SAMPLE_PROMPTS",
    "SHAPES",
    "make_sample",
    "write_synthetic_shards",
]
