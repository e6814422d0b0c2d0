"""The EMA for whole and ZeRO-3-partitioned parameters (`imba.training.ema`).

The partitioned case runs a real DeepSpeed ZeRO-3 engine in two processes over gloo, on parameters whose sizes are
odd (so the last rank's slice is padded), and checks the gathered EMA against diffusers' `EMAModel` fed the whole
parameters at every step.
"""

import os
import socket
from pathlib import Path

import pytest
import torch
from diffusers.training_utils import EMAModel

from imba.training.ema import PartitionedEMA, ema_weights_copy, make_ema
from models.dit import build_transformer


def test_make_ema_keeps_float32_shadows_of_bf16_parameters():
    model = torch.nn.Linear(3, 5).to(torch.bfloat16)
    ema = make_ema(model.parameters(), decay=0.5)
    assert type(ema) is EMAModel and all(s.dtype == torch.float32 for s in ema.shadow_params)
    assert all(torch.equal(s, p.float()) for s, p in zip(ema.shadow_params, model.parameters()))
    assert all(s.data_ptr() != p.data_ptr() for s, p in zip(ema.shadow_params, model.parameters()))


def test_ema_weights_copy_is_a_fresh_model_with_the_ema_weights():
    model = build_transformer("tiny", sample_size=4, caption_channels=16)
    ema = make_ema(model.parameters(), decay=0.9)
    for _ in range(2):  # EMAModel's first step copies the weights; the second averages (decay min(0.9, 2/11))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ema.step(model.parameters())
    torch.manual_seed(3)
    expected_draw = torch.rand(4)
    torch.manual_seed(3)
    copy = ema_weights_copy(model, ema)
    assert torch.equal(torch.rand(4), expected_draw)  # a grid mid-run leaves the training's random stream alone
    assert copy is not model and not copy.training
    assert all(torch.equal(c, s) for c, s in zip(copy.parameters(), ema.shadow_params, strict=True))
    assert not torch.equal(next(copy.parameters()), next(model.parameters()))
    assert ema_weights_copy(model, ema, build=False) is None


def test_partitioned_ema_refuses_whole_parameters():
    with pytest.raises(ValueError, match="ZeRO-3 parameters"):
        PartitionedEMA(torch.nn.Linear(3, 5).parameters())


def _zero3_worker(rank: int, world: int, port: int, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))  # 35, 5, 15, 3
    reference = EMAModel([p.detach().clone() for p in model.parameters()], decay=0.9)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                      config=config)
    params = list(engine.module.parameters())
    ema = PartitionedEMA(params, decay=0.9)
    assert all(s.numel() < p.ds_numel for s, p in zip(ema.shadow_params, params))  # really slices
    data = torch.Generator().manual_seed(rank)
    for _ in range(5):
        loss = engine(torch.randn(4, 7, generator=data)).square().mean()
        engine.backward(loss)
        engine.step()
        ema.step(params)
        with deepspeed.zero.GatheredParameters(params):
            reference.step(params)
    state = ema.state_dict()  # collective: gathered whole
    # a fresh EMA loads the whole state back into this rank's slices
    other = PartitionedEMA(params, decay=0.5)
    other.load_state_dict(state)
    reloaded = other.state_dict()  # gathered again from the loaded slices
    # the state of another model (transposed first weight) is refused, not loaded into the wrong slices
    wrong = {**state, "shadow_params": [state["shadow_params"][0].t().contiguous(), *state["shadow_params"][1:]]}
    try:
        PartitionedEMA(params, decay=0.9).load_state_dict(wrong)
        refused = ""
    except ValueError as err:
        refused = str(err)
    torch.save({"state": state, "reference": reference.state_dict(), "reloaded": reloaded, "refused": refused,
                "slice_sizes": [s.numel() for s in other.shadow_params]}, Path(results) / f"rank{rank}.pt")
    # neither rank leaves while the other may still be in a ZeRO-3 collective: gloo aborts a process whose peer is gone
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_partitioned_ema_matches_a_whole_ema_under_real_zero3(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR",
                                                              str(Path.home() / ".cache" / "imba-torch-ext")))
    torch.multiprocessing.spawn(_zero3_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        state, reference = out["state"], out["reference"]
        assert state["optimization_step"] == reference["optimization_step"] == 5
        assert [t.shape for t in state["shadow_params"]] == [(5, 7), (5,), (3, 5), (3,)]  # whole tensors
        for got, expected in zip(state["shadow_params"], reference["shadow_params"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        assert out["slice_sizes"] == [18, 3, 8, 2]  # ceil(n / 2): 35, 5, 15 and 3 elements are padded
        assert out["reloaded"]["decay"] == 0.9
        assert out["refused"] == "the EMA state does not match this model's parameter shapes"
        assert all(torch.equal(a, b) for a, b in zip(out["reloaded"]["shadow_params"], state["shadow_params"]))


def test_make_ema_steps_with_foreach_kernels_within_rounding_of_the_per_tensor_update():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    fast = make_ema(model.parameters(), decay=0.9)
    per_tensor = make_ema(model.parameters(), decay=0.9, foreach=False)  # an explicit choice is kept
    assert fast.foreach and not per_tensor.foreach
    for _ in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        fast.step(model.parameters())
        per_tensor.step(model.parameters())
    moved = max((s - p).abs().max() for s, p in zip(fast.shadow_params, model.parameters()))
    assert moved > 0.1
    for a, b in zip(fast.shadow_params, per_tensor.shadow_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
