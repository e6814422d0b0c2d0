"""The loss's API for a script of someone else's: every call that would train wrong is refused in one line that
says what to pass; the null caption is the pipeline's; per-sample weights compose; stats log as they are; the
running state saves and loads."""

from __future__ import annotations

import itertools

import pytest
import torch

from imba import IMBALoss, LossStats, NullCaption
from imba.monitor import BucketMonitor
from imba.training.metrics import MetricWindow


def tensors(*shape, n=3, seed=0, grad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(n)]


# ---- the unconditional prediction must carry its gradient -------------------------------------------------------

def test_efficient_form_refuses_a_no_grad_unconditional_prediction_and_names_the_fix():
    pred, = tensors(4, 4, 4, 4, n=1, grad=True)
    uncond, target = tensors(4, 4, 4, 4, n=2, seed=1)
    drop = torch.tensor([True, False, True, False])
    with pytest.raises(ValueError, match=r"pred_uncond=loss_fn\.efficient_uncond\(pred, uncond, drop\)") as err:
        IMBALoss()(pred, uncond, target, drop=drop)
    assert "\n" not in str(err.value)
    loss, _ = IMBALoss()(pred, IMBALoss.efficient_uncond(pred, uncond, drop), target, drop=drop)
    loss.backward()
    assert torch.count_nonzero(pred.grad[drop].flatten(1), dim=1).min() > 0  # the dropped rows train uncond


def test_literal_form_refuses_a_no_grad_unconditional_prediction():
    pred, = tensors(2, 4, 4, 4, n=1, grad=True)
    uncond, target = tensors(2, 4, 4, 4, n=2, seed=1)
    with pytest.raises(ValueError, match="pred_uncond carries no gradient.*never train"):
        IMBALoss()(pred, uncond, target)
    IMBALoss(lam=1.0)(pred, uncond, target)  # no unconditional term: nothing to train
    with torch.no_grad():
        IMBALoss()(pred, uncond, target)  # evaluation


def test_efficient_uncond_is_pred_on_dropped_rows_and_the_no_grad_pass_elsewhere():
    pred, = tensors(4, 2, 2, 2, n=1, grad=True)
    uncond_all, = tensors(4, 2, 2, 2, n=1, seed=3)
    drop = torch.tensor([False, True, True, False])
    merged = IMBALoss.efficient_uncond(pred, uncond_all, drop)
    assert torch.equal(merged[drop], pred[drop].detach()) and torch.equal(merged[~drop], uncond_all[~drop])
    kept_only = IMBALoss.efficient_uncond(pred, uncond_all[~drop], drop)  # a no-grad pass of the kept rows only
    assert torch.equal(kept_only, merged)
    merged.sum().backward()
    assert pred.grad[drop].eq(1).all() and pred.grad[~drop].eq(0).all()
    with pytest.raises(ValueError, match="all 4 rows or the 2 kept ones"):
        IMBALoss.efficient_uncond(pred, uncond_all[:3], drop)


def test_efficient_uncond_gives_the_same_loss_and_gradient_as_the_pass_itself():
    """Old protocol (pred_uncond = pred on dropped rows, no-grad elsewhere, built by hand) and the helper agree."""
    pred, = tensors(4, 4, 4, 4, n=1, grad=True, dtype=torch.float64)
    uncond, target = tensors(4, 4, 4, 4, n=2, seed=2, dtype=torch.float64)
    drop = torch.tensor([True, False, False, True])
    kept = (~drop).nonzero(as_tuple=True)[0]
    by_hand = pred.index_put((kept,), uncond[kept])
    a, _ = IMBALoss()(pred, by_hand, target, drop=drop)
    grad_a, = torch.autograd.grad(a, pred)
    b, _ = IMBALoss()(pred, IMBALoss.efficient_uncond(pred, uncond, drop), target, drop=drop)
    grad_b, = torch.autograd.grad(b, pred)
    assert torch.equal(a, b) and torch.equal(grad_a, grad_b)


# ---- shapes: learned variance, timesteps, patch size ---------------------------------------------------------

