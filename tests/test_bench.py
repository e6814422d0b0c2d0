"""The benchmark scripts stay runnable: each runs its smallest mode and prints its table (no timing asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(script, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_cpu_step_time_benchmark_prints_all_modes():
    out = run("step_time.py", "--steps", "1", "--warmup", "0", "--latent-size", "8")
    for mode in ("plain", "imba_literal", "imba_efficient"):
        assert f"| {mode} |" in out
    assert "| plain | " in out and "1.00×" in out


GPU_CHECK_PARTS = ["install", "imports", "sdpa", "eager", "compiled", "eager_ckpt", "px512", "grid", "compiled_ckpt"]


@pytest.mark.slow
def test_gpu_benchmark_times_the_trainers_step_and_ema_on_a_loader(tmp_path, monkeypatch):
    """In this process, so that the trainer's own TrainStep and EMA update are seen being called, once per step."""
    from accelerate.state import AcceleratorState
    from diffusers.training_utils import EMAModel

    from imba.training.step import TrainStep

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    calls = {"step": 0, "ema": 0}
    step_call, ema_step = TrainStep.__call__, EMAModel.step

    def counted_step(self, *args, **kwargs):
        calls["step"] += 1
        return step_call(self, *args, **kwargs)

    def counted_ema(self, *args, **kwargs):
        calls["ema"] += 1
        return ema_step(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "__call__", counted_step)
    monkeypatch.setattr(EMAModel, "step", counted_ema)
    import gpu_benchmark

    results, table = tmp_path / "results.json", tmp_path / "results.md"
    try:
        assert gpu_benchmark.main(["--device", "cpu", "--preset", "tiny", "--resolution", "64", "--steps", "2",
                                   "--warmup", "1", "--no-flop-check", "--text-tokens", "12", "--caption-channels",
                                   "64", "--samples", "16", "--features", str(tmp_path / "features"),
                                   "--json", str(results), "--out", str(table)]) == 0
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert calls == {"step": 9, "ema": 9}  # 3 modes × (1 warm-up + 2 timed steps), none skipped
    r = json.loads(results.read_text())
    assert r["kernels"] == {"adamw": {"fused": None, "foreach": True}, "ema_foreach": True}
    rows = {row["mode"]: row for row in r["results"]}
    assert list(rows) == ["plain", "literal", "efficient"]
    for row in rows.values():
        assert row["batch"] == 4 and row["steps"] == 2 and row["skipped_steps"] == 0 and row["peak_bytes"] is None
        assert row["graphs_compiled"] == 0  # eager
        assert row["images_per_s"] == pytest.approx(4 / row["median_s"], rel=1e-12)
        assert min(row["step_median_s"], row["loader_median_s"], row["input_median_s"]) > 0
        assert 0 < row["mfu"] < 1 and row["tflops"] == pytest.approx(row["mfu"] * 989, rel=1e-12)
    assert rows["plain"]["ratio_vs_plain"] == 1.0
    assert r["ratios"] == {"literal_vs_plain": rows["literal"]["ratio_vs_plain"],
                           "efficient_vs_plain": rows["efficient"]["ratio_vs_plain"]}
    # a plain step is 3 forward passes of B rows, literal IMBA 6, efficient 3 + λ = 3.9 in expectation
    flops = {m: row["tflops"] * row["median_s"] for m, row in rows.items()}
    assert flops["literal"] / flops["plain"] == pytest.approx(2.0) and flops["efficient"] / flops["plain"] == \
        pytest.approx(1.3)
    written = table.read_text()
    assert "| mode | batch | images/s | step ms | loader wait ms | input ms |" in written and "| n/a |" in written


def gpu_check(tmp_path, **env):
    environment = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out"),
                   "GPU_CHECK_WORK": str(tmp_path / "work"), **env}
    try:
        proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--cpu"], cwd=tmp_path, env=environment,
                              capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired as err:
        raise AssertionError("bench/gpu_check.sh --cpu timed out after an hour") from err
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = [line.split("\t") for line in (out / "parts.tsv").read_text().splitlines()]
    assert rows[0] == ["part", "status", "seconds", "budget"]
    assert [row[0] for row in rows[1:]] == GPU_CHECK_PARTS
    return out, {row[0]: row[1] for row in rows[1:]}


