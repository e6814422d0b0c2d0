"""DiT presets, frozen encoders and the pieces that connect them, at tiny sizes and offline."""

import pytest
import torch

from models.dit import PRESETS, build_transformer, count_parameters, predict
from models.text_encoder import TextConditioner, load_text_encoder
from models.vae import encode_images, load_vae, vae_scale_factor


def test_1b_preset_is_one_billion_parameters_at_256px_with_t5_xxl():
    n = count_parameters("1b", sample_size=256 // 8, caption_channels=4096)
    assert 0.95e9 <= n <= 1.05e9, n
    assert PRESETS["1b"].num_layers == 28


def test_presets_grow_in_size():
    sizes = [count_parameters(name, sample_size=32, caption_channels=4096) for name in ("tiny", "small", "base", "1b")]
    assert sizes == sorted(sizes)
    assert count_parameters("tiny", sample_size=16, caption_channels=64) < 10e6


def test_unknown_preset_names_choices():
    with pytest.raises(ValueError, match="tiny, small, base, 1b"):
        build_transformer("huge", 16, 64)


def test_tiny_encoders_are_frozen_deterministic_and_offline():
    tok_a, t5_a = load_text_encoder("tiny")
    _, t5_b = load_text_encoder("tiny")
    assert not t5_a.training and not any(p.requires_grad for p in t5_a.parameters())
    for a, b in zip(t5_a.parameters(), t5_b.parameters()):
        assert torch.equal(a, b)
    vae = load_vae("tiny")
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    assert vae_scale_factor(vae) == 8 and vae.config.latent_channels == 4
    assert vae.config.scaling_factor == pytest.approx(0.18215)
    latents = encode_images(vae, torch.zeros(2, 3, 64, 64), generator=torch.Generator().manual_seed(0))
    assert latents.shape == (2, 4, 8, 8)


def test_missing_weights_fail_with_a_clear_message(tmp_path):
    with pytest.raises(OSError, match="model.vae"):
        load_vae(str(tmp_path / "no-such-vae"))
    with pytest.raises(OSError, match="model.text_encoder"):
        load_text_encoder(str(tmp_path / "no-such-t5"))


def test_null_embedding_matches_encoding_the_empty_caption():
    tok, t5 = load_text_encoder("tiny")
    text = TextConditioner(tok, t5, max_length=16)
    embeds, mask = text.encode(["", "a red circle"])
    torch.testing.assert_close(text.null_embeds[0], embeds[0])
    assert text.null_mask.sum() == 1  # only the end-of-sequence token is real
    assert mask[1].sum() == len("a red circle") + 1  # byte tokens + EOS
    null_embeds, null_mask = text.null_like(3)
    assert null_embeds.shape == (3, 16, 64) and null_mask.shape == (3, 16)


def test_word_level_tiny_encoder_gives_each_word_of_the_synthetic_world_one_token(tmp_path):
    from data.synthetic import CAPTION_WORDS, COLOURS, SHAPES
    from models.text_encoder import word_tokenizer

    tok, t5 = load_text_encoder("tiny-words", words=CAPTION_WORDS)
    assert not t5.training and not any(p.requires_grad for p in t5.parameters())
    assert t5.config.vocab_size == len(tok) == 3 + 3 + len(COLOURS) + len(SHAPES)
    text = TextConditioner(tok, t5, max_length=16)
    embeds, mask = text.encode(["A red circle and an orange square", "a cyan ring.", "a dog", ""])
    assert mask.sum(dim=1).tolist() == [8, 5, 3, 1]  # words (punctuation is a word) + EOS; "" is EOS only
    ids = tok(["a dog, a red ring"]).input_ids[0]
    assert ids[1] == ids[2] == tok.unk_token_id and ids[-1] == tok.eos_token_id == 1 and tok.pad_token_id == 0
    # one vector per word: a shape's name does not share tokens with another word
    words = tok([f"{c} {s}" for c in COLOURS for s in SHAPES], add_special_tokens=False).input_ids
    assert len({w[1] for w in words}) == len(SHAPES) and all(len(w) == 2 for w in words)
    torch.testing.assert_close(text.null_embeds[0], embeds[3])
    # deterministic, and the saved tokenizer loads back as the stock pipeline loads it
    _, t5_b = load_text_encoder("tiny-words", words=CAPTION_WORDS)
    assert all(torch.equal(a, b) for a, b in zip(t5.parameters(), t5_b.parameters()))
    word_tokenizer(CAPTION_WORDS).save_pretrained(tmp_path / "tokenizer")
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert again(["a red circle"]).input_ids == tok(["a red circle"]).input_ids


def test_dit_respects_the_text_attention_mask():
    """Changing embeddings at masked (padding) positions must not change the prediction."""
    torch.manual_seed(0)
    dit = build_transformer("tiny", sample_size=8, caption_channels=64).eval()
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10.0, 500.0])
    emb = torch.randn(2, 12, 64)
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[:, :5] = 1
    emb_changed = emb.clone()
    emb_changed[:, 5:] = torch.randn(2, 7, 64) * 10
    with torch.no_grad():
        out = predict(dit, x, t, emb, mask)
        out_padding_changed = predict(dit, x, t, emb_changed, mask)
        out_unmasked = predict(dit, x, t, emb_changed, torch.ones_like(mask))
    assert out.shape == (2, 4, 8, 8)
    torch.testing.assert_close(out, out_padding_changed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, out_unmasked, atol=1e-4)


