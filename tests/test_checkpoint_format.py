"""Checkpoints across versions: the golden checkpoints under tests/golden/ (one per checkpoint format, each written by
the code of its day) resume to their recorded weights and export with today's code; the layout names its files and
its format; per-rank state follows its rule on another process count; old config keys migrate in one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from diffusers import PixArtTransformer2DModel
from safetensors.torch import load_file

import train
from imba.training import checkpoints, migrate
from imba.training.checkpoints import TrainState, load_checkpoint, load_ema_state, register, register_state
from imba.training.config import ConfigError
from imba.training.ema import make_ema
from imba.training.export import export_checkpoint
from imba.training.integrity import file_digest
from imba.training.resume import plan_resume
from test_train_precomputed import run_main  # train.main in-process, its state and signal handlers checked

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
# format → the parameter digest of its checkpoint at step 2 (what `train.py` printed when it wrote it; a resume
# prints it again once loaded): bitwise, it depends on nothing but the loading
GOLDEN_DIGESTS = {1: "76904443620e2e08"}


def gap_and_moved(now: dict, expected: dict, before: dict) -> tuple[float, float]:
    assert now.keys() == expected.keys() == before.keys()
    gap = max((now[k] - expected[k]).abs().max().item() for k in now)
    moved = max((expected[k] - before[k]).abs().max().item() for k in now)
    return gap, moved


@pytest.mark.parametrize("fmt", sorted(GOLDEN_DIGESTS))
def test_the_golden_checkpoint_resumes_to_its_recorded_weights_and_exports(fmt, tmp_path, monkeypatch, capsys):
    golden = GOLDEN / f"format{fmt}" / "step_0000002"
    expected = load_file(GOLDEN / f"format{fmt}" / "expected_step_0000004.safetensors")
    out = tmp_path / "run"
    shutil.copytree(golden, out / "checkpoints" / golden.name)
    monkeypatch.chdir(REPO)  # its config names model.pretrained=tests/golden/nano_dit
    assert run_main(["--config", str(golden / "config.yaml"), f"train.output_dir={out}", "train.max_steps=4"]) == 0
    log = capsys.readouterr().out
    assert f"at step 2, parameters {GOLDEN_DIGESTS[fmt]}" in log  # loaded bitwise

    # Two steps later: the weights and the EMA the code of the golden's day reached (recorded with it, see
    # tests/golden/README.md), up to a fraction of what the two steps move them. On one machine and torch version
    # they are bitwise equal (the digest in the README); another CPU may round the sums differently, and on
    # parameters whose gradient is zero in exact arithmetic AdamW turns that rounding into steps. A resume that
    # loses AdamW's moments, the LR schedule's position, the RNG states, the loss's running means or the step (so
    # other batches) moves them by the order of `moved` or more
    step4 = out / "checkpoints" / "step_0000004"
    weights = load_file(step4 / "model.safetensors")
    before = load_file(golden / "model.safetensors")
    gap, moved = gap_and_moved(weights, {k[len("param."):]: v for k, v in expected.items() if k.startswith("param.")},
                               before)
    assert moved > 1e-4 and gap <= 0.05 * moved, (gap, moved)
    ema = load_ema_state(step4)
    assert ema["optimization_step"] == 4
    as_dict = lambda tensors: {f"{i:03d}": t for i, t in enumerate(tensors)}  # noqa: E731
    gap, moved = gap_and_moved(as_dict(ema["shadow_params"]),
                               {k[len("ema."):]: v for k, v in expected.items() if k.startswith("ema.")},
                               as_dict(load_ema_state(golden)["shadow_params"]))
    assert moved > 1e-4 and gap <= 0.05 * moved, (gap, moved)

    # and it exports: the pipeline's transformer holds its EMA weights
    exported = export_checkpoint(out / "checkpoints" / golden.name, tmp_path / "export")
    transformer = PixArtTransformer2DModel.from_pretrained(exported / "transformer")
    for param, shadow in zip(transformer.parameters(), load_ema_state(golden)["shadow_params"], strict=True):
        assert torch.equal(param, shadow)


class Draws:
    """Per-rank state, as a data sampler's: how many samples this rank has drawn."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