def test_learned_variance_channels_are_refused_with_the_slice_to_take():
    pred, uncond = tensors(2, 8, 4, 4, n=2, grad=True)
    target, = tensors(2, 4, 4, 4, n=1)
    with pytest.raises(ValueError, match=r"pred_cond has 8 channels and target 4: .*pred_cond\[:, :4\].*chunk"):
        IMBALoss()(pred, uncond, target)
    with pytest.raises(ValueError, match=r"uncond has 8 channels and pred 4"):
        IMBALoss.efficient_uncond(pred[:, :4], uncond, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="pred_cond has 6 channels and target 4: they must be the same"):
        IMBALoss()(pred[:, :6], uncond[:, :6], target)


def test_timesteps_and_sample_weights_need_one_value_per_row():
    pc, pu, t = tensors(3, 4, 4, 4)
    with pytest.raises(ValueError, match=r"timesteps must have shape \(3,\)"):
        IMBALoss(normalize="timestep_mean")(pc, pu, t, timesteps=torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"sample_weights must have shape \(3,\), one weight per sample"):
        IMBALoss()(pc, pu, t, sample_weights=torch.ones(2))
    # one timestep for the whole batch, as diffusers also accepts it
    a, _ = IMBALoss(normalize="timestep_mean")(pc, pu, t, timesteps=torch.tensor(500))
    b, _ = IMBALoss(normalize="timestep_mean")(pc, pu, t, timesteps=torch.full((3,), 500))
    assert torch.equal(a, b)


def tiny_pixart(patch_size):
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                    num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=patch_size,
                                    caption_channels=8, use_additional_conditions=False)


def test_patch_size_comes_from_the_transformer_and_a_wrong_one_is_refused():
    transformer = tiny_pixart(4)
    loss_fn = IMBALoss.for_transformer(transformer, gamma=0.5, normalize="batch_mean")
    assert (loss_fn.patch_size, loss_fn.gamma, loss_fn.normalize) == (4, 0.5, "batch_mean")

    class Wrapped(torch.nn.Module):  # as DDP or DeepSpeed's engine hold the model
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert IMBALoss.for_transformer(Wrapped(transformer)).patch_size == 4
    loss_fn.check_transformer(Wrapped(transformer))
    with pytest.raises(ValueError, match=r"patch_size is 2, but the transformer's config has patch_size=4: .*"
                                         r"IMBALoss\.for_transformer"):
        IMBALoss(patch_size=2).check_transformer(transformer)
    with pytest.raises(ValueError, match="patch_size is 2, but the transformer's config has patch_size=4"):
        IMBALoss.for_transformer(transformer, patch_size=2)
    with pytest.raises(ValueError, match="cannot be read from Linear"):
        IMBALoss.for_transformer(torch.nn.Linear(2, 2))


# ---- per-sample weights (min-SNR) --------------------------------------------------------------------------------

def test_sample_weights_scale_both_terms_of_each_sample():
    pc, pu, t = tensors(3, 4, 4, 4, dtype=torch.float64)
    w = torch.tensor([0.5, 2.0, 0.0], dtype=torch.float64)
    fn = IMBALoss(gamma=0.8, lam=0.7)
    weighted, _ = fn(pc, pu, t, sample_weights=w)
    per_sample = [fn(pc[i:i + 1], pu[i:i + 1], t[i:i + 1])[0] for i in range(3)]  # one sample: its own loss
    torch.testing.assert_close(weighted, sum(wi * li for wi, li in zip(w, per_sample)) / 3)
    assert torch.equal(fn(pc, pu, t, sample_weights=torch.ones(3, dtype=torch.float64))[0], fn(pc, pu, t)[0])


