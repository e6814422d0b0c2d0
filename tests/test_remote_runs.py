"""Real runs of train.py on a mix of a local source and one on an S3 server on 127.0.0.1 (moto), balanced by concepts
and read two shards at a time: 2 processes, then 1, killed with SIGKILL after a checkpoint and resumed, end with the
parameters of the same runs without the kill and train on the samples one uninterrupted process draws; each remote
shard is downloaded once while it fits the cache; no credential is written anywhere. A store that dies mid-run (the
fault proxy refusing) ends the run in one line with the requeue exit status and a checkpoint that resumes to the
uninterrupted run's parameters once the store is back; restarted with the store down, a run trains from the complete
copies in its cache."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.synthetic import write_synthetic_shards
from remote_servers import CREDENTIALS, S3Server
from test_distributed import digests, launch_command, launch_env
from test_weighted_runs import global_stream, kill_after_checkpoint

REPO = Path(__file__).resolve().parents[1]
COMMON = ["data.resolution=64", "data.batch_size=2", "model.preset=tiny", "train.log_every=1", "train.sample_every=0",
          "train.val_every=0", "sample.steps=2", "sample.prompts=[a red circle]", "optim.warmup_steps=2",
          "train.trackers=none"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two sources' features, precomputed once by a short local run: `big` stays local, `small` goes to S3."""
    root = tmp_path_factory.mktemp("remote_runs")
    write_synthetic_shards(root / "big", num_samples=30, samples_per_shard=16, resolution=64, seed=1)
    write_synthetic_shards(root / "small", num_samples=10, samples_per_shard=4, resolution=64, seed=2)
    made = root / "made"
    sources = (f"data.sources=[{{shards: {root / 'big'}, name: big}}, {{shards: {root / 'small'}, name: small}}]")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), f"train.output_dir={made}", *COMMON, sources,
                           "data.precompute=true", "train.max_steps=1"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    server = S3Server()
    server.xdg = str(root / "xdg")
    small = made / "features" / "train-1-small"
    server.upload("features", "small", sorted(str(p) for p in small.iterdir() if p.is_file()))
    yield server, made / "features" / "train-0-big"
    server.close()


