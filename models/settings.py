"""The `model` and `speed` sections of the training config, with the DiT presets and the names of what they choose.

This module names things; the modules that build them resolve the names (`dit.py` the presets and attention
processors, `encoders.py` the dtypes, `pipeline.py` the pipeline classes), so reading and checking a config imports
neither torch nor diffusers from here.

A config section is a dataclass whose fields are its keys (`model.<field>`), with two class tables beside them,
read by `imba.training.config`: CHOICES (field -> the values it takes) and RANGES (field -> the numbers it takes,
written as the error message shows them: ">= 1", "> 0", "in [0, 1)", then optionally " (what a bound means)").
A section with checks across its fields has `check()`, which raises a one-line ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class DiTPreset:
    num_layers: int
    num_attention_heads: int
    attention_head_dim: int

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# Named widths and depths (model.preset); the sample size and caption width come from the VAE and text encoder.
PRESETS: dict[str, DiTPreset] = {
    # The composition benchmark's pixel-space model (bench/composition.py): ~0.7M parameters, seconds per 10 steps.
    "micro": DiTPreset(num_layers=4, num_attention_heads=3, attention_head_dim=32),
    # CPU smoke tests and the default run: ~3.7M parameters with a 64-d tiny T5.
    "tiny": DiTPreset(num_layers=6, num_attention_heads=6, attention_head_dim=32),
    # DiT-S/2 and DiT-B/2 widths.
    "small": DiTPreset(num_layers=12, num_attention_heads=6, attention_head_dim=64),
    "base": DiTPreset(num_layers=12, num_attention_heads=12, attention_head_dim=64),
    # 28 blocks like PixArt-XL/2, widened to 1472 so the model is 1.0B parameters with 4096-d T5 conditioning.
    # 23 heads of 64 rather than 16 of 92: head dims that are multiples of 8 keep fused SDPA kernels available.
    "1b": DiTPreset(num_layers=28, num_attention_heads=23, attention_head_dim=64),
}

AUTO = "auto"
TINY, TINY_WORDS = "tiny", "tiny-words"  # the code's own random text encoders (models.text_encoder)
SHAPES_VAE, TINY_VAE = "shapes", "tiny"  # the code's own VAEs (models.vae)
DEFAULT_TEXT_TOKENS = {TINY_WORDS: 16, TINY: 64}  # model.max_text_tokens=0 for them
T5_TEXT_TOKENS = 120  # model.max_text_tokens=0 for any other text encoder: PixArt-α's

ENCODER_DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes the frozen T5 and VAE may run in
PIPELINE_CLASSES = {"alpha": "PixArtAlphaPipeline", "sigma": "PixArtSigmaPipeline"}  # diffusers' stock pipelines
# diffusers attention processors: torch's scaled_dot_product_attention (flash / memory-efficient kernels on GPU),
# and the explicit softmax(QKᵀ)V, a reference and for debugging
ATTENTION_PROCESSORS = {"sdpa": "AttnProcessor2_0", "eager": "AttnProcessor"}


@dataclass
class ModelConfig:
    preset: str = "micro"  # a key of models.dit.PRESETS (micro, tiny, small, base, 1b); ignored when pretrained is set
    pretrained: str | None = None  # fine-tune: a diffusers PixArt transformer (hub id or folder, e.g. an export)
    pretrained_subfolder: str = ""  # "transformer" for pipeline repositories (auto-detected for local folders)
    # the stock pipeline of the grids and the export: alpha (PixArtAlphaPipeline) | sigma (PixArtSigmaPipeline) |
    # auto (the one model.pretrained's model_index.json names, else alpha); sigma for PixArt-Σ transformer-only
    # repositories (PixArt-Sigma-XL-2-256x256, -512-MS, -2K-MS)
    pipeline: str = "auto"
    # a hub id (google/t5-v1_1-xxl) or a local folder; "tiny-words" (a random tiny T5 with one token per word of the
    # synthetic shapes) or "tiny" (a random tiny T5 over bytes: reads any text); auto = tiny-words on the synthetic
    # set, tiny on your own data
    text_encoder: str = "auto"
    text_encoder_subfolder: str = ""  # e.g. "text_encoder" inside a PixArt repository
    tokenizer_subfolder: str = ""  # e.g. "tokenizer" inside a PixArt repository
    # the text encoder's sequence length; 0 = its own: 16 for tiny-words (the synthetic captions are at most 8
    # words), 64 for tiny (bytes: about 12 words), 120 for a T5 (PixArt-α's; PixArt-Σ uses 300)
    max_text_tokens: int = 0
    # "shapes" (the small VAE trained on the synthetic shapes, shipped with the code), "tiny" (random, for tests),
    # a hub id (stabilityai/sd-vae-ft-ema) or a local folder
    vae: str = "shapes"
    vae_subfolder: str = ""
    encoder_dtype: str = "float32"  # of the frozen T5 and VAE: float32 | bfloat16 (float16: refused, T5 overflows)
    # LoRA fine-tuning (peft) of model.pretrained: 0 trains every weight; r > 0 freezes the DiT and trains rank-r
    # adapters on the linear layers lora_targets names; the export holds the merged weights and the adapters (lora/)
    lora_rank: int = 0
    lora_alpha: float = 0.0  # the adapters' scale is lora_alpha / lora_rank; 0 = lora_rank (scale 1)
    lora_targets: str = "to_q,to_k,to_v,to_out.0"  # comma-separated suffixes of the linear layers' names

    CHOICES: ClassVar[dict] = {"preset": tuple(PRESETS), "encoder_dtype": ENCODER_DTYPES,
                               "pipeline": ("auto", *PIPELINE_CLASSES)}
    RANGES: ClassVar[dict] = {"max_text_tokens": ">= 0 (0 = the text encoder's own)",
                              "lora_rank": ">= 0 (0 = no LoRA: every weight trains)",
                              "lora_alpha": ">= 0 (0 = lora_rank)"}

    def check(self) -> None:
        if self.encoder_dtype == "float16":  # every text encoder here is a T5 (models.text_encoder)
            raise ValueError("model.encoder_dtype=float16 runs the T5 text encoder in float16, where T5 v1.1 "
                             "overflows (inf or clamped text states): set model.encoder_dtype=bfloat16 (or float32)")
        if self.lora_rank and not self.pretrained:
            raise ValueError("model.lora_rank needs model.pretrained: LoRA adapts trained weights (an export of a "
                             "run, or a PixArt transformer)")
        if self.lora_rank and not self.lora_target_list():
            raise ValueError("model.lora_targets names no layer: give comma-separated suffixes of linear layers' "
                             "names, e.g. to_q,to_k,to_v,to_out.0")

    def lora_target_list(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]

    def resolve(self, synthetic_data: bool) -> None:
        """Fill in the automatic values: text_encoder=auto and max_text_tokens=0 (`synthetic_data`: the run trains on
        the synthetic set, whose every word the word-level tokenizer knows)."""
        if self.text_encoder == AUTO:
            self.text_encoder = TINY_WORDS if synthetic_data else TINY
        if self.max_text_tokens == 0:
            self.max_text_tokens = DEFAULT_TEXT_TOKENS.get(self.text_encoder, T5_TEXT_TOKENS)

    def encoders(self) -> dict:
        """What decides the frozen encoders' outputs, as keywords of `FrozenEncoders.load`, `PrecomputeSettings` and
        the precompute manifest (`data.precomputed.find_manifest`)."""
        return dict(text_encoder=self.text_encoder, text_encoder_subfolder=self.text_encoder_subfolder,
                    tokenizer_subfolder=self.tokenizer_subfolder, vae=self.vae, vae_subfolder=self.vae_subfolder,
                    max_text_tokens=self.max_text_tokens)


@dataclass
class SpeedConfig:
    attention: str = "sdpa"  # sdpa (torch scaled_dot_product_attention) | eager
    gradient_checkpointing: bool = False  # recompute block activations in backward: less memory, ~30 % more compute
    compile: bool = False  # torch.compile the DiT (first steps are slow while it compiles)
    tf32: bool = True  # TF32 matmuls/convolutions on Ampere+ GPUs (no effect on CPU)

    CHOICES: ClassVar[dict] = {"attention": tuple(ATTENTION_PROCESSORS)}