def test_weighted_efficient_form_is_the_weighted_literal_form_in_expectation():
    pc, pu, t = tensors(3, 4, 4, 4, dtype=torch.float64, seed=4)
    w = torch.tensor([0.3, 1.0, 4.0], dtype=torch.float64)
    fn = IMBALoss(gamma=0.8, lam=0.6)
    literal, _ = fn(pc, pu, t, sample_weights=w)
    expected = 0.0
    for bits in itertools.product([False, True], repeat=3):
        drop = torch.tensor(bits)
        p = torch.tensor([0.4 if dropped else 0.6 for dropped in bits], dtype=torch.float64).prod()
        expected = expected + p * fn(pc, pu, t, drop=drop, sample_weights=w)[0]
    torch.testing.assert_close(expected, literal)


# ---- stats -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("drop", [None, torch.tensor([True, False])])
def test_stats_map_scalars_and_keep_tensors_apart(drop):
    pc, pu, t = tensors(2, 4, 4, 4)
    _, stats = IMBALoss()(pc, pu, t, drop=drop)
    assert isinstance(stats, LossStats) and all(v.dim() == 0 for v in stats.values())
    assert set(stats.tensors) == {"distance_per_sample", "distance_per_token", "loss_cond_per_sample"}
    assert stats.tensors["distance_per_token"].shape == (2, 4) and stats["distance_per_sample"].shape == (2,)
    assert "distance_per_token" in stats and "distance_per_token" not in list(stats)
    floats = stats.floats()
    assert list(floats) == list(stats) and all(type(v) is float for v in floats.values())
    assert floats["imba/loss"] == pytest.approx(stats["imba/loss"].item())
    stats["grad_norm"] = torch.tensor(3.0)
    stats["per_row_extra"] = torch.ones(2)  # a tensor with dimensions goes with the tensors
    assert "per_row_extra" in stats.tensors and "per_row_extra" not in dict(stats)
    window = MetricWindow()
    window.add(stats)
    assert set(window.means()) == set(dict(stats))
    monitor = BucketMonitor()
    monitor.add(["head", "tail"], stats)
    assert "monitor/distance_head" in monitor.means()
    with pytest.raises(KeyError):
        stats["nothing"]


# ---- running state -----------------------------------------------------------------------------------------

def test_running_state_saves_loads_and_refuses_another_loss(tmp_path):
    pc, pu, t = tensors(4, 2, 4, 4)
    steps = torch.tensor([10, 400, 700, 999])
    a = IMBALoss(normalize="timestep_mean")
    a(pc, pu, t, timesteps=steps)
    torch.save(a.state_dict(), tmp_path / "loss.pt")  # what accelerator.save_state does with a registered object
    b = IMBALoss(normalize="timestep_mean")
    b.load_state_dict(torch.load(tmp_path / "loss.pt"))
    assert torch.equal(a(pc, pu, t, timesteps=steps)[0], b(pc, pu, t, timesteps=steps)[0])
    assert IMBALoss().state_dict() == {}
    with pytest.raises(ValueError, match="holds timestep means but this loss has normalize='none'"):
        IMBALoss().load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="holds no timestep means"):
        IMBALoss(normalize="timestep_mean").load_state_dict({})


@pytest.mark.parametrize("normalize", ["none", "timestep_mean"])
def test_a_state_that_is_not_the_losss_is_refused(normalize):
    """Another registered object's state handed to the loss (objects registered in another order than saved)."""
    ema = {"decay": 0.999, "shadow_params": [torch.zeros(2)]}
    with pytest.raises(ValueError, match=r"saved state \(keys decay, shadow_params\) is not an IMBALoss's.*order"):
        IMBALoss(normalize=normalize).load_state_dict(ema)
    with pytest.raises(ValueError, match=r"saved state \(list\) is not an IMBALoss's"):
        IMBALoss(normalize=normalize).load_state_dict([1, 2])