class TinyRun:
    """A single-process accelerate run of a Linear model with the EMA, the counters and one per-rank part."""

    def __init__(self, root: Path):
        self.accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(8, 4)
        self.model, self.optimizer = self.accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        self.ema, self.state, self.draws = make_ema(self.model.parameters()), TrainState(world_size=1), Draws()
        self.loss = Draws()  # stands for the training loss's running state
        register_state(self.accelerator, self.ema, self.state, self.loss)
        register(self.accelerator, "draws", self.draws, per_rank=True)
        self.root = root

    def save(self) -> Path:
        self.model(torch.randn(2, 8)).square().mean().backward()
        self.optimizer.step()
        self.ema.step(self.model.parameters())
        self.state.step += 1
        self.draws.n += 2
        return checkpoints.save_checkpoint(self.accelerator, self.root, self.state.step, 3, config_text="tiny: 1\n")


@pytest.fixture
def run(tmp_path):
    yield TinyRun(tmp_path / "checkpoints")
    AcceleratorState._reset_state(reset_partial_state=True)


def test_state_files_are_named_by_what_they_hold_and_the_manifest_names_the_format(run):
    checkpoint = run.save()
    files = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert {"ema.pt", "train_state.pt", "rank_state/rank_00000.pt", "model.safetensors", "optimizer.bin"} <= files
    assert not [f for f in files if f.startswith("custom_checkpoint")]
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["format"] == checkpoints.FORMAT == 2 and "rank_state/rank_00000.pt" in manifest["files"]
    assert checkpoints.checkpoint_format(checkpoint) == 2 and checkpoints.is_checkpoint(checkpoint)
    assert torch.load(checkpoint / "train_state.pt", weights_only=False)["step"] == 1
    assert load_ema_state(checkpoint)["optimization_step"] == 1


def test_the_loss_state_is_a_part_of_its_own_and_read_from_the_counters_of_a_checkpoint_that_kept_it_there(
        run, capsys):
    run.loss.n = 3
    checkpoint = run.save()
    assert torch.load(checkpoint / "loss.pt", weights_only=False) == {"n": 3}
    counters = torch.load(checkpoint / "train_state.pt", weights_only=False)
    assert set(counters) == {"step", "world_size", "samples", "samples_per_step", "data"}
    run.loss.n = 0
    load_checkpoint(run.accelerator, checkpoint)
    assert run.loss.n == 3
    # as checkpoints were written before the loss had a file: its state an entry of the counters'
    (checkpoint / "loss.pt").unlink()
    torch.save({**counters, "loss": {"n": 9}}, checkpoint / "train_state.pt")
    run.loss.n = 0
    capsys.readouterr()
    load_checkpoint(run.accelerator, checkpoint)
    assert run.loss.n == 9 and "holds no" not in capsys.readouterr().out
    # neither place: the loss starts fresh, in one line
    torch.save(counters, checkpoint / "train_state.pt")
    load_checkpoint(run.accelerator, checkpoint)
    assert run.loss.n == 9 and "holds no loss (written by an earlier version)" in capsys.readouterr().out


def test_per_rank_state_rank_r_reads_rank_r_else_starts_fresh(run, monkeypatch, capsys):
    """The rule for a change of process count (docs/checkpoints.md): rank r of the new run reads rank r's file of
    the old run if it has one; a rank the old run did not have starts its per-rank state fresh, in one line."""
    checkpoint = run.save()  # rank 0's file: n=2
    torch.save({"draws": {"n": 7}}, checkpoints.rank_file(checkpoint, 1))  # as rank 1 of a 2-process run writes
    run.draws.n = 99
    load_checkpoint(run.accelerator, checkpoint)
    assert run.draws.n == 2 and run.state.step == 1
    for rank, expected in ((1, 7), (2, 0)):
        monkeypatch.setattr(Accelerator, "process_index", property(lambda self, rank=rank: rank))
        fresh = Draws()  # what a new run's rank holds before it loads
        accelerator = run.accelerator
        monkeypatch.setattr(checkpoints._REGISTERED[accelerator], "per_rank", {"draws": fresh})
        capsys.readouterr()
        load_checkpoint(accelerator, checkpoint)
        assert fresh.n == expected
        out = capsys.readouterr().out
        assert ("rank 2: " in out and "rank_00002.pt" in out and "draws: starting it fresh" in out) == (rank == 2)


