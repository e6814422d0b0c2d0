"""The run folder's layout (imba/training/run_folder.py): the names are a contract with the runs already on disk
(resume reads checkpoints/, export reads samples/ beside them, the plan and features are reused), so they are
pinned as literals, and the module doc that tells a user where things are lists every one of them."""

import imba.training.run_folder as run_folder
from imba.training.run_folder import CHECKPOINTS_DIR, RunFolder


def test_every_path_of_a_run_folder_is_pinned_under_its_root(tmp_path):
    run = RunFolder(tmp_path / "run")
    paths = {
        "config": run.config, "metrics": run.metrics, "checkpoints": run.checkpoints, "samples": run.samples,
        "grid": run.sample_grid(2500), "export": run.export, "plan": run.plan, "draws": run.draw_log(3),
        "features": run.features("val"), "synthetic_train": run.synthetic_train, "synthetic_val": run.synthetic_val,
        "concept_stats": run.concept_stats, "sources": run.sources,
    }
    relative = {k: p.relative_to(tmp_path / "run").as_posix() for k, p in paths.items()}
    assert relative == {
        "config": "config.yaml", "metrics": "metrics.jsonl", "checkpoints": "checkpoints", "samples": "samples",
        "grid": "samples/step_0002500.png", "export": "export", "plan": "data", "draws": "draws/rank_3.jsonl",
        "features": "features/val", "synthetic_train": "synthetic_shards", "synthetic_val": "synthetic_val",
        "concept_stats": "concepts/concepts.json", "sources": "sources",
    }
    assert CHECKPOINTS_DIR == "checkpoints" and RunFolder(str(tmp_path)).root == tmp_path  # a string root too


def test_the_module_doc_names_every_path():
    doc = run_folder.__doc__
    for name in ("config.yaml", "metrics.jsonl", "checkpoints/step_*/", "samples/step_*.png", "export/", "data/",
                 "draws/rank_<R>.jsonl", "features/{train,val}/", "synthetic_shards/", "synthetic_val/",
                 "concepts/concepts.json", "sources/<i>-<name>/"):
        assert name in doc, name
    # public attribute names (a mutation tool's generated, non-ASCII helper names are not the class's interface)
    public = {n for n in vars(RunFolder) if not n.startswith("_") and n.isascii()} - {"root"}
    assert public == {"config", "metrics", "checkpoints", "samples", "sample_grid", "export", "plan", "draw_log",
                      "features", "synthetic_train", "synthetic_val", "concept_stats", "sources"}  # one test above each