def test_checkpoint_with_carries_the_state_and_loads_checkpoints_without_it(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True)
        loss_fn = IMBALoss(normalize="timestep_mean")
        handles = loss_fn.checkpoint_with(accelerator)
        accelerator.save_state(str(tmp_path / "before"))  # a fresh loss: its fresh means
        pc, pu, t = tensors(4, 2, 4, 4)
        loss_fn(pc, pu, t, timesteps=torch.tensor([10, 400, 700, 999]))
        saved = loss_fn.state_dict()["timestep_mean"]
        accelerator.save_state(str(tmp_path / "after"))
        assert (tmp_path / "after" / "imba_loss.pt").is_file()
        accelerator.load_state(str(tmp_path / "before"))
        assert not loss_fn.state_dict()["timestep_mean"]["seen"].any()
        accelerator.load_state(str(tmp_path / "after"))
        assert torch.equal(loss_fn.state_dict()["timestep_mean"]["means"], saved["means"])
        (tmp_path / "after" / "imba_loss.pt").unlink()  # as a checkpoint saved before IMBA was added
        accelerator.load_state(str(tmp_path / "after"))
        assert torch.equal(loss_fn.state_dict()["timestep_mean"]["means"], saved["means"])  # nothing to load
        for handle in handles:
            handle.remove()
        IMBALoss().checkpoint_with(accelerator)  # a loss built otherwise than the one saved
        with pytest.raises(ValueError, match="holds timestep means but this loss has normalize='none'"):
            accelerator.load_state(str(tmp_path / "before"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_floating_timesteps_in_0_1_are_refused_unless_the_loss_declares_them():
    """A flow schedule's t or σ passed where the transformer's timesteps (0 to 1000) belong would put every
    sample in the first bin."""
    pc, pu, t = tensors(3, 4, 4, 4)
    sigmas = torch.tensor([0.1, 0.5, 0.97])
    with pytest.raises(ValueError, match=r"timesteps are floats in \[0, 1\].*sigmas \* 1000.*num_train_timesteps=1"):
        IMBALoss(normalize="timestep_mean")(pc, pu, t, timesteps=sigmas)
    declared = IMBALoss(normalize="timestep_mean", timestep_bins=2, num_train_timesteps=1)
    declared(pc, pu, t, timesteps=sigmas)
    assert declared.timestep_mean.seen.tolist() == [True, True]  # 0.97 in the second of two bins
    loss_fn = IMBALoss(normalize="timestep_mean")
    loss_fn(pc, pu, t, timesteps=sigmas * 1000)  # the transformer's timesteps, as floats
    loss_fn(pc, pu, t, timesteps=torch.tensor([0.0, 1.0, 1.0]))  # whole numbers: DDPM timesteps as floats
    loss_fn(pc, pu, t, timesteps=torch.tensor([0, 1, 1]))
    IMBALoss(normalize="timestep_mean")(pc, pu, t, timesteps=torch.tensor([0.0, 1.0, 1.0]))
    IMBALoss()(pc, pu, t, timesteps=sigmas)  # unused by the other normalisations


def test_timestep_mean_refuses_timesteps_outside_its_bins():
    """Timesteps the bins do not cover (a scheduler of 10000 steps, negatives, NaN) would all be clamped into the
    first or last bin: integers must lie in 0..T-1, floats in [0, T] (a flow schedule's σ = 1 gives T itself)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pc, pu, t = tensors(2, 4, 4, 4)
    for bad in (torch.tensor([0, 9999]), torch.tensor([-1, 5]), torch.tensor([3, 1000]), torch.tensor([-0.5, 7.0]),
                torch.tensor([2.0, 1000.5]), torch.tensor([float("nan"), 3.0])):
        with pytest.raises(ValueError, match=r"outside the 0 to (999|1000) that the timestep bins of "
                                             r"num_train_timesteps=1000 split: build the loss with the scheduler's"):
            IMBALoss(normalize="timestep_mean")(pc, pu, t, timesteps=bad)
    loss_fn = IMBALoss(normalize="timestep_mean")
    loss_fn(pc, pu, t, timesteps=torch.tensor([0, 999]))
    flow = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000).timesteps
    loss_fn(pc, pu, t, timesteps=flow[[0, -1]])  # 1000.0 (σ = 1) and 1.0
    with pytest.raises(ValueError, match="range from 0 to 2000"):  # a later batch too, where reading it is free
        loss_fn(pc, pu, t, timesteps=torch.tensor([0, 2000]))
    with pytest.raises(ValueError, match=r"0 to 1 that the timestep bins of num_train_timesteps=1 split"):
        IMBALoss(normalize="timestep_mean", num_train_timesteps=1)(pc, pu, t, timesteps=torch.tensor([0.5, 250.0]))
    IMBALoss()(pc, pu, t, timesteps=torch.tensor([0, 9999]))  # unused by the other normalisations


def test_the_efficient_forms_unconditional_prediction_needs_its_drop_mask():
    """`efficient_uncond`'s tensor carries gradient on the dropped rows, so without `drop=` the loss would take it
    for the literal form's, even on a step that dropped no row: refused, as is another mask than its own."""
    pred, = tensors(4, 4, 4, 4, n=1, grad=True)
    uncond, target = tensors(4, 4, 4, 4, n=2, seed=1)
    loss_fn = IMBALoss()
    for drop in (torch.tensor([True, False, True, False]), torch.zeros(4, dtype=torch.bool)):
        for rows in (uncond, uncond[~drop]):  # the no-grad pass on every row, or on the kept ones
            merged = loss_fn.efficient_uncond(pred, rows, drop)
            with pytest.raises(ValueError, match=r"efficient_uncond, the efficient form, but the call has no drop=: "
                                                 r"pass drop=drop") as err:
                loss_fn(pred, merged, target)
            assert "\n" not in str(err.value)
            with pytest.raises(ValueError, match="another drop mask than this call's drop=: pass the same mask"):
                loss_fn(pred, merged, target, drop=~drop)
            loss_fn(pred, merged, target, drop=drop)
            loss_fn(pred, merged, target, drop=drop.clone())  # the same mask, another tensor
    literal_uncond, = tensors(4, 4, 4, 4, n=1, seed=2, grad=True)
    loss_fn(pred, literal_uncond, target)  # the literal form's own unconditional prediction: no mask to ask for


def test_timestep_means_reduce_over_processes_unless_told_not_to():
    calls = []
    fn = IMBALoss(normalize="timestep_mean", timestep_reduce=lambda totals: calls.append(totals.shape))
    pc, pu, t = tensors(2, 2, 4, 4)
    fn(pc, pu, t, timesteps=torch.tensor([1, 999]))
    assert calls == [(2, 10)]
    assert IMBALoss(normalize="timestep_mean").timestep_reduce == "auto"  # all-reduce when a group is running
    with pytest.raises(ValueError, match="timestep_reduce must be 'auto', None or an all-reduce function"):
        IMBALoss(normalize="timestep_mean", timestep_reduce="sum")


# ---- the null caption ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text():
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    torch.manual_seed(0)
    encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                      feed_forward_proj="gated-gelu", is_encoder_decoder=False)).eval()
    return ByT5Tokenizer(), encoder