def test_a_part_the_checkpoint_does_not_hold_starts_fresh_in_one_line(run, capsys):
    checkpoint = run.save()
    later = Draws(5)  # registered by newer code than wrote the checkpoint
    register(run.accelerator, "monitor", later)
    capsys.readouterr()
    load_checkpoint(run.accelerator, checkpoint)
    assert later.n == 5
    assert capsys.readouterr().out.strip() == f"{checkpoint} holds no monitor (written by an earlier version): " \
                                              "starting it fresh"
    with pytest.raises(ValueError, match="registered twice"):
        register(run.accelerator, "monitor", later)


def test_a_checkpoint_of_a_newer_format_is_a_one_line_error(run):
    checkpoint = run.save()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "format": 3}))
    for attempt in (lambda: plan_resume(str(checkpoint), run.root, run.accelerator),
                    lambda: export_checkpoint(checkpoint)):
        with pytest.raises(ConfigError) as raised:
            attempt()
        assert str(raised.value) == (f"{checkpoint} is a checkpoint of format 3, which this version of the code "
                                     "cannot read (it reads formats 1 to 2): use the version that wrote it, or a "
                                     "newer one")


def with_old_keys(golden: Path, copy: Path) -> Path:
    """A copy of `golden` whose config names optim.ema_decay by an older name and a key since dropped, as a
    version that had them wrote it, its manifest updated to match (keeping its format)."""
    shutil.copytree(golden, copy)
    config = copy / "config.yaml"
    text = config.read_text()
    assert "  ema_decay: 0.999\n" in text
    config.write_text(text.replace("  ema_decay: 0.999\n", "  ema_rate: 0.999\n").replace(
        "loss:\n", "loss:\n  old_knob: 3\n"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["config.yaml"] = {"size": config.stat().st_size, "sha256": file_digest(config)}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_a_checkpoint_whose_config_names_renamed_and_dropped_keys_exports_and_resumes(tmp_path, monkeypatch,
                                                                                       capsys):
    old = with_old_keys(GOLDEN / "format1" / "step_0000002", tmp_path / "old" / "checkpoints" / "step_0000002")
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="unknown config key 'loss.old_knob'"):  # what an unmigrated key meets
        export_checkpoint(old, tmp_path / "unmigrated")
    monkeypatch.setattr(migrate, "RENAMED", {"optim.ema_rate": "optim.ema_decay"})  # as if this version renamed it
    monkeypatch.setattr(migrate, "DROPPED", {"loss.old_knob": "no longer used"})
    # its one line names the renamed and dropped keys, after the other kinds' settings the file holds
    said = (f"config of {old / 'config.yaml'}: objective.beta_schedule, objective.beta_start, objective.beta_end "
            "dropped (not read by objective kind flow)")
    line = f"{said}; optim.ema_rate renamed to optim.ema_decay; loss.old_knob dropped (no longer used)"
    capsys.readouterr()
    assert (export_checkpoint(old, tmp_path / "export") / "model_index.json").is_file()
    assert line in capsys.readouterr().out.splitlines()
    out = tmp_path / "resumed"
    assert run_main(["--config", str(old / "config.yaml"), "--resume", str(old), f"train.output_dir={out}",
                     "train.max_steps=3"]) == 0
    log = capsys.readouterr().out
    assert line in log.splitlines() and f"at step 2, parameters {GOLDEN_DIGESTS[1]}" in log
    assert (out / "checkpoints" / "step_0000003" / "ema.pt").is_file()
