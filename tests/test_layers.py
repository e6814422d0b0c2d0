"""The code layout's layers (docs/README.md#code-layout), checked by import-linter with the contracts in
pyproject.toml: they hold for the repository, and the same tool, run on a copy of the project with one violating
import planted, fails and names it. bench/ is a folder of scripts that import each other by file name, which
import-linter cannot resolve; its cycle check builds the import graph with grimp (import-linter's own graph
library), resolves those names, and asks for cycle breakers as import-linter's acyclic_siblings contract does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("imba", "data", "models")  # root_packages of [tool.importlinter]
METHOD = ("imba.loss", "imba.captions", "imba.training_loss", "imba.objectives", "imba.monitor")


def lint_imports(cwd: Path) -> tuple[int, str]:
    """`lint-imports` in `cwd` with that folder's pyproject.toml; no cache folder is written. (exit status, output)"""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    proc = subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo"], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def project_copy(tmp_path: Path) -> Path:
    """The project's packages (their .py files) and pyproject.toml, copied into a folder of their own."""
    root = tmp_path / "project"

    def ignore(folder, names):
        return [n for n in names if n == "__pycache__" or (Path(folder, n).is_file() and not n.endswith(".py"))]

    for package in PACKAGES:
        shutil.copytree(REPO / package, root / package, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_repository_keeps_every_contract():
    status, output = lint_imports(REPO)
    assert status == 0 and " 0 broken" in output, output


# (file of the copy, text appended to it, the broken contract's name as printed, what its report must name)
PLANTED = {
    "models import data, inside a function": (
        "models/_planted.py", "def f():\n    from data.synthetic import COLOURS\n",
        "imba/ over data/ over models/", "models._planted -> data.synthetic"),
    "data imports imba": (
        "data/_planted.py", "import imba.loss\n", "imba/ over data/ over models/", "data._planted -> imba.loss"),
    "models import train.py": (
        "models/_planted.py", "import train\n", "nothing imports train.py", "models._planted -> train"),
    "the loss imports matplotlib, for type checking only": (
        "imba/loss.py", "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import matplotlib\n",
        "the method (loss, captions, training_loss, objectives, monitor)", "imba.loss -> matplotlib"),
    "the monitor imports diffusers": (
        "imba/monitor.py", "\nimport diffusers\n", "of the method, objectives.py alone imports diffusers",
        "imba.monitor -> diffusers"),
    "evaluation imports models": (
        "imba/eval/_planted.py", "from models.vae import load_vae\n", "imba.eval works from files",
        "imba.eval._planted -> models.vae"),
    "the training code builds a sampler itself": (
        "imba/training/inputs.py", "\nfrom data.order import IndexedBatchSampler\n",
        "imba/ reaches the readers and orders through data.stream", "imba.training.inputs -> data.order"),
    "the training code imports a shard writer": (
        "imba/training/inputs.py", "\nimport data.prep.writers\n", "nothing a run reads imports data.prep",
        "imba.training.inputs -> data.prep.writers"),
    "a reader imports an offline tool, inside a function": (
        "data/stream.py", "\n\ndef planted():\n    from .prep.writers import write_folder\n",
        "nothing a run reads imports data.prep", "data.stream -> data.prep.writers"),
    "two data modules import each other": (
        "data/precompute_settings.py", "\nfrom . import precompute\n", "no import cycles",
        "No cycles are allowed in data."),
}


@pytest.mark.parametrize("case", PLANTED)
def test_import_linter_fails_on_a_planted_violation(tmp_path, case):
    path, text, contract, named = PLANTED[case]
    root = project_copy(tmp_path)
    with open(root / path, "a") as f:
        f.write(text)
    status, output = lint_imports(root)
    assert status != 0 and " 1 broken" in output, output
    broken = output.split("Broken contracts")[1]
    assert contract in " ".join(broken.split()) and named in broken, output


def eval_imports_of_data(root: Path) -> set[str]:
    """The modules of data/ that a module of imba.eval imports directly, in the project at `root` (in a process of
    its own, whose `data` and `imba` are that folder's)."""
    code = ("import grimp, sys; g = grimp.build_graph('imba', 'data', 'models', cache_dir=None); "
            "print(*sorted({i for m in {'imba.eval', *g.find_descendants('imba.eval')} "
            "for i in g.find_modules_directly_imported_by(m) if i.split('.')[0] == 'data'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          check=True)
    return set(proc.stdout.split())


def test_evaluation_uses_the_english_words_of_data_and_nothing_else_of_it(tmp_path):
    # The "eval" contract cannot exempt data.text from a forbidden data/, so this is that part of it; data.text
    # itself imports nothing of the project, so nothing else of data/ comes in through it.
    assert eval_imports_of_data(REPO) <= {"data.text"}
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert not {m for m in graph.find_modules_directly_imported_by("data.text") if m.split(".")[0] in PACKAGES}
    root = project_copy(tmp_path)
    (root / "imba" / "eval" / "_planted.py").write_text("from data.concepts import load_stats\n")
    assert "data.concepts" in eval_imports_of_data(root)


def test_method_modules_import_no_package_but_the_standard_library_and_torch():
    # The "method" contract forbids a list of packages and the rest of the project; this is the allowance for what
    # lies outside `imba`, in the same graph.
    graph = grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)
    for module in METHOD:
        allowed = {*sys.stdlib_module_names, "__future__", "torch"}
        if module == "imba.objectives":
            allowed.add("diffusers")  # inside the functions that build a scheduler
        outside = {m for m in graph.find_modules_directly_imported_by(module) if m.split(".")[0] != "imba"}
        assert outside <= allowed, (module, outside - allowed)


# ---- bench/ ---------------------------------------------------------------------------------------------------


def bench_cycle_breakers(package: str) -> set[tuple[str, str]]:
    """Imports whose removal would leave the scripts of `package` (a folder on sys.path) without cycles; empty when
    there is none. A script's `import composition_scenes` (its folder is on sys.path when it runs) is an import of
    the sibling script; grimp sees it as a top-level name and every import statement anywhere in the file."""
    graph = grimp.build_graph(package, include_external_packages=True, cache_dir=None)
    scripts = {module.rpartition(".")[2]: module for module in graph.find_children(package)}
    for module in list(scripts.values()):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported in scripts:
                graph.add_import(importer=module, imported=scripts[imported])
    return graph.nominate_cycle_breakers(package)


def test_bench_scripts_import_each_other_without_cycles():
    assert bench_cycle_breakers("bench") == set()


def test_the_bench_cycle_check_finds_a_script_importing_its_importer(tmp_path, monkeypatch):
    # the cycle this check was written for: composition.py imports composition_diagnostics, whose functions
    # imported composition back (and so loaded composition.py a second time, beside __main__)
    copy = tmp_path / "benchcopy"
    copy.mkdir()
    for script in (REPO / "bench").glob("*.py"):
        shutil.copy(script, copy / script.name)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bench_cycle_breakers("benchcopy") == set()
    with open(copy / "composition_diagnostics.py", "a") as f:
        f.write("\n\ndef planted():\n    from composition import probe_prompts\n")
    breakers = bench_cycle_breakers("benchcopy")
    assert breakers and {m for edge in breakers for m in edge} <= {"benchcopy.composition",
                                                                  "benchcopy.composition_diagnostics"}


def test_the_names_imba_and_data_export_lazily_resolve_to_their_modules():
    # `imba` and `data` import what they export on first use, so that reading a run's settings needs no torch; every
    # public name they exported when they imported it all at once is still there
    import importlib

    public = {
        "imba": ["IMBALoss", "ImbaTrainingLoss", "LossStats", "NullCaption", "PlainTrainingLoss", "TimestepMean",
                 "TrainingLoss", "patchify", "plain_loss", "token_distance"],
        "data": ["assign_buckets", "bucket_sizes", "nearest_bucket", "resize_to_bucket", "BucketBatchSampler",
                 "IndexedBatchSampler", "IndexedLoader", "IndexedShards", "ShardIndex", "batches_per_epoch",
                 "load_or_build_index", "make_indexed_loader", "IMAGE_EXTENSIONS", "expand_urls", "image_to_tensor",
                 "make_image_text_loader", "resize_center_crop", "sample_caption", "to_rgb", "COLOURS",
                 "SAMPLE_PROMPTS", "SHAPES", "make_sample", "write_synthetic_shards"],
    }
    for package, names in public.items():
        module = importlib.import_module(package)
        assert sorted(module.__all__) == sorted(names)
        for name in names:  # resolved through the package's table: a name mapped to the wrong module raises
            assert getattr(module, name) is not None
        with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
            getattr(module, "nothing")
