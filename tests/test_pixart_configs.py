"""Fine-tuning from the public PixArt-α/Σ configurations: each trains at its own and at another resolution, draws its
grids and exports a folder that the stock pipeline of its family samples; what diffusers cannot sample is refused
before training, in one line.

The pretrained models are random and narrow (2 layers, 2 heads of 24) but carry the keys of the Hub configs that
decide how a model is adapted and sampled: sample_size, interpolation_scale and use_additional_conditions (left
unset where the Hub's α configs leave them to diffusers' defaults), 8 output channels (learned variance), 4096-d
captions, patch 2, adaLN-single; and each repository has the layout of its Hub counterpart (a pipeline folder, or
the transformer alone). The text encoder is a random 1-layer T5 of width 4096 with the byte-level tokenizer.
"""

import json
import signal

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel
from PIL import Image
from safetensors.torch import load_file
from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

import models.pipeline
import train
from imba.training.config import ConfigError
from imba.training.export import export_checkpoint
from models.pipeline import PIPELINES, image_grid, pipeline_kind_of, sample_images
from models.vae import load_vae


# Hub name → (pipeline of the repository, None = transformer only; sample_size; interpolation_scale;
# use_additional_conditions), as in the repositories' transformer/config.json (None = key absent)
PUBLIC = {
    "PixArt-XL-2-256x256": ("alpha", 32, None, None),
    "PixArt-XL-2-512x512": ("alpha", 64, None, None),
    "PixArt-XL-2-1024-MS": ("alpha", 128, None, None),
    "PixArt-Sigma-XL-2-256x256": (None, 32, 0.5, False),
    "PixArt-Sigma-XL-2-512-MS": (None, 64, 1, False),
    "PixArt-Sigma-XL-2-1024-MS": ("sigma", 128, 2, False),
    "PixArt-Sigma-XL-2-2K-MS": (None, 256, 4, False),
}
# what diffusers makes of the keys: (interpolation scale, size micro-conditioning)
EFFECTIVE = {
    "PixArt-XL-2-256x256": (1, False),
    "PixArt-XL-2-512x512": (1, False),
    "PixArt-XL-2-1024-MS": (2, True),
    "PixArt-Sigma-XL-2-256x256": (0.5, False),
    "PixArt-Sigma-XL-2-512-MS": (1, False),
    "PixArt-Sigma-XL-2-1024-MS": (2, False),
    "PixArt-Sigma-XL-2-2K-MS": (4, False),
}
# (model, training resolution): each at its own and at another one (2K only below its own: 16k tokens on a CPU)
CASES = [
    ("PixArt-XL-2-256x256", 256), ("PixArt-XL-2-256x256", 128),
    ("PixArt-XL-2-512x512", 512), ("PixArt-XL-2-512x512", 256),
    ("PixArt-XL-2-1024-MS", 1024), ("PixArt-XL-2-1024-MS", 512),
    ("PixArt-Sigma-XL-2-256x256", 256), ("PixArt-Sigma-XL-2-256x256", 128),
    ("PixArt-Sigma-XL-2-512-MS", 512), ("PixArt-Sigma-XL-2-512-MS", 256),
    ("PixArt-Sigma-XL-2-1024-MS", 1024), ("PixArt-Sigma-XL-2-1024-MS", 256),
    ("PixArt-Sigma-XL-2-2K-MS", 256),
]
VAE_SCALE = 8
PROMPTS, GUIDANCE, STEPS = ["a red circle"], 4.5, 2  # the grids' settings


def is_sigma(name):
    return "Sigma" in name