def test_null_caption_is_the_pipelines_negative_prompt(text):
    """The unconditional model trains on what classifier-free guidance gives it: PixArtAlphaPipeline's encoding of
    its default negative prompt, at the prompts' length."""
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtAlphaPipeline

    tokenizer, encoder = text
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4, sample_size=8)
    pipe = PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae, transformer=tiny_pixart(2),
                               scheduler=DPMSolverMultistepScheduler())
    _, _, negative, negative_mask = pipe.encode_prompt("a red circle", do_classifier_free_guidance=True,
                                                       device="cpu", max_sequence_length=12)
    null = NullCaption.encode(tokenizer, encoder, max_length=12)
    embeds, mask = null.expand(1)
    assert torch.equal(mask, negative_mask) and torch.equal(embeds, negative)
    assert int(null.mask.sum()) == 1  # "" is one token, </s>


def test_null_caption_fills_rows_at_the_captions_length_dtype_and_device(text):
    tokenizer, encoder = text
    null = NullCaption.encode(tokenizer, encoder, max_length=6)
    captions = tokenizer(["a cat", "two dogs running"], padding="max_length", max_length=10, truncation=True,
                         return_tensors="pt")
    with torch.no_grad():
        embeds = encoder(captions.input_ids, attention_mask=captions.attention_mask)[0].to(torch.bfloat16)
    both, both_mask = null.cat(embeds, captions.attention_mask)
    assert both.shape == (4, 10, 8) and both.dtype == torch.bfloat16 and both_mask.shape == (4, 10)
    assert torch.equal(both[:2], embeds) and both_mask[2:].sum(dim=1).tolist() == [1, 1]
    assert torch.equal(both[2, :6], null.embeds[0].to(torch.bfloat16)) and both[2, 6:].eq(0).all()
    mixed, mixed_mask = null.where(torch.tensor([False, True]), embeds, captions.attention_mask)
    assert torch.equal(mixed[0], embeds[0]) and torch.equal(mixed[1], both[3])
    assert torch.equal(mixed_mask[1], both_mask[3])
    short, short_mask = null.expand(3, like=(embeds[:, :2], captions.attention_mask[:, :2]))
    assert short.shape == (3, 2, 8) and short_mask.tolist() == [[1, 0]] * 3
    # the null caption alone (the efficient form's no-grad pass) follows the captions cat and where last saw: the
    # transformer gets the dtype the script gives it, not the encoder's
    follows = null.kwargs(2)
    assert follows["encoder_attention_mask"].shape == (2, 10)
    assert follows["encoder_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(follows["encoder_hidden_states"][1], both[3])
    fresh = NullCaption.encode(tokenizer, encoder, max_length=6).kwargs(2)  # before any captions: the encoder's
    assert fresh["encoder_attention_mask"].shape == (2, 6) and fresh["encoder_hidden_states"].dtype == torch.float32
    assert null.expand(1, like=embeds.float())[0].dtype == torch.float32  # captions' embeddings alone will do


@pytest.mark.parametrize("null_length, caption_length", [(6, 12), (12, 6)])
def test_empty_captions_are_refused_whatever_length_either_was_encoded_at(text, null_length, caption_length):
    """The padding's states depend on the length "" was encoded at (120 against a script's 300); the attended
    token does not."""
    tokenizer, encoder = text
    null = NullCaption.encode(tokenizer, encoder, max_length=null_length)
    tokens = tokenizer(["a cat", ""], padding="max_length", max_length=caption_length, truncation=True,
                       return_tensors="pt")
    with torch.no_grad():
        embeds = encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0]
    with pytest.raises(ValueError, match=r"caption rows \[1\] already are the null caption"):
        null.cat(embeds, tokens.attention_mask)
    with pytest.raises(ValueError, match=r"caption rows \[1\] already are the null caption"):
        null.where(torch.tensor([False, False]), embeds.to(torch.bfloat16), tokens.attention_mask)
    null.cat(embeds[:1], tokens.attention_mask[:1])  # a caption is let through