def test_gpu_check_skips_the_parts_its_budget_leaves_no_time_for(tmp_path):
    out, status = gpu_check(tmp_path, GPU_CHECK_BUDGET="3")
    assert set(status.values()) == {"skipped: the 3 s budget is spent"}
    summary = (out / "gpu_check.md").read_text()
    assert "| grid | skipped: the 3 s budget is spent | 0 | 90 |" in summary


@pytest.mark.slow
def test_gpu_check_runs_every_part_in_its_cpu_mode(tmp_path):
    # a busy machine: five times each part's budget, and time for all of them
    out, status = gpu_check(tmp_path, GPU_CHECK_SCALE="5", GPU_CHECK_BUDGET="3000")
    assert status == dict.fromkeys(GPU_CHECK_PARTS, "ok"), status
    assert "nothing to install" in (out / "install.log").read_text()
    imports = json.loads((out / "imports.json").read_text())
    assert imports["train.py imports"] == "ok" and not any("FAILED" in v for v in imports["modules"].values())
    roles = {c["role"]: c for c in json.loads((out / "sdpa.json").read_text())["calls"]}
    cross = roles["cross-attention (caption mask)"]
    assert cross["key_tokens"] == 12 and cross["mask"] and cross["dispatched_ops"]
    assert cross["forced_backends"]["MATH"] == "runs" and "self-attention" in roles
    for name, modes in [("eager", ["plain", "efficient", "literal"]), ("compiled", ["plain", "efficient", "literal"]),
                        ("eager_ckpt", ["plain", "efficient", "literal"]), ("px512", ["efficient"]),
                        ("compiled_ckpt", ["plain", "efficient", "literal"])]:
        r = json.loads((out / f"{name}.json").read_text())
        assert [row["mode"] for row in r["results"]] == modes
        assert r["settings"]["gradient_checkpointing"] == name.endswith(("ckpt", "512"))
        assert r["settings"]["compile"] == name.startswith("compiled") and r["compiled"] is False  # CPU mode
        assert {row["graphs_compiled"] for row in r["results"]} == {0}
    assert json.loads((out / "px512.json").read_text())["settings"]["resolution"] == 128
    grid = json.loads((out / "grid.json").read_text())
    assert grid["exit_code"] == 0 and "samples/step_0000002.png" in grid["grid_images"]
    assert [g["step"] for g in grid["grids"] if g["seconds"] > 0.01] == [2]
    assert not (tmp_path / "work" / "grid_run").exists()  # the grid run's checkpoint and export are deleted
    summary = (out / "gpu_check.md").read_text()
    for heading in ("| part | status |", "## SDPA kernels", "## Training step", "## Grid at step 2"):
        assert heading in summary


