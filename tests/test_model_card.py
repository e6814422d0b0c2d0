"""The export's model card: the Hub's own parser reads its header, and the body states how the model was trained."""

import pytest
from huggingface_hub import ModelCard
from PIL import Image

from imba.training.config import load_config
from imba.training.model_card import CARD_FILE, GRID_FILE, model_card, write_model_card


def test_card_of_a_fine_tune_from_the_hub(tmp_path):
    cfg = load_config(["model.pretrained=PixArt-alpha/PixArt-XL-2-256x256", "loss.kind=imba",
                       "loss.normalize=timestep_mean", "data.shards=/data/laion/{00000..00999}.tar",
                       "data.batch_size=16", "train.grad_accum=2"])
    grid = tmp_path / "step_0001000.png"
    Image.new("RGB", (8, 8), "red").save(grid)
    export = tmp_path / "export"
    export.mkdir()
    path = write_model_card(export, cfg, step=1000, processes=8, grid=grid)
    assert path == export / CARD_FILE and (export / GRID_FILE).read_bytes() == grid.read_bytes()

    card = ModelCard.load(path)  # huggingface_hub's parser, offline: the metadata the Hub shows
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "text-to-image"
    assert card.data.base_model == "PixArt-alpha/PixArt-XL-2-256x256"
    assert {"text-to-image", "diffusers", "loss-imba"} <= set(card.data.tags)
    text = card.text
    assert "fine-tuned from `PixArt-alpha/PixArt-XL-2-256x256`" in text
    assert "`/data/laion/{00000..00999}.tar`" in text and "| steps | 1000 |" in text
    assert "16 per process × 2 accumulation steps × 8 processes = 256" in text
    assert "normalisation timestep_mean" in text and f"![samples]({GRID_FILE})" in text


def test_card_of_a_run_from_scratch_names_no_base_and_no_missing_grid(tmp_path):
    local_base = tmp_path / "base" / "export"
    local_base.mkdir(parents=True)
    for extra, base in ([], None), ([f"model.pretrained={local_base}"], None):
        cfg = load_config(["loss.kind=plain", "loss.lam=0.9", *extra])
        card = ModelCard(model_card(cfg, step=300, has_grid=False))
        assert card.data.base_model == base  # a folder on this machine is no Hub base model
        assert "caption dropout 0.1" in card.text and "## Samples" not in card.text
        assert "loss-plain" in card.data.tags
    path = write_model_card(tmp_path, load_config([]), step=3, grid=tmp_path / "missing.png")
    assert "## Samples" not in path.read_text() and not (tmp_path / GRID_FILE).exists()


def test_the_card_reads_each_kinds_own_line_and_a_kind_without_one_fails_loudly(tmp_path):
    from data.balance import BalanceRule
    from data.settings import DataConfig
    from imba.loss_settings import LOSS_SETTINGS, LossConfig
    from imba.objective_settings import OBJECTIVE_SETTINGS, ObjectiveConfig

    assert LOSS_SETTINGS["imba_sample"]().describe().startswith("IMBA (sample level): γ = 0.8")
    assert LOSS_SETTINGS["imba"]().describe().startswith("IMBA (token level)")
    assert LOSS_SETTINGS["plain"]().describe() == "plain diffusion MSE with caption dropout 0.1"
    assert load_config(["loss=plain", "loss.lam=0.75"]).loss.describe() == \
        "plain diffusion MSE with caption dropout 0.25"
    assert load_config(["objective=ddpm", "loss=imba", "loss.min_snr_gamma=5"]).loss.describe().endswith(
        "estimator literal, min-SNR weighting γ = 5")
    assert DataConfig().balance.describe() == ""
    assert load_config(["data.balance=cap", "data.balance.cap=7"]).data.balance.describe() == \
        "balanced by concepts (cap 7)"
    assert write_model_card(tmp_path, load_config(["data.balance=imba", "data.balance.every=7"]), step=3).read_text() \
        .count("balanced online by the IMBA distance (the temperature prior, alpha 0.5, 4 rarity groups each moved "
               "within 4x of it, every 7 steps)") == 1
    # a kind added to the choices but not to the describing line: an error, not another kind's words
    with pytest.raises(TypeError, match="abstract methods build, describe"):  # a kind without its line or loss
        type("NewLoss", (LossConfig,), {"KIND": "imba_new"})()
    assert [kind().describe() for kind in OBJECTIVE_SETTINGS.values()] == ["rectified flow (velocity prediction)",
                                                                          "DDPM ε-prediction"]
    with pytest.raises(TypeError, match="abstract method describe"):
        type("NewObjective", (ObjectiveConfig,), {"KIND": "edm"})()
    with pytest.raises(TypeError, match="abstract methods describe, factors"):  # a rule without its line
        type("NewRule", (BalanceRule,), {"KIND": "new_rule"})()