@pytest.mark.parametrize("caption_length", [8, 12, 5])
def test_empty_captions_are_refused_without_a_padding_mask(text, caption_length):
    """A script that gives the transformer an all-ones mask (it does not pad-mask): its dropped rows are told
    from the captions by their embeddings, every position both hold, at any length."""
    tokenizer, encoder = text
    null = NullCaption.encode(tokenizer, encoder, max_length=8)
    tokens = tokenizer(["a cat", ""], padding="max_length", max_length=caption_length, truncation=True,
                       return_tensors="pt")
    with torch.no_grad():
        embeds = encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0]
    ones = torch.ones_like(tokens.attention_mask)
    with pytest.raises(ValueError, match=r"caption rows \[1\] already are the null caption"):
        null.cat(embeds, ones)
    with pytest.raises(ValueError, match=r"caption rows \[1\] already are the null caption"):
        null.where(torch.tensor([False, False]), embeds.to(torch.bfloat16), ones.bool())
    null.cat(embeds[:1], ones[:1])  # a caption is let through


def test_unmasked_captions_that_share_the_null_captions_first_states_are_let_through():
    """A causal text encoder gives every caption the same state for its first token (<bos>), which is all the
    null caption attends to: without a padding mask the rest of the row tells a caption from ""."""
    g = torch.Generator().manual_seed(0)
    null_embeds = torch.randn(1, 6, 8, generator=g)
    null = NullCaption(null_embeds, torch.tensor([[1, 0, 0, 0, 0, 0]]))
    captions = torch.randn(3, 6, 8, generator=g)
    captions[:, 0] = null_embeds[0, 0]  # the shared <bos> state
    captions[2] = null_embeds[0]  # "" encoded by the script
    with pytest.raises(ValueError, match=r"caption rows \[2\] already are the null caption"):
        null.cat(captions, torch.ones(3, 6, dtype=torch.long))
    null.cat(captions[:2], torch.ones(2, 6, dtype=torch.long))