@pytest.mark.slow
def test_loader_throughput_smoke_mode_reports_consistent_rates_and_ratios(tmp_path):
    import statistics

    results = tmp_path / "results.json"
    out = run("loader_throughput.py", "--smoke", "--cache-dir", str(tmp_path / "cache"), "--out", str(results))
    r = json.loads(results.read_text())
    assert r["benchmark"] == "loader_throughput" and r["warm_cache"] is True
    assert {"settings", "data", "environment", "results", "ratios"} <= set(r)
    settings = r["settings"]
    assert settings["smoke"] is True and settings["num_workers"] == [0, 1]
    for kind in ("precomputed_shards", "image_shards"):  # 32 synthetic samples, none bad, all read raw and indexed
        assert r["data"][kind]["samples_in_tars"] == r["data"][kind]["indexed_samples"] == 32

    rows = {row["name"]: row for row in r["results"]}
    assert list(rows) == ["raw_tar_precomputed", "precomputed_loader_w0", "precomputed_loader_w1",
                          "raw_tar_image", "image_loader_w0", "image_loader_w1"]
    for row in rows.values():
        assert len(row["samples_per_s"]) == settings["repeats"] and min(row["samples_per_s"]) > 0
        assert row["median_samples_per_s"] == pytest.approx(statistics.median(row["samples_per_s"]), rel=1e-12)
        raw = rows[f"raw_tar_{row['data']}"]
        assert row["ratio_to_raw"] == pytest.approx(row["median_samples_per_s"] / raw["median_samples_per_s"],
                                                    rel=1e-12)
        if row["kind"] == "raw":
            assert row["samples_per_run"] == 32 and row["workers"] is None
        else:  # whole batches only
            assert row["samples_per_run"] == r["data"][f"{row['data']}_shards"]["timed_samples_per_loader_run"]
            assert row["samples_per_run"] % settings["batch_size"] == 0
    for w in ("0", "1"):
        pre, img = rows[f"precomputed_loader_w{w}"], rows[f"image_loader_w{w}"]
        assert r["ratios"]["precomputed_vs_raw"][w] == pre["ratio_to_raw"]
        assert r["ratios"]["image_vs_raw"][w] == img["ratio_to_raw"]
        assert r["ratios"]["precomputed_vs_image"][w] == pre["speedup_over_image_loader"] == pytest.approx(
            pre["median_samples_per_s"] / img["median_samples_per_s"], rel=1e-12)

    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| set | cache | reader | data | workers |"))
    table = lines[header + 2 : header + 8]
    assert all(line.split("|")[1:3] == [" default ", " warm "] for line in table)
    assert [line.split("|")[3].strip() for line in table] == [
        "raw tar read", "precomputed loader", "precomputed loader",
        "raw tar read", "image loader (decode + resize)", "image loader (decode + resize)"]
    assert all(line.split("|")[9].strip() == "1.000×" for line in (table[0], table[3]))
    assert "WARM page cache" in out

    # the .npy decoding comparison runs on the set the loader benchmark wrote
    decode = run("npy_decode.py", "--precomputed", r["data"]["precomputed_dir"], "--rounds", "1", "--batches", "1")
    assert "decode, µs per sample (2 arrays): np.load" in decode and "precomputed loader, 0 workers" in decode


@pytest.mark.slow
def test_loader_throughput_real_size_mode_times_each_set_warm_and_cold(tmp_path):
    import json

    results = tmp_path / "results.json"
    run("loader_throughput.py", "--real-size", "--smoke", "--cold", "--cache-dir", str(tmp_path / "cache"),
        "--out", str(results))
    r = json.loads(results.read_text())
    assert r["caches"] == ["warm", "cold"] and r["warm_cache"] is False and r["settings"]["real_size"] is True
    assert set(r["data"]) == {"32px-float16", "32px-int8"}
    for group, described in r["data"].items():  # SD-VAE latents and 4,096-wide T5 states, as written
        assert described["latent_shape"] == [2, 4, 4, 4] and described["text_hidden_size"] == 4096
        assert described["text_dtype"] == group.split("-")[1]
        assert described["precomputed_shards"]["indexed_samples"] == 32
    per_sample = {g: d["precomputed_shards"]["bytes_per_sample"] for g, d in r["data"].items()}
    assert per_sample["32px-int8"] < 0.6 * per_sample["32px-float16"]
    rows = {row["name"]: row for row in r["results"]}
    for group in r["data"]:
        for prefix in (f"{group}/", f"{group}/cold/"):
            raw = rows[f"{prefix}raw_tar_precomputed"]
            for w in (0, 1):
                loader = rows[f"{prefix}precomputed_loader_w{w}"]
                assert loader["ratio_to_raw"] == pytest.approx(
                    loader["median_samples_per_s"] / raw["median_samples_per_s"], rel=1e-12)
                assert r["ratios"]["precomputed_vs_raw"][f"{prefix}{w}"] == loader["ratio_to_raw"]
    assert r["text_state_errors"]["float16"]["relative_rms_error"] < 1e-3
    assert r["text_state_errors"]["int8"]["bytes_per_token"] == 4100


@pytest.mark.slow
def test_toy2d_experiment_runs_as_a_script_from_the_repo_root(tmp_path):
    out = run("toy2d.py", "--steps", "2", "--seeds", "0", "--variants", "plain_balanced", "imba_cond",
              "--plot-samples", "50", "--out-dir", str(tmp_path))
    assert "| steps | plain_balanced | imba_cond |" in out
    assert "python bench/toy2d.py" in (tmp_path / "toy2d_results.md").read_text()
    assert (tmp_path / "toy2d.png").stat().st_size > 1000