def run_args(big: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    return [str(REPO / "train.py"), f"train.output_dir={out}", *COMMON, "data.precompute=false",
            f"data.sources=[{{shards: {big}, share: 0.7, name: big}}, {{shards: 's3://features/small/*.tar', "
            f"share: 0.3, name: small}}]", "data.epoch_samples=10", "data.balance=temperature",
            f"data.cache_dir={cache}", "data.record_draws=true", "data.shard_window=2", *extra]


def env(server: S3Server) -> dict:
    # XDG_CACHE_HOME: the listings and small files kept for a store that does not answer, under the test's folder
    return {**os.environ, **server.env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": server.xdg}


def run(args, cwd, server, processes: int = 1) -> str:
    command = [*launch_command("ddp", processes)] if processes > 1 else [sys.executable]
    extra = {"ACCELERATE_USE_CPU": "true"} if processes > 1 else {}
    proc = subprocess.run([*command, *args], cwd=cwd, env={**launch_env(extra), **env(server)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "Error" in line)[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_local_and_an_s3_source_balanced_on_2_then_1_process_with_a_kill_train_on_one_process_stream(
        store, tmp_path, monkeypatch):
    server, big = store
    for key, value in {**server.env, "XDG_CACHE_HOME": server.xdg}.items():
        monkeypatch.setenv(key, value)  # kill_after_checkpoint's process reads the store too
    out, cache = tmp_path / "run", tmp_path / "cache"
    two = run(run_args(big, out, cache, "train.max_steps=3"), tmp_path, server, processes=2)
    assert "small: 10 samples, 30.0% of the draws" in two and "balanced by concepts" in two
    ranks = digests(two)
    assert set(ranks) == {0, 1} and ranks[0] == ranks[1]
    uninterrupted = tmp_path / "uninterrupted"  # the same 2-process start, then 1 process with no kill
    shutil.copytree(out, uninterrupted)
    killed, k = kill_after_checkpoint(run_args(big, out, cache, "train.max_steps=40", "train.save_every=5"),
                                      tmp_path, out, 5)
    assert killed == -signal.SIGKILL
    resumed = run(run_args(big, out, cache, f"train.max_steps={k + 2}"), tmp_path, server)
    position = 12 + (k - 3) * 2
    assert f"data: the stream continues after {position} samples" in resumed
    stream = global_stream(out, 2)
    assert len(stream) == position + 4
    chain = run(run_args(big, uninterrupted, cache, f"train.max_steps={k + 2}"), tmp_path, server)
    assert digests(resumed) == digests(chain)  # killed and resumed: the uninterrupted run's parameters, bitwise

    full = tmp_path / "full"
    run(run_args(big, full, cache, f"train.max_steps={(position + 4) // 2}"), tmp_path, server)
    assert stream == global_stream(full, 1)  # nothing replayed, nothing skipped, after a kill and on 2 then 1
    small = [p for p in server.faults.requests if p[1].endswith(".tar")]
    assert len(small) >= 3 and all(server.faults.gets(path) == 1 for _, path in small)  # downloaded once
    secret = CREDENTIALS["AWS_SECRET_ACCESS_KEY"].encode()
    for root, _, files in os.walk(tmp_path):
        for name in files:
            assert secret not in (Path(root) / name).read_bytes(), name


@pytest.mark.slow
def test_a_store_that_dies_mid_run_ends_it_in_one_line_with_a_checkpoint_that_resumes_once_it_is_back(
        store, tmp_path):
    from fault_proxy import FaultProxy
    from imba.training.preemption import REQUEUE_EXIT_CODE

    server, _ = store
    proxy = FaultProxy(server.endpoint)
    environment = {**env(server), "AWS_ENDPOINT_URL": proxy.url}

    def args(out: Path, *extra: str) -> list[str]:  # nothing stays in the cache: a shard read is a download
        return [str(REPO / "train.py"), f"train.output_dir={out}", *COMMON, "data.precompute=false",
                "data.shards=s3://features/small/*.tar", f"data.cache_dir={tmp_path / out.name}-cache",
                "data.cache_limit=1", "data.store_timeout=3", "train.max_steps=8", *extra]

    def trained(out: Path) -> int:
        metrics = out / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    try:
        # this run's cache keeps every shard: it is restarted below with the store down
        full = subprocess.run([sys.executable, *args(tmp_path / "full"), "data.cache_limit=0"], cwd=tmp_path,
                              env=environment, capture_output=True, text=True, timeout=600)
        assert full.returncode == 0, full.stderr[-3000:]
        died = tmp_path / "died"
        proc = subprocess.Popen([sys.executable, *args(died)], cwd=tmp_path, env=environment, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while trained(died) < 3:  # the store dies once the run has trained 3 steps
            assert proc.poll() is None and time.monotonic() < deadline, "timed out before step 3"
            time.sleep(0.02)
        proxy.set("refuse")
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == REQUEUE_EXIT_CODE, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and re.fullmatch(r"error: s3://features/small/\S+\.tar: store unreachable for 3 s "
                                                 r"\(.+\)", errors[0]), errors
        assert "Traceback" not in output
        assert (died / "checkpoints" / "latest").is_file()
        proxy.heal()  # the store is back: the requeued run resumes to the uninterrupted run's parameters
        resumed = subprocess.run([sys.executable, *args(died)], cwd=tmp_path, env=environment, capture_output=True,
                                 text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert digests(resumed.stdout + resumed.stderr) == digests(full.stdout + full.stderr) != {}
        # restarted while the store is down, with every shard complete in its cache: it trains from the cache,
        # within data.store_timeout (the glob's listing too), saying so
        proxy.set("refuse")
        later = subprocess.run([sys.executable, *args(tmp_path / "full"), "data.cache_limit=0", "train.max_steps=10"],
                               cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
        assert later.returncode == 0, later.stderr[-3000:]
        said = later.stdout + later.stderr
        assert "using its last listing" in said and "of them read from their complete copies in" in said, said[-3000:]
        # where the shards go and how many samples they hold, said at start-up
        assert f"data: shards on object storage are downloaded once into {tmp_path / 'full-cache'} (no " in said
        assert re.search(r"^data: \d+ samples in 3 shards$", said, re.M), said[-3000:]
        assert len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()) == 10
    finally:
        proxy.close()
