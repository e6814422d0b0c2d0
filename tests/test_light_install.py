"""The light install: the IMBA loss installs and runs with torch alone, and `import imba` loads nothing heavier.

The training stack (accelerate, diffusers, transformers, deepspeed, ...) is the `train` extra; a user who drops the
loss into a script of their own should not get it, nor DeepSpeed's start-up warning in their script.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAINING_STACK = ("accelerate", "diffusers", "deepspeed", "transformers")
HEAVY = (*TRAINING_STACK, "webdataset", "matplotlib", "tokenizers", "safetensors", "yaml", "PIL")

IMPORTS_ONLY_TORCH = f"""
import sys
import imba
from imba import IMBALoss, NullCaption, TrainingLoss, LossStats
loaded = sorted(set({HEAVY!r}) & set(sys.modules))
assert not loaded, loaded
print("ok")
"""

# The loss trains (literal and efficient forms, null caption, stats) and refuses a no-grad unconditional prediction
# as it does anywhere.
LOSS_RUN = """
import torch
import imba
from imba import IMBALoss, LossStats, NullCaption, TrainingLoss

torch.manual_seed(0)
model = torch.nn.Conv2d(4 + 8, 4, 1)
def predict(x, text):  # a toy conditional model: the caption's mean state, broadcast over the image
    return model(torch.cat([x, text.mean(1)[:, :, None, None].expand(-1, -1, *x.shape[2:])], 1))
null = NullCaption(torch.randn(1, 5, 8), torch.tensor([[1, 0, 0, 0, 0]]))
x, target = torch.randn(4, 4, 8, 8), torch.randn(4, 4, 8, 8)
captions, mask = torch.randn(4, 5, 8), torch.ones(4, 5, dtype=torch.long)
loss_fn = IMBALoss(patch_size=2, normalize="timestep_mean")
t = torch.tensor([10, 300, 600, 900])

embeds, _ = null.cat(captions, mask)
loss, stats = loss_fn(*predict(x.repeat(2, 1, 1, 1), embeds).chunk(2), target, timesteps=t)
loss.backward()
assert torch.isfinite(loss) and all(v.dim() == 0 for v in stats.values())

drop = torch.tensor([True, False, True, False])
embeds, _ = null.where(drop, captions, mask)
pred = predict(x, embeds)
with torch.no_grad():
    uncond = predict(x, null.expand(4)[0])
try:
    loss_fn(pred, uncond, target, drop=drop, timesteps=t)
    raise SystemExit("a no-grad unconditional prediction with drop= was accepted")
except ValueError as err:
    assert "efficient_uncond" in str(err), err
loss, stats = loss_fn(pred, loss_fn.efficient_uncond(pred, uncond, drop), target, drop=drop, timesteps=t)
loss.backward()
assert torch.isfinite(loss) and set(loss_fn.state_dict()) == {"timestep_mean"}
print("ok")
"""

# Run inside the light venv: nothing of the training stack can be imported, the installed metadata asks for torch
# alone, and the loss runs.
LIGHT_RUN = f"""
import importlib.util, sys
from importlib import metadata

assert importlib.util.find_spec("imba").origin.startswith(sys.prefix), importlib.util.find_spec("imba").origin
importable = [m for m in {TRAINING_STACK!r} if importlib.util.find_spec(m) is not None]
assert not importable, importable
core = [r for r in metadata.requires("imba-dit") if "extra ==" not in r]
assert [r.replace(" ", "") for r in core] == ["torch>=2.4"], core
# the trainer and the evaluation read a checkout's data/ and models/: the wheel does not hold them
assert importlib.util.find_spec("imba.training") is None and importlib.util.find_spec("imba.eval") is None
""" + LOSS_RUN

# Run in this environment with every module unimportable but the standard library, torch and what torch needs (as
# a torch-only install has them), and imba.
ONLY_TORCH = """
import importlib.abc, sys

class OnlyTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in ALLOWED:
            raise ModuleNotFoundError(f"No module named {name!r} (only torch is installed)", name=name)
        return None

