"""LoRA fine-tuning (model.lora_rank, models/lora.py): adapters that start at the base model, train alone, merge into
a stock transformer, export as a peft adapter folder that loads onto the base, and resume like any run."""

import subprocess
from pathlib import Path

import pytest
import torch

from imba.training.config import ConfigError, load_config
from models.dit import build_transformer, predict
from models.lora import (BASE_FILE, add_lora, base_digest, describe, has_lora, load_adapter, merged_state_dict,
                         save_adapter)
from test_train_e2e import run_train

REPO = Path(__file__).resolve().parents[1]

TARGETS = ["to_q", "to_v", "ff.net.2"]


def tiny_dit(seed: int = 0):
    torch.manual_seed(seed)
    return build_transformer("micro", 4, 8, in_channels=4)


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    noisy = torch.randn(2, 4, 4, 4, generator=g)
    timesteps = torch.tensor([10, 700])
    embeds = torch.randn(2, 5, 8, generator=g)
    mask = torch.ones(2, 5, dtype=torch.long)
    return noisy, timesteps, embeds, mask


def perturb_adapters(model, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@torch.no_grad()
def out(model):
    return predict(model.eval(), *inputs())


def test_adapters_start_at_the_base_model_and_are_all_that_trains():
    base, model = tiny_dit(), add_lora(tiny_dit(), rank=4, alpha=8, targets=TARGETS)
    assert has_lora(model) and not has_lora(base)
    assert torch.equal(out(model), out(base))  # B = 0: the first step predicts what the pretrained model does
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # every named layer of every block is adapted, and nothing else
    adapted = {n.rsplit(".lora_", 1)[0] for n in trained}
    assert adapted == {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)
                       and any(n.endswith(f".{t}") for t in TARGETS)}
    # micro at 4 × 4 latents with 8-d text: rank 4 × (96 in + 96 out) on 3 layers × 2 attentions (to_q, to_v) and
    # 1 feed-forward (ff.net.2: 384 in) per block, 4 blocks
    adapters = 4 * (2 * 2 * 4 * (96 + 96) + 4 * (384 + 96))
    total = sum(p.numel() for p in base.parameters()) + adapters
    assert describe(model) == f"{total:,} parameters, of which {adapters:,} train ({100 * adapters / total:.2f} %, LoRA)"
    assert describe(base) == f"{total - adapters:,} parameters"
    # training mode changes nothing: the adapters have no dropout
    perturb_adapters(model)
    with torch.no_grad():
        torch.testing.assert_close(predict(model.train(), *inputs()), out(model), rtol=0, atol=0)


def test_a_target_that_names_no_linear_layer_is_refused():
    with pytest.raises(ValueError, match=r"model.lora_targets \['to_qq'\] name no linear layer"):
        add_lora(tiny_dit(), rank=2, alpha=0, targets=["to_q", "to_qq"])


@pytest.mark.parametrize("alpha", [0, 3])
def test_the_merged_weights_are_a_stock_transformer_predicting_what_the_adapted_model_does(alpha):
    model = add_lora(tiny_dit(), rank=4, alpha=alpha, targets=TARGETS)
    perturb_adapters(model)
    assert not torch.allclose(out(model), out(tiny_dit()))
    stock = type(model).from_config(model.config)
    stock.load_state_dict(merged_state_dict(model))  # strict: exactly the stock model's keys
    assert not has_lora(stock)
    torch.testing.assert_close(out(stock), out(model), rtol=1e-5, atol=1e-5)
    # weights given apart from the model (the EMA's) are the ones merged
    doubled = [p.detach() * 2 if "lora_B" in n else p.detach() for n, p in model.named_parameters()]
    merged = merged_state_dict(model, doubled)
    layer = "transformer_blocks.0.attn1.to_q"
    base_w = dict(model.named_parameters())[f"{layer}.base_layer.weight"]
    delta = merged_state_dict(model)[f"{layer}.weight"] - base_w
    torch.testing.assert_close(merged[f"{layer}.weight"] - base_w, 2 * delta)


def test_the_adapter_folder_loads_onto_the_base_model_with_peft(tmp_path):
    from peft import PeftModel

    model = add_lora(tiny_dit(), rank=4, alpha=6, targets=TARGETS)
    perturb_adapters(model)
    folder = save_adapter(model, tmp_path / "export" / "lora", rank=4, alpha=6, targets=TARGETS, base="base-export")
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", BASE_FILE}
    loaded = PeftModel.from_pretrained(tiny_dit(), folder)
    torch.testing.assert_close(out(loaded.get_base_model()), out(model), rtol=1e-5, atol=1e-5)
    config = loaded.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 6, 0.0)
    assert config.base_model_name_or_path == "base-export"

    # weights given apart from the model (the EMA's) are the ones saved; a second save replaces the first
    doubled = [p.detach() * 2 if "lora_B" in n else p.detach() for n, p in model.named_parameters()]
    save_adapter(model, folder, rank=4, alpha=6, targets=TARGETS, weights=doubled)
    loaded = PeftModel.from_pretrained(tiny_dit(), folder)
    stock = type(model).from_config(model.config)
    stock.load_state_dict(merged_state_dict(model, doubled))
    torch.testing.assert_close(out(loaded.get_base_model()), out(stock), rtol=1e-5, atol=1e-5)
    assert loaded.peft_config["default"].base_model_name_or_path is None  # no base named


