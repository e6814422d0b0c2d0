"""Wall time of CPU training steps with OpenMP's idle threads spinning (the default) or sleeping
(OMP_WAIT_POLICY=PASSIVE, what train.py sets unless the variable is set), alone and next to one busy process.

    python bench/omp_wait.py --pairs 4

Each run is a fresh process of `bench/step_time.py --modes plain` (the policy is read when torch loads); the two
policies alternate, pair by pair, so the machine's drift hits both alike; the median wall time of each and the
median of the pairs' ratios are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEP_TIME = Path(__file__).resolve().parent / "step_time.py"


def wall(policy: str | None, steps: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    began = time.perf_counter()
    subprocess.run([sys.executable, str(STEP_TIME), "--modes", "plain", "--steps", str(steps)], env=env,
                   check=True, capture_output=True)
    return time.perf_counter() - began


def measure(pairs: int, steps: int) -> tuple[list[float], list[float]]:
    spinning, sleeping = [], []
    for _ in range(pairs):
        spinning.append(wall(None, steps))
        sleeping.append(wall("PASSIVE", steps))
    return spinning, sleeping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for label, busy in (("alone", False), ("next to one busy process", True)):
        competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            spinning, sleeping = measure(args.pairs, args.steps)
        finally:
            if competitor is not None:
                competitor.kill()
        ratio = statistics.median(a / b for a, b in zip(spinning, sleeping))
        print(f"{label}: default {statistics.median(spinning):.1f} s, PASSIVE {statistics.median(sleeping):.1f} s "
              f"(median wall of {args.pairs}; default / PASSIVE, median of pairs: {ratio:.2f}x)")


if __name__ == "__main__":
    main()