def test_predict_keeps_the_mean_channels_of_learned_variance_checkpoints():
    torch.manual_seed(0)
    dit = build_transformer("tiny", sample_size=8, caption_channels=64)
    dit.register_to_config(out_channels=8)
    full = torch.nn.Linear(dit.proj_out.in_features, 2 * 2 * 8)  # patch 2 × 2, 8 output channels
    dit.proj_out = full
    dit.out_channels = 8
    args = (torch.randn(1, 4, 8, 8), torch.tensor([1.0]), torch.randn(1, 4, 64), torch.ones(1, 4))
    out = predict(dit, *args)
    assert out.shape == (1, 4, 8, 8)
    raw = dit(args[0], encoder_hidden_states=args[2], encoder_attention_mask=args[3], timestep=args[1],
              added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]
    assert raw.shape == (1, 8, 8, 8)
    # the mean is the first C channels; the last C are the learned variance, which the loss must never train
    assert torch.equal(out, raw[:, :4]) and not torch.allclose(out, raw[:, 4:])


def test_encoders_load_from_a_local_folder(tmp_path):
    """Real runs pass a hub id or a folder; a saved tiny T5/VAE stands in for T5-XXL/SD-VAE (same code path)."""
    tok, t5 = load_text_encoder("tiny")
    tok.save_pretrained(tmp_path / "repo" / "tokenizer")
    t5.save_pretrained(tmp_path / "repo" / "text_encoder")
    load_vae("tiny").save_pretrained(tmp_path / "vae")

    tok2, t5_2 = load_text_encoder(str(tmp_path / "repo"), subfolder="text_encoder", tokenizer_subfolder="tokenizer")
    assert not t5_2.training and not any(p.requires_grad for p in t5_2.parameters())
    ids = tok2(["a red circle"], return_tensors="pt").input_ids
    assert torch.equal(ids, tok(["a red circle"], return_tensors="pt").input_ids)
    torch.testing.assert_close(t5_2(ids)[0], t5(ids)[0])

    vae = load_vae(str(tmp_path / "vae"), dtype=torch.bfloat16)
    assert vae.dtype == torch.bfloat16 and not any(p.requires_grad for p in vae.parameters())
    assert encode_images(vae, torch.zeros(1, 3, 32, 32)).shape == (1, 4, 4, 4)


def test_fine_tune_from_a_pretrained_transformer_at_another_resolution(tmp_path):
    """A PixArt-α-1024-like model (learned variance, micro-conditioning at sample_size 128) saved in a pipeline
    layout loads for training at a smaller latent size with its weights intact."""
    from diffusers import PixArtTransformer2DModel

    from models.dit import load_pretrained_transformer

    torch.manual_seed(0)
    # hidden 24: the micro-conditioning embedders split the width in thirds
    source = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=8,
                                      num_layers=2, cross_attention_dim=24, caption_channels=12, sample_size=128)
    assert source.use_additional_conditions  # diffusers switches it on for sample_size 128
    source.save_pretrained(tmp_path / "repo" / "transformer")

    model = load_pretrained_transformer(str(tmp_path / "repo"), sample_size=8, caption_channels=12)
    # micro-conditioning, interpolation scale and sample_size kept: PixArtAlphaPipeline passes the image size only
    # to sample_size 128 (tests/test_pixart_configs.py samples such a fine-tune end to end)
    assert model.config.sample_size == 128 and model.use_additional_conditions
    assert model.config.interpolation_scale == 2
    for (name, a), b in zip(source.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    out = predict(model, torch.randn(2, 4, 8, 8), torch.tensor([1.0, 2.0]), torch.randn(2, 3, 12),
                  torch.ones(2, 3))
    assert out.shape == (2, 4, 8, 8)

    with pytest.raises(ValueError, match="expects 12-d text embeddings but the text encoder gives 64"):
        load_pretrained_transformer(str(tmp_path / "repo"), sample_size=8, caption_channels=64)
    with pytest.raises(ValueError, match="takes 4-channel latents but the VAE gives 16"):
        load_pretrained_transformer(str(tmp_path / "repo"), sample_size=8, caption_channels=12, in_channels=16)
    with pytest.raises(OSError, match="model.pretrained"):
        load_pretrained_transformer(str(tmp_path / "missing"), sample_size=8, caption_channels=12)