def test_an_adapter_loads_onto_the_base_it_was_trained_on_and_is_refused_on_other_weights(tmp_path, caplog):
    import json

    model = add_lora(tiny_dit(), rank=4, alpha=6, targets=TARGETS)
    perturb_adapters(model)
    # the EMA's weights are the ones saved, and the base's digest is taken from them too
    ema = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():  # the model's base is no longer the EMA's (`--export` rebuilt it from a rewritten folder)
        model.transformer_blocks[0].attn1.to_q.base_layer.weight.add_(1.0)
    folder = save_adapter(model, tmp_path / "lora", rank=4, alpha=6, targets=TARGETS, weights=ema,
                          base="/abs/base-export", base_subfolder="transformer")
    record = json.loads((folder / BASE_FILE).read_text())
    assert record == {"base_model_name_or_path": "/abs/base-export", "subfolder": "transformer",
                      "digest": base_digest(tiny_dit()), "dtype": "float32", "held_in": None}
    assert record["digest"].startswith("sha256:") and len(record["digest"]) == 7 + 64
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "/abs/base-export"

    # on the right base: the merged export's predictions
    loaded = load_adapter(tiny_dit(), folder)
    stock = type(model).from_config(model.config)
    stock.load_state_dict(merged_state_dict(model, ema))
    torch.testing.assert_close(out(loaded.get_base_model()), out(stock), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out(stock), out(tiny_dit()))

    # on other weights, by one entry of one tensor: refused in one line naming both digests and the source
    other = tiny_dit()
    with torch.no_grad():
        other.transformer_blocks[1].ff.net[2].bias[3] += 1e-3
    short, theirs = record["digest"][7:15], base_digest(other)[7:15]
    assert short != theirs
    with pytest.raises(ValueError) as refused:
        load_adapter(other, folder)
    assert str(refused.value) == (f"the adapter in {folder} was trained on base weights {short} (from "
                                  f"/abs/base-export, subfolder transformer); these are {theirs}: load the base it "
                                  "was trained from")
    # another preset's weights, and the right base in another dtype, are refused too
    with pytest.raises(ValueError, match="these are"):
        load_adapter(build_transformer("micro", 8, 8, in_channels=4), folder)
    with pytest.raises(ValueError, match=r"trained on float32 base weights .* these are bfloat16: load the base in "
                                         r"float32"):
        load_adapter(tiny_dit().to(torch.bfloat16), folder)

    # an adapter without the record (written by another tool) loads, with a warning that it cannot be checked
    (folder / BASE_FILE).unlink()
    with caplog.at_level("WARNING", logger="models.lora"):
        load_adapter(other, folder)
    assert "cannot be checked" in caplog.text
    with pytest.raises(FileNotFoundError, match="holds no adapter"):
        load_adapter(tiny_dit(), tmp_path)


def test_an_adapter_trained_on_a_base_held_in_bf16_loads_onto_that_base_in_float32_or_bf16(tmp_path):
    # DeepSpeed's bf16 holds the frozen base in bf16: the EMA's float32 copy of it is the base rounded
    model = add_lora(tiny_dit(), rank=4, alpha=6, targets=TARGETS)
    perturb_adapters(model)
    ema = [p.detach().to(torch.bfloat16).float() if "lora_" not in n else p.detach().clone()
           for n, p in model.named_parameters()]
    folder = save_adapter(model, tmp_path / "lora", rank=4, alpha=6, targets=TARGETS, weights=ema, base="/abs/base")
    import json

    record = json.loads((folder / BASE_FILE).read_text())
    assert (record["dtype"], record["held_in"]) == ("float32", "bfloat16")
    assert record["digest"] != base_digest(tiny_dit())  # the rounded base is not the float32 one ...
    load_adapter(tiny_dit(), folder)  # ... which loads it: rounded as the run held it, it is the same
    load_adapter(tiny_dit().to(torch.bfloat16), folder)
    other = tiny_dit()
    with torch.no_grad():
        other.transformer_blocks[1].ff.net[2].bias[3] += 0.5  # far above bf16's rounding
    with pytest.raises(ValueError, match=r"^the adapter in .* was trained on base weights [0-9a-f]{8} \(from "
                                         r"/abs/base\); these are [0-9a-f]{8}: load the base it was trained from$"):
        load_adapter(other, folder)


def test_weights_that_do_not_match_the_parameters_are_refused():
    model = add_lora(tiny_dit(), rank=2, alpha=0, targets=["to_q"])
    weights = [p.detach() for p in model.parameters()]
    with pytest.raises(ValueError):
        merged_state_dict(model, weights[:-1])