ALLOWED = set(sys.stdlib_module_names) | {"imba"} | set(sys.argv[1:])
sys.meta_path.insert(0, OnlyTorch())
"""


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_import_imba_loads_torch_alone(tmp_path):
    """`import imba` and every name it exports load none of the training stack (run in a fresh interpreter,
    outside the checkout, so nothing imported before counts)."""
    proc = subprocess.run([sys.executable, "-c", IMPORTS_ONLY_TORCH], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_import_imba_works_with_only_torch_importable(tmp_path):
    """`import imba` and the loss work where torch (and what it needs) is all that is installed: every other module
    of this environment is made unimportable, so an import of one anywhere in `imba`, even a guarded one that
    changes what runs, shows here (the slow test below does the same through a real install)."""
    allowed = sorted({entry.removesuffix(".py") for dist in torch_closure() for entry in _top_level(dist)
                      if not entry.endswith((".dist-info", ".egg-info"))})
    assert "torch" in allowed and not set(TRAINING_STACK) & set(allowed), allowed
    proc = subprocess.run([sys.executable, "-c", ONLY_TORCH + LOSS_RUN, *allowed], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    blocked = subprocess.run([sys.executable, "-c", ONLY_TORCH + "import diffusers", *allowed], cwd=tmp_path,
                             env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert "only torch is installed" in blocked.stderr  # the fence holds


def test_the_docs_say_how_to_install_the_cpu_build_of_torch_first():
    """`pip install .` alone gets pip's default torch, the CUDA build with its NVIDIA wheels (gigabytes) on Linux:
    docs/loss.md installs the CPU build from PyTorch's index before it."""
    from test_docs import shell_snippets

    commands = [snippet.text for snippet in shell_snippets(REPO / "docs" / "loss.md")]
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in commands and "pip install ." in commands[commands.index(cpu):], commands


def _requirement_names(dist: metadata.Distribution) -> list[str]:
    """The distributions `dist` needs on this interpreter (markers evaluated, extras left out)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging.requirements import Requirement
    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _top_level(dist: metadata.Distribution) -> set[str]:
    """What `dist` puts directly into site-packages: its packages, modules and .dist-info folder."""
    names = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            names.add(first)
    return names


def torch_closure(*more: str) -> list[metadata.Distribution]:
    """The installed torch, the distributions it needs on this interpreter (recursively) and `more`."""
    todo, done, dists = ["torch", *more], set(), []
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement whose marker holds here but that is not installed: torch runs without it
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in done:
            continue
        done.add(key)
        dists.append(dist)
        todo.extend(_requirement_names(dist))
    assert not {"accelerate", "diffusers", "deepspeed", "transformers"} & done, done
    return dists


def torch_only_folder(folder: Path) -> Path:
    """A folder of links to the installed torch and the distributions it needs (and setuptools, the build backend
    that `pip install --no-build-isolation` uses), and to nothing else of this environment."""
    folder.mkdir()
    for dist in torch_closure("setuptools"):
        site = Path(dist.locate_file(""))
        for entry in _top_level(dist):
            if (site / entry).exists() and not (folder / entry).exists():
                (folder / entry).symlink_to(site / entry)
    return folder


@pytest.mark.slow
def test_light_install_runs_the_loss_without_the_training_stack(tmp_path):
    """A real `pip install` of this project, without extras, into a fresh venv, where the loss must work.

    How torch gets there: downloading it (hundreds of MB; CI and the test machines may be offline) is too slow,
    and `--system-site-packages` or a `.pth` to this environment's site-packages would also expose the training
    stack installed next to torch, the very thing the test must not see. So the venv gets a `.pth` file naming a
    folder of symbolic links to exactly torch's installed distributions, found from their metadata
    (`importlib.metadata`: torch, what its Requires-Dist needs on this interpreter, recursively), plus setuptools
    for the build. The project itself is installed by pip from a copy of its sources (`pyproject.toml`,
    `README.md`, `imba/`) with `--no-deps --no-index --no-build-isolation`: nothing is downloaded, and pip builds
    and installs the wheel exactly as `pip install imba-dit` would. `--no-deps` only stops pip from fetching torch;
    the test then reads the installed metadata to check that torch is the one unconditional requirement, so a
    heavy dependency moved back into `dependencies` fails it as surely as an import of one in `imba`.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=300, env=_clean_env()).stdout.strip()
    links = torch_only_folder(tmp_path / "torch-only")
    (Path(purelib) / "torch_only.pth").write_text(f"{links}\n")

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "imba", source / "imba", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--no-cache-dir", "--disable-pip-version-check", str(source)],
        capture_output=True, text=True, timeout=300, env=_clean_env())
    assert install.returncode == 0, install.stdout + install.stderr

    proc = subprocess.run([str(python), "-c", LIGHT_RUN], cwd=tmp_path, env=_clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