def random_t5():
    torch.manual_seed(0)
    return T5EncoderModel(T5Config(vocab_size=384, d_model=4096, d_kv=8, d_ff=16, num_layers=1, num_heads=2,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def public_transformer(sample_size, interpolation_scale, use_additional_conditions):
    torch.manual_seed(0)
    # hidden 48: the size embedders split the width in thirds, the 2-D position embedding in quarters
    return PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=24, cross_attention_dim=48, num_layers=2, in_channels=4,
        out_channels=8, patch_size=2, caption_channels=4096, norm_type="ada_norm_single", num_embeds_ada_norm=1000,
        sample_size=sample_size, interpolation_scale=interpolation_scale,
        use_additional_conditions=use_additional_conditions)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """The text encoder and tokenizer, as in PixArt-alpha/pixart_sigma_sdxlvae_T5_diffusers (or any PixArt repo)."""
    folder = tmp_path_factory.mktemp("t5_4096")
    ByT5Tokenizer().save_pretrained(folder / "tokenizer")
    random_t5().save_pretrained(folder / "text_encoder")
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory, encoders):
    """name → a local stand-in of that Hub repository, written on first use."""
    root, made = tmp_path_factory.mktemp("hub"), {}

    def repo(name):
        if name not in made:
            kind, *keys = PUBLIC[name]
            folder = root / name
            transformer = public_transformer(*keys)
            if kind is None:
                transformer.save_pretrained(folder / "transformer")
            else:
                tokenizer = ByT5Tokenizer.from_pretrained(encoders / "tokenizer")
                t5 = T5EncoderModel.from_pretrained(encoders / "text_encoder")
                PIPELINES[kind](tokenizer=tokenizer, text_encoder=t5, vae=load_vae("tiny"), transformer=transformer,
                                scheduler=DPMSolverMultistepScheduler()).save_pretrained(folder)
            made[name] = folder
        return made[name]

    return repo


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