@pytest.mark.slow
def test_balance_cost_smoke_mode_times_each_stage_in_its_own_process(tmp_path):
    import json

    out = tmp_path / "cost.json"
    printed = run("balance_cost.py", "--smoke", "--cache-dir", str(tmp_path / "cache"), "--out", str(out))
    r = json.loads(out.read_text())
    w = r["weights"]
    assert w["samples"] == 20_000 and w["entries"] > 1000 and w["entry_occurrences"] > w["samples"]
    assert w["total_s"] >= w["extract_s"] > 0 and w["self_mb"] > 0 and w["workers_mb"] > 0  # 2 worker processes
    assert [s["samples"] for s in r["sampler"]] == [1_000, 10_000]
    assert all(s["batch_ms_median"] > 0 for s in r["sampler"])
    assert "weights of 20,000 captions" in printed
    (c,) = r["clusters"]
    assert c["samples"] == 2_000 and c["clusters"] == 45 and c["kmeans_s"] > 0
    assert "image clusters of 2,000 samples: k-means into 45" in printed
    captions = (tmp_path / "cache" / "captions-20000.txt").read_text().splitlines()
    assert len(captions) == 20_000 and len(set(captions)) > 10_000  # a long tail, not a handful of templates


@pytest.mark.slow
def test_loader_throughput_weighted_stream_is_timed_against_the_uniform_order(tmp_path):
    import json

    results = tmp_path / "results.json"
    run("loader_throughput.py", "--smoke", "--weighted", "--cache-dir", str(tmp_path / "cache"), "--out",
        str(results))
    r = json.loads(results.read_text())
    rows = {row["name"]: row for row in r["results"]}
    for w in (0, 1):
        weighted, uniform = rows[f"precomputed_weighted_w{w}"], rows[f"precomputed_loader_w{w}"]
        assert weighted["ratio_to_uniform"] == pytest.approx(
            weighted["median_samples_per_s"] / uniform["median_samples_per_s"], rel=1e-12)
        assert r["ratios"]["weighted_vs_raw"][str(w)] == weighted["ratio_to_raw"]
    plans = list((tmp_path / "cache").glob("plan-*/draws.json"))
    assert len(plans) == 1
    assert [s["share"] for s in json.loads(plans[0].read_text())["sources"]] == pytest.approx([0.3, 0.7])


@pytest.mark.slow
def test_remote_loader_reads_each_design_and_counts_its_downloads(tmp_path):
    out = tmp_path / "remote.json"
    printed = run("remote_loader.py", "--samples", "32", "--samples-per-shard", "8", "--repeats", "1",
                  "--latency-ms", "0", "--windows", "1", "--data", str(tmp_path / "features"), "--out", str(out))
    assert "4 shards, 32 samples" in printed
    rows = {r["design"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["raw", "indexed, cold cache", "indexed, warm cache", "small cache, global shuffle",
                          "small cache, window 1"]
    size = rows["raw"]["mb_per_sample"]
    assert rows["indexed, cold cache"]["mb_per_sample"] == size  # each shard once: the index pass
    assert rows["indexed, warm cache"]["mb_per_sample"] == 0
    # a cache of one shard: the window reads each shard about once more, the global shuffle far more often
    assert size < rows["small cache, window 1"]["mb_per_sample"] < rows["small cache, global shuffle"]["mb_per_sample"]
    assert rows["small cache, window 1"]["shuffle_quality"] < rows["small cache, global shuffle"]["shuffle_quality"]
    assert all(r["samples_per_s"] > 0 for r in rows.values())


@pytest.mark.parametrize("study", ["default_balance_seeds", "default_balance"])
def test_a_default_run_study_writes_its_committed_table_again_from_its_record(tmp_path, monkeypatch, capsys, study):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import default_balance

    (tmp_path / "results.json").write_bytes((REPO / "bench" / study / "results.json").read_bytes())
    assert default_balance.main(["--report", "--out", str(tmp_path)]) == 0
    committed = (REPO / "bench" / study / "results.md").read_text()
    assert (tmp_path / "results.md").read_text() == committed and capsys.readouterr().out == committed
    assert not (tmp_path / "runs").exists()  # nothing trained