def test_null_caption_needs_a_device_for_an_encoder_without_parameters(text):
    tokenizer, encoder = text

    class Precomputed(torch.nn.Module):  # e.g. states looked up, or an encoder served elsewhere
        def forward(self, input_ids, attention_mask=None):
            with torch.no_grad():
                return (encoder(input_ids, attention_mask=attention_mask)[0],)

    with pytest.raises(ValueError, match=r"text encoder \(Precomputed\) has no parameters .*pass device="):
        NullCaption.encode(tokenizer, Precomputed(), max_length=8)
    with pytest.raises(ValueError, match="has no parameters"):
        NullCaption.encode(tokenizer, lambda ids, attention_mask: Precomputed()(ids, attention_mask), max_length=8)
    null = NullCaption.encode(tokenizer, Precomputed(), max_length=8, device="cpu")
    assert torch.equal(null.embeds, NullCaption.encode(tokenizer, encoder, max_length=8).embeds)


def test_repeat_rows_gives_the_micro_conditions_of_the_literal_forms_2b_rows():
    resolution, aspect_ratio = torch.tensor([[512.0, 768.0], [1024.0, 1024.0]]), torch.tensor([[1.5], [1.0]])
    both = NullCaption.repeat_rows({"resolution": resolution, "aspect_ratio": aspect_ratio, "scale": torch.tensor(2.0)})
    assert torch.equal(both["resolution"], resolution.repeat(2, 1))
    assert torch.equal(both["aspect_ratio"], aspect_ratio.repeat(2, 1)) and both["scale"].dim() == 0
    assert NullCaption.repeat_rows({"resolution": None, "aspect_ratio": None}) == {"resolution": None,
                                                                                  "aspect_ratio": None}
    with pytest.raises(ValueError, match=r"expects a dict of tensors \(added_cond_kwargs\), got Tensor"):
        NullCaption.repeat_rows(resolution)


def test_captions_that_already_hold_the_null_caption_are_refused(text):
    """The script's own caption dropout left on: IMBA's 1 − lam replaces it."""
    tokenizer, encoder = text
    null = NullCaption.encode(tokenizer, encoder, max_length=8)
    tokens = tokenizer(["a cat", ""], padding="max_length", max_length=8, truncation=True, return_tensors="pt")
    with torch.no_grad():
        embeds = encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0]
    with pytest.raises(ValueError, match=r"caption rows \[1\] already are the null caption .*caption dropout.* 0"):
        null.cat(embeds, tokens.attention_mask)
    with pytest.raises(ValueError, match=r"caption rows \[0\]"):
        null.where(torch.tensor([False]), torch.zeros_like(embeds[:1]), tokens.attention_mask[:1])
    with pytest.raises(ValueError, match=r"drop must be a bool tensor of shape \(2,\)"):
        null.where(torch.tensor([0, 1]), embeds, tokens.attention_mask)
    # a data set with empty captions on purpose: let through, the null caption appended after them as usual
    allowing = NullCaption.encode(tokenizer, encoder, max_length=8, allow_empty_captions=True).to("cpu")
    both, both_mask = allowing.cat(embeds, tokens.attention_mask)
    assert torch.equal(both[:2], embeds) and torch.equal(both[2:], allowing.expand(2, like=(embeds, tokens.attention_mask))[0])


