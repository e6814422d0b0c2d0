"""What installing the project puts on a user's path: `imba` (the loss with torch alone), and not the repository's
`models/` and `data/` folders, whose names a user's own project may well use."""

import os
import subprocess
import sys

CHECK = """
import importlib.util, sys
import imba
from imba import IMBALoss
loaded = set(sys.modules)
assert not {"diffusers", "transformers", "accelerate", "data", "models"} & loaded, sorted(loaded)
assert all(importlib.util.find_spec(name) is None for name in ("models", "data"))
print("ok")
"""


def test_installed_imba_is_the_loss_alone_and_claims_no_common_names(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_trainer_imported_outside_a_checkout_says_where_it_runs_in_one_line(tmp_path):
    # an editable install (this environment's) finds imba.training from anywhere; data/ and models/ only a
    # checkout's root has: one line saying so, not "No module named 'data'" from deep inside
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", "import imba.training.config"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "ImportError: imba.training is the trainer of a checkout of this repository: run it from the checkout's root "
        "(python train.py, python -m imba.training....), where data/ and models/ are; `pip install .` installs the "
        "loss alone (`from imba import IMBALoss`)")