def run_main(argv):
    """`train.main` in this process; the accelerate state it made is reset so the next run starts from none."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        return train.main(argv)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        assert {s: signal.getsignal(s) for s in handlers} == handlers


def fine_tune_args(repo, encoders, resolution, out, synthetic, tokens=120):
    """A one-step fine-tune of `repo` at `resolution`; the text encoder from the repo, or from `encoders` for a
    transformer-only one (as PixArt-Σ 256/512/2K take theirs from pixart_sigma_sdxlvae_T5_diffusers)."""
    text = repo if (repo / "text_encoder").is_dir() else encoders
    return [f"model.pretrained={repo}", f"model.text_encoder={text}", "model.text_encoder_subfolder=text_encoder",
            "model.tokenizer_subfolder=tokenizer", f"model.max_text_tokens={tokens}", f"data.resolution={resolution}",
            "data.batch_size=1", "data.synthetic_samples=2", f"data.synthetic_dir={synthetic / str(resolution)}",
            "data.shuffle_buffer=0", "train.max_steps=1", "train.save_every=0", "train.sample_every=0",
            "train.val_every=0", "train.concept_stats=none", "train.trackers=none", "optim.warmup_steps=0",
            "optim.lr=2e-5",  # a fine-tuning rate: one AdamW step moves each weight by about this much
            f"sample.steps={STEPS}", f"sample.guidance_scale={GUIDANCE}", f"sample.prompts=[{PROMPTS[0]}]",
            f"train.output_dir={out}"]


@pytest.mark.slow
@pytest.mark.parametrize("name,resolution", CASES, ids=[f"{n}-{r}px" for n, r in CASES])
def test_a_public_configuration_fine_tunes_samples_and_exports_for_the_stock_pipeline(
        name, resolution, hub, encoders, synthetic, tmp_path, monkeypatch):
    repo, out = hub(name), tmp_path / "run"
    kind = "sigma" if is_sigma(name) else "alpha"
    tokens = 300 if kind == "sigma" else 120  # Σ's captions are 300 tokens, α's 120
    args = fine_tune_args(repo, encoders, resolution, out, synthetic, tokens)
    if PUBLIC[name][0] is None:  # a transformer-only repository names no pipeline
        args.append(f"model.pipeline={kind}")
    grid_kinds = []
    real_build = models.pipeline.build_pipeline
    monkeypatch.setattr(models.pipeline, "build_pipeline",  # what the training-time grid is drawn with
                        lambda *a, **k: grid_kinds.append(k.get("pipeline")) or real_build(*a, **k))
    assert run_main(args) == 0
    assert grid_kinds == [kind]

    export = out / "export"
    pipeline_class = PIPELINES[kind]
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == pipeline_class.__name__
    card = (export / "README.md").read_text()
    assert f"from diffusers import {pipeline_class.__name__}" in card and f"max_sequence_length={tokens}" in card
    _, pretrained_size, *_ = PUBLIC[name]
    interpolation_scale, size_conditioned = EFFECTIVE[name]
    config = json.loads((export / "transformer" / "config.json").read_text())
    assert (config["out_channels"], config["caption_channels"], config["patch_size"]) == (8, 4096, 2)
    assert config["interpolation_scale"] == interpolation_scale
    assert config["use_additional_conditions"] is size_conditioned
    # a size-conditioned model keeps sample_size 128, the only one PixArtAlphaPipeline passes sizes to
    assert config["sample_size"] == (pretrained_size if size_conditioned else resolution // VAE_SCALE)
    # it started from the pretrained weights: one small step away from them
    before = load_file(repo / "transformer" / "diffusion_pytorch_model.safetensors")
    after = load_file(export / "transformer" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k], after[k], atol=1e-4) for k in before)

    # `train.py --export` of the checkpoint writes the same folder for the same class
    again = export_checkpoint(out / "checkpoints" / "step_0000001", tmp_path / "again")
    assert json.loads((again / "model_index.json").read_text())["_class_name"] == pipeline_class.__name__
    assert json.loads((again / "transformer" / "config.json").read_text()) == config

    pipe = pipeline_class.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    # the run's last grid is what the stock pipeline draws from the export with the same settings
    images = sample_images(pipe, PROMPTS, resolution, GUIDANCE, STEPS, 0, tokens)
    grid = np.asarray(Image.open(out / "samples" / "step_0000001.png").convert("RGB"))
    assert np.array_equal(np.asarray(image_grid(images, labels=PROMPTS)), grid)
    if resolution == pretrained_size * VAE_SCALE:  # at its own resolution: the pipeline's defaults, binning on
        image = pipe(PROMPTS[0], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0)).images[0]
    else:
        image = pipe(PROMPTS[0], height=resolution, width=resolution, num_inference_steps=STEPS,
                     max_sequence_length=tokens, use_resolution_binning=False,
                     generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (resolution, resolution)


@pytest.mark.parametrize("pretrained,extra,message", [
    # Σ's pipeline passes no image size: α-1024's micro-conditioning would get None
    ("PixArt-XL-2-1024-MS", ["model.pipeline=sigma"],
     "PixArtSigmaPipeline passes no image size, so it cannot sample a transformer with size micro-conditioning "
     "(use_additional_conditions): set model.pipeline=alpha"),
    # no public model, but a possible one: micro-conditioning at a sample size α's pipeline passes no sizes to
    ("size-conditioned-512", [],
     "PixArtAlphaPipeline passes the image size only to transformers of sample_size 128, so it cannot sample this "
     "one with size micro-conditioning (use_additional_conditions) at sample_size 64"),
])
def test_what_the_stock_pipeline_cannot_sample_is_refused_before_training(pretrained, extra, message, hub, encoders,
                                                                         synthetic, tmp_path):
    if pretrained in PUBLIC:
        repo = hub(pretrained)
    else:
        repo = tmp_path / pretrained
        public_transformer(64, 1, True).save_pretrained(repo / "transformer")
    out = tmp_path / "run"
    args = fine_tune_args(repo, encoders, 256, out, synthetic)
    with pytest.raises(ConfigError) as refused:
        run_main([*args, *extra])
    assert str(refused.value) == f"model.pretrained={repo}: {message}"
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_the_pipeline_kind_is_read_from_the_pretrained_repository(hub, tmp_path):
    assert pipeline_kind_of(str(hub("PixArt-XL-2-256x256"))) == "alpha"
    sigma = hub("PixArt-Sigma-XL-2-1024-MS")
    assert pipeline_kind_of(str(sigma)) == pipeline_kind_of(str(sigma), "transformer") == "sigma"
    assert pipeline_kind_of(str(sigma / "transformer")) == "sigma"  # a transformer folder inside a pipeline folder
    assert pipeline_kind_of(str(hub("PixArt-Sigma-XL-2-512-MS"))) is None  # transformer only: model.pipeline decides
    assert pipeline_kind_of(str(tmp_path / "missing")) is None