def test_a_step_that_writes_the_null_caption_back_into_captions_encoded_once_is_told_to_use_new_names(text):
    """A script that encodes its prompt once, outside the loop, and assigns `where`'s output back to its
    `prompt_embeds`: the next step finds null rows in them, and the refusal names that mistake too."""
    tokenizer, encoder = text
    null = NullCaption.encode(tokenizer, encoder, max_length=8)
    tokens = tokenizer(["a cat", "a dog"], padding="max_length", max_length=8, return_tensors="pt")
    with torch.no_grad():
        prompt_embeds, prompt_attention_mask = encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0], \
            tokens.attention_mask
    prompt_embeds, prompt_attention_mask = null.where(torch.tensor([False, True]), prompt_embeds,
                                                      prompt_attention_mask)
    with pytest.raises(ValueError, match=r"caption rows \[1\] .*captions encoded once before the loop: keep cat's "
                                         r"or where's output under new names \(embeds, mask = null.where"):
        null.where(torch.tensor([False, False]), prompt_embeds, prompt_attention_mask)


def test_min_snr_weights_each_sample_by_min_snr_gamma_over_snr_on_top_of_its_weights():
    from imba.objectives import DDPMEpsilon, NoisedBatch
    from imba.training_loss import ImbaTrainingLoss, PlainTrainingLoss, min_snr_weights

    torch.manual_seed(0)
    latents = torch.randn(6, 4, 4, 4)
    noised = DDPMEpsilon().noise(latents, generator=torch.Generator().manual_seed(1))
    schedule = DDPMEpsilon().noise_scheduler.alphas_cumprod
    # the SNR of each row's timestep, ᾱ / (1 − ᾱ), from the schedule itself
    torch.testing.assert_close(noised.snr, schedule[noised.timesteps] / (1 - schedule[noised.timesteps]))
    noised.snr = torch.tensor([0.5, 1.0, 4.0, 5.0, 20.0, 1e4])
    weights = min_snr_weights(noised, 5.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.25, 5e-4]))

    def predict(noisy, timesteps, embeds, mask):
        return noisy * 0.5

    cond = (torch.randn(6, 3, 8), torch.ones(6, 3, dtype=torch.long))
    null = (torch.zeros(6, 3, 8), torch.ones(6, 3, dtype=torch.long))
    keep = torch.zeros(6, dtype=torch.bool)
    extra = torch.tensor([1.0, 2.0, 1.0, 1.0, 2.0, 1.0])
    for make in (PlainTrainingLoss, lambda **k: ImbaTrainingLoss(estimator="efficient", **k)):
        plain = make(lam=1.0)
        snr = make(lam=1.0, min_snr_gamma=5.0)
        # the same as giving min(SNR, γ) / SNR as sample weights, and multiplied with weights given
        expected, _ = plain(predict, noised, cond, null, drop=keep, sample_weights=weights * extra)
        got, _ = snr(predict, noised, cond, null, drop=keep, sample_weights=extra)
        torch.testing.assert_close(got, expected)
        assert not torch.allclose(got, plain(predict, noised, cond, null, drop=keep, sample_weights=extra)[0])
    flow = NoisedBatch(noisy=latents, timesteps=torch.rand(6) * 1000, target=latents)  # no SNR: not ε-prediction
    with pytest.raises(ValueError, match="min_snr_gamma needs the batch's SNR"):
        PlainTrainingLoss(min_snr_gamma=5.0)(predict, flow, cond, null)
    for make in (PlainTrainingLoss, ImbaTrainingLoss):
        with pytest.raises(ValueError, match="min_snr_gamma must be >= 0"):
            make(min_snr_gamma=-1.0)


def test_min_snr_is_refused_with_a_flow_objective_in_one_line():
    from imba.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"loss.min_snr_gamma weights ε-prediction \(objective.kind=ddpm\), not "
                                          r"objective.kind=flow"):
        load_config(["loss.min_snr_gamma=5"])
    assert load_config(["loss.min_snr_gamma=5", "objective.kind=ddpm"]).loss.min_snr_gamma == 5.0
    with pytest.raises(ConfigError, match="min_snr_gamma"):
        load_config(["loss.min_snr_gamma=-1", "objective.kind=ddpm"])
