"""Test-wide settings: never touch the network, stay on the CPU, keep thread counts predictable."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests share the cores with the processes they launch and, under `pytest -n 2`, with another worker: OpenMP
# threads that spin while waiting for work would take those cores from them. Read when torch starts, so here, before
# any test imports it; inherited by every launched process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # train.py is a script at the top level, not a package module
    sys.path.insert(0, str(REPO))


# Tests that run for minutes, longest first. They start first, so that in a parallel run (`pytest -n 2`) no worker
# is left alone with one of them at the end while the other idles.
LONGEST = ("test_default_run.py", "test_slurm.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        return next((i for i, name in enumerate(LONGEST) if name in item.nodeid), len(LONGEST))
    items.sort(key=rank)  # stable: every other test keeps its order
