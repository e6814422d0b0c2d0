"""DiT features for diagnostics (models.dit_features) and `python -m imba.training.diagnose` on a tiny export."""

import json

import pytest
import torch

from imba.objectives import build_objective
from imba.training.diagnose import main, probe_labels, prompt_groups
from imba.training.sample import SampleError
from models.dit import build_transformer, predict
from models.dit_features import block_features, prompt_features
from models.pipeline import build_pipeline, export_pipeline
from models.text_encoder import load_text_encoder
from models.vae import load_vae

COLOURS, SHAPES = ("red", "blue", "green", "yellow"), ("circle", "square", "triangle")


def tiny_transformer(sample_size=4):
    torch.manual_seed(0)
    return build_transformer("micro", sample_size=sample_size, caption_channels=16, in_channels=3,
                             patch_size=2).eval()


def captions(n, length=5, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, length)
    mask[0, 3:] = 0
    return torch.randn(n, length, dim, generator=g), mask


def test_block_features_pool_over_the_masked_tokens_only():
    model = tiny_transformer()
    embeds, mask = captions(3)
    noisy = torch.randn(3, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([10.0, 500.0, 900.0])
    outputs = []  # an independent record of what each block returns
    handles = [b.register_forward_hook(lambda m, i, o: outputs.append(o.detach())) for b in model.transformer_blocks]
    with torch.no_grad():
        predict(model, noisy, t, embeds, mask, 1)
    for h in handles:
        h.remove()
    tokens = torch.zeros(3, 4)
    tokens[:, [0, 2]] = 1  # the left column of the 2 × 2 patch grid
    half = block_features(model, noisy, t, embeds, mask, 1, token_mask=tokens)
    assert len(half) == len(outputs) == 4
    for got, hidden in zip(half, outputs):
        assert torch.allclose(got, hidden[:, [0, 2]].mean(dim=1), atol=1e-6)
    with pytest.raises(ValueError, match="token_mask"):
        block_features(model, noisy, t, embeds, mask, 1, token_mask=torch.ones(3, 5))


def test_prompt_features_share_the_noise_draws_across_captions():
    model = tiny_transformer()
    embeds, mask = captions(3)
    embeds[2], mask[2] = embeds[1], mask[1]  # captions 1 and 2 are the same
    blocks, text = prompt_features(model, embeds, mask, (3, 4, 4), 900, draws=2, seed=5, batch_size=4,
                                   vae_scale_factor=1)
    assert len(blocks) == 4 and blocks[0].shape == (6, model.config.num_attention_heads * 32)
    assert text.shape == (6, 16)
    # rows are caption × draws + draw: same caption and draw → same row; another draw → another row. Rows 2 and 4
    # come from batches of other sizes (4 and 2), so they agree up to float32 rounding of the features' scale
    # (atol 1e-5 of the largest feature, ~100 roundings); another draw or caption is off by a large part of it
    for b in blocks:
        atol = 1e-5 * b.abs().max().item()
        assert torch.allclose(b[2], b[4], atol=atol) and torch.allclose(b[3], b[5], atol=atol)
        assert not torch.allclose(b[2], b[3])
    # the caption features are the mean over valid tokens, repeated per draw
    assert torch.allclose(text[0], embeds[0, :3].mean(dim=0)) and torch.equal(text[0], text[1])
    # the batch size does not change the features
    again, _ = prompt_features(model, embeds, mask, (3, 4, 4), 900, draws=2, seed=5, batch_size=1,
                               vae_scale_factor=1)
    assert all(torch.allclose(a, b, atol=1e-5 * b.abs().max().item()) for a, b in zip(blocks, again))  # as above


def test_prompt_entries_give_buckets_seen_flags_and_probe_labels():
    entries = [{"prompt": "a", "bucket": "head", "labels": {"colour": "red", "shape": "circle"}},
               {"prompt": "b", "buckets": ["head", "tail"], "labels": {"colour": "blue"}},
               {"prompt": "c", "bucket": "held_out", "labels": {"colour": "red"}},
               {"prompt": "d", "bucket": "tail", "seen": False, "labels": {"colour": "green"}}]
    assert prompt_groups(entries) == (["head", "tail", "held_out", "tail"], [True, True, False, False])
    assert probe_labels(entries) == {"colour": ["red", "blue", "red", "green"]}  # only what every entry names
    pairs = [{"prompt": "a red car", "pairs": [["red", "car"]]}, {"prompt": "a blue bus", "pairs": [["blue", "bus"]]}]
    assert probe_labels(pairs) == {"attribute": ["red", "blue"], "object": ["car", "bus"]}
    assert prompt_groups([{"prompt": "x"}]) == (["unknown"], [True])


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    tokenizer, t5 = load_text_encoder("tiny")
    torch.manual_seed(0)
    transformer = build_transformer("tiny", sample_size=4, caption_channels=64).eval()
    export_pipeline(build_pipeline(transformer, load_vae("tiny"), t5, tokenizer,
                                   build_objective("flow").sampling_scheduler()), folder)
    return folder


def probe_file(path, held_out=True):
    rows = []
    for i, c in enumerate(COLOURS):
        for j, s in enumerate(SHAPES):
            bucket = "held_out" if held_out and (i + j) % 4 == 3 else ("head", "torso", "tail")[(i + 2 * j) % 3]
            rows.append({"prompt": f"a {c} {s}", "bucket": bucket, "labels": {"colour": c, "shape": s}})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_the_command_writes_alignment_and_probes_per_block_and_bucket(export_dir, tmp_path, capsys):
    prompts = probe_file(tmp_path / "probes.jsonl")
    out = tmp_path / "diag"
    argv = [str(export_dir), "--prompts", str(prompts), "--out", str(out), "--draws", "3", "--k", "5",
            "--max-text-tokens", "16"]
    assert main(argv) == 0
    result = json.loads((out / "diagnostics.json").read_text())
    assert result["prompts"] == 12 and result["rows"] == 12 * 3
    held = sum((i + j) % 4 == 3 for i in range(4) for j in range(3))
    assert result["groups"]["held_out"] == held and sum(result["groups"].values()) == 12
    assert len(result["blocks"]) == 6  # the tiny preset's blocks
    for block in result["blocks"]:
        assert 0 <= block["cka"]["all"] <= 1 and 0 <= block["mutual_knn"]["all"] <= 1
        assert set(block["probe"]) == {"colour", "shape"}
        probe = block["probe"]["colour"]
        assert probe["ood_samples"] == 3 * held and set(probe["by_group"]) <= {"head", "torso", "tail", "held_out"}
        assert probe["by_group"]["held_out"] == probe["ood_accuracy"]
    assert result["settings"]["probes"]["colour"] == sorted(COLOURS)
    assert (out / "diagnostics.png").stat().st_size > 5000
    assert "colour probe ID" in capsys.readouterr().out
    first = (out / "diagnostics.json").read_text()
    assert main(argv) == 0 and (out / "diagnostics.json").read_text() == first  # deterministic

    # without held-out prompts there is nothing to score a probe out of distribution on: alignment only
    assert main([str(export_dir), "--prompts", str(probe_file(tmp_path / "seen.jsonl", held_out=False)), "--out",
                 str(tmp_path / "seen"), "--draws", "2", "--k", "3", "--max-text-tokens", "16"]) == 0
    result = json.loads((tmp_path / "seen" / "diagnostics.json").read_text())
    assert all(b["probe"] == {} for b in result["blocks"]) and "unseen" in result["settings"]["skipped"][0]
    with pytest.raises(SampleError, match="not found"):
        main([str(tmp_path / "nowhere"), "--prompts", str(prompts), "--out", str(tmp_path / "x")])