def test_lora_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="model.lora_rank needs model.pretrained"):
        load_config(["model.lora_rank=4"])
    with pytest.raises(ConfigError, match="model.lora_targets names no layer"):
        load_config(["model.lora_rank=4", "model.pretrained=somewhere", "model.lora_targets=' , '"])
    with pytest.raises(ConfigError, match="lora_rank"):
        load_config(["model.lora_rank=-1"])
    cfg = load_config(["model.lora_rank=4", "model.pretrained=somewhere", "model.lora_targets=to_q, ff.net.2"])
    assert cfg.model.lora_target_list() == ["to_q", "ff.net.2"]


# ---- end to end: a LoRA fine-tune of an export, resumed, exported, loaded by a stock pipeline with peft ----------

TINY_RUN = [
    "data.resolution=64", "data.batch_size=2", "data.synthetic_samples=24", "data.shuffle_buffer=8",
    "train.log_every=1", "train.sample_every=0", "sample.steps=2", "sample.prompts=[a red circle, a blue square]",
    "optim.warmup_steps=1", "train.trackers=none",
]


@pytest.mark.slow
def test_a_lora_fine_tune_resumes_exactly_exports_merged_weights_and_adapters_that_peft_loads(tmp_path):
    import json

    from diffusers import PixArtAlphaPipeline, PixArtTransformer2DModel
    from peft import PeftModel
    from safetensors.torch import load_file

    base = tmp_path / "base"
    run_train([*TINY_RUN, f"train.output_dir={base}", "train.max_steps=2", "train.save_every=2"], tmp_path)
    lora = [*TINY_RUN, f"model.pretrained={base / 'export'}", "model.lora_rank=4", "model.lora_alpha=8",
            "model.lora_targets=to_q,to_k,to_v,to_out.0", "loss.kind=imba", "optim.lr=1e-2", "train.save_every=2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    done = run_train([*lora, f"train.output_dir={whole}", "train.max_steps=4"], tmp_path)
    # the start-up line counts what trains: rank 4 × (96 in + 96 out) × 4 targets × 2 attentions × 4 blocks
    assert "DiT: 730,480 parameters, of which 24,576 train (3.36 %, LoRA)" in done.stdout
    run_train([*lora, f"train.output_dir={parts}", "train.max_steps=2"], tmp_path)
    resumed = run_train([*lora, f"train.output_dir={parts}", "train.max_steps=4", "--resume", "latest"], tmp_path)
    assert "resumed from" in resumed.stdout

    weights = "transformer/diffusion_pytorch_model.safetensors"
    before, after = load_file(base / "export" / weights), load_file(whole / "export" / weights)
    assert before.keys() == after.keys()  # merged: a stock transformer's keys, no adapter keys
    # the base weights are frozen: only the adapted layers' weights moved (by the merged B A)
    adapted = {k for k in before if any(f".{t}." in k for t in ("to_q", "to_k", "to_v", "to_out.0"))}
    assert all(torch.equal(before[k], after[k]) for k in before if k not in adapted)
    assert any(not torch.equal(before[k], after[k]) for k in adapted if k.endswith(".weight"))
    # killed at step 2 and resumed: the same export, bit for bit
    resumed_weights = load_file(parts / "export" / weights)
    assert all(torch.equal(after[k], resumed_weights[k]) for k in after)

    # the adapters alone, on a stock pipeline of the base model, predict what the merged export does
    pipe = PixArtAlphaPipeline.from_pretrained(base / "export")
    pipe.transformer = load_adapter(pipe.transformer, whole / "export" / "lora").eval()
    assert isinstance(pipe.transformer, PeftModel)
    config = json.loads((whole / "export" / "lora" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((base / "export").resolve())  # absolute, from any folder
    merged = PixArtTransformer2DModel.from_pretrained(whole / "export" / "transformer").eval()
    noisy, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([100, 900])
    embeds, mask = torch.randn(2, 16, merged.config.caption_channels), torch.ones(2, 16, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(predict(pipe.transformer.get_base_model(), noisy, t, embeds, mask),
                                   predict(merged, noisy, t, embeds, mask), rtol=1e-4, atol=1e-5)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", height=64, width=64, num_inference_steps=2, use_resolution_binning=False,
                 max_sequence_length=16, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)
    assert "LoRA (rank 4, alpha 8" in (whole / "export" / "README.md").read_text()

    # on 2 DDP processes (gloo): the ranks agree, the base stays frozen and the adapters train (each rank draws its
    # own noise, so the weights are not the one-process run's)
    from test_distributed import digests, launch_command, launch_env

    two = tmp_path / "two"
    proc = subprocess.run([*launch_command("ddp", 2), str(REPO / "train.py"), *lora, f"train.output_dir={two}",
                           "train.max_steps=4", "data.batch_size=1"], cwd=tmp_path,
                          env=launch_env({"ACCELERATE_USE_CPU": "true"}), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = digests(proc.stdout + proc.stderr)
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    on_two = load_file(two / "export" / weights)
    assert all(torch.equal(before[k], on_two[k]) for k in before if k not in adapted)
    assert any(not torch.equal(before[k], on_two[k]) for k in adapted if k.endswith(".weight"))
