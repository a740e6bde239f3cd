"""Sweeps at scale: launcher configs, GPU leases of local parallel members, aggregation and pictures."""

import csv
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvcomp.config import LoggerConfig, register_configs
from kvcomp.parallel import lease_gpu, member_threads, parallel_jobs, register_resolver
from kvcomp.plots import family, pick_metric, rate_distortion, read_rows, write_rate_distortion, x_value
from kvcomp.results import write_failure, write_json_atomic
from kvcomp.sweep import aggregate, member_placement

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "experiments" / "qjl" / "results" / "embedded_perplexity.csv"


def _hydra(*overrides):
    register_configs()
    register_resolver()  # as run.py (through kvcomp.sweep) does
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_slurm_launcher_fields_are_overridable_and_the_8gpu_node_extends_it():
    slurm = _hydra("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=proj",
                   "hydra.launcher.timeout_min=30").hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher")
    assert (slurm.partition, slurm.account, slurm.timeout_min, slurm.gpus_per_node) == ("gpu", "proj", 30, 1)
    assert slurm.cpus_per_task and slurm.mem_gb
    node = _hydra("hydra/launcher=slurm_8gpu").hydra.launcher
    assert node._target_.endswith("SlurmLauncher") and node.gpus_per_node == 8 and node.mem_gb > slurm.mem_gb


def test_local_parallel_defaults_to_one_member_per_gpu_or_two_on_cpu(monkeypatch):
    launcher = _hydra("hydra/launcher=local_parallel").hydra.launcher
    assert launcher._target_.endswith("JoblibLauncher")
    import torch

    if not torch.cuda.is_available():
        assert OmegaConf.to_container(launcher, resolve=True)["n_jobs"] == 2 == parallel_jobs()
    assert _hydra("hydra/launcher=local_parallel", "hydra.launcher.n_jobs=3").hydra.launcher.n_jobs == 3
    assert member_threads(2) == max(1, __import__("os").cpu_count() // 2) and member_threads(64) == 1


def test_gpu_leases_are_exclusive_and_a_member_waits_for_a_free_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr("kvcomp.parallel.lock_dir", lambda: tmp_path)
    gpus = ["3", "GPU-uuid-b"]
    with lease_gpu(gpus) as first, lease_gpu(gpus) as second:
        assert {first, second} == {0, 1}
        got = []
        waiter = threading.Thread(target=lambda: got.append(_lease_once(gpus)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got  # both GPUs are held: the third member waits
    waiter.join(5)
    assert got and got[0] in (0, 1)
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        with lease_gpu([]):
            pass


def _lease_once(gpus):
    with lease_gpu(gpus, poll_seconds=0.05) as index:
        return index


def test_a_cpu_member_takes_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = OmegaConf.create({"hardware": {"device": "cpu", "threads": 0, "device_map": None}})
    with member_placement(cfg, 64):
        import os

        assert os.environ["OMP_NUM_THREADS"] == "1"


def test_a_member_spread_over_gpus_leases_none(monkeypatch):
    monkeypatch.setattr("kvcomp.sweep.lease_gpu", lambda: pytest.fail("a device_map member must not lease one GPU"))
    cfg = OmegaConf.create({"hardware": {"device": "cuda", "threads": 0, "device_map": "auto"}})
    with member_placement(cfg, 2):
        pass


ROWS = [
    {"model": "m", "benchmark": "ppl 4x64", "codec": "fp16()", "bits_per_value": 16.0, "ppl_streaming": 10.0},
    {"model": "m", "benchmark": "ppl 4x64", "codec": "kivi(bits=2)", "bits_per_value": 3.0, "ppl_streaming": 14.0},
    {"model": "m", "benchmark": "ppl 4x64", "codec": "kivi(bits=4)", "bits_per_value": 5.0, "ppl_streaming": 10.5},
    {"model": "m", "benchmark": "ppl 4x64", "codec": "kvtc(cr=16)", "bits_per_value": 0.9, "cr": 17.5, "ppl_streaming": 11.0},
    {"model": "m", "benchmark": "ruler 2k", "codec": "kivi(bits=2)", "bits_per_value": 3.0, "acc_avg": 40.0},
    {"model": "m", "benchmark": "ppl 4x64", "codec": "qjl()", "status": "failed", "error": "boom"},
]


def test_rate_distortion_draws_a_line_per_family_and_the_reference_flat():
    assert family("kivi(bits=2, group_size=32)") == "kivi" and family("fp16()") == "fp16"
    assert x_value(ROWS[3], "cr") == 17.5 and x_value(ROWS[1], "cr") == pytest.approx(16 / 3)
    assert pick_metric(ROWS, None) == "ppl_streaming"
    with pytest.raises(ValueError, match="valid: ppl_streaming, acc_avg"):
        pick_metric(ROWS, "score_avg")
    figure = rate_distortion(ROWS, "bits")
    (ax,) = [a for a in figure.axes if a.get_visible()]  # one (model, benchmark) pair holds the metric
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"fp16 (10)", "kivi", "kvtc"}
    assert list(lines["kivi"].get_xdata()) == [3.0, 5.0] and list(lines["kivi"].get_ydata()) == [14.0, 10.5]
    assert set(lines["fp16 (10)"].get_ydata()) == {10.0} and ax.get_yscale() == "log"
    ruler = rate_distortion(ROWS, "cr", "acc_avg")
    (ax,) = [a for a in ruler.axes if a.get_visible()]
    assert [line.get_label() for line in ax.get_lines()] == ["kivi"] and ax.get_yscale() == "linear"
    with pytest.raises(ValueError, match="x='ratio' is unknown"):
        rate_distortion(ROWS, "ratio")
    assert rate_distortion([ROWS[-1]]) is None


def test_aggregate_writes_summary_and_plot_and_counts_failures(tmp_path, monkeypatch):
    for i, row in enumerate(ROWS[1:3]):
        write_json_atomic(tmp_path / f"m{i}" / "results.json",
                          {"overrides": [f"codec.bits={2 + 2 * i}"], "rows": [{**ROWS[0], "reference_key": "r"}, row]})
    assert aggregate(tmp_path) == 0
    for name in ("summary.md", "summary.csv", "rate_distortion.png", "rate_distortion.svg"):
        assert (tmp_path / name).stat().st_size > 0
    assert "<svg" in (tmp_path / "rate_distortion.svg").read_text()
    assert len(read_rows(tmp_path)) == 3 and not list(tmp_path.glob(".*tmp*"))
    write_failure(tmp_path / "m2", {"codec": {"name": "qjl"}}, ["codec=qjl"], RuntimeError("boom"))
    assert aggregate(tmp_path, y="ppl_streaming") == 1
    with open(tmp_path / "summary.csv", newline="") as handle:
        assert sum(row["status"] == "failed" for row in csv.DictReader(handle)) == 1


def test_aggregate_logs_the_plot_to_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    write_json_atomic(tmp_path / "m0" / "results.json", {"overrides": ["codec.bits=2"], "rows": ROWS[:2]})
    aggregate(tmp_path, OmegaConf.structured(LoggerConfig(name="wandb", mode="offline")))
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run.rglob("rate_distortion_*.png")) and list(run.rglob("results_*.table.json"))


def test_plot_sweep_redraws_committed_results_together(tmp_path):
    other = ROOT / "experiments" / "csr" / "results" / "embedded_ruler.csv"
    rows = read_rows(COMMITTED)
    assert any(family(r["codec"]) == "qjl" for r in rows)
    script = [sys.executable, str(ROOT / "scripts" / "plot_sweep.py")]
    done = subprocess.run([*script, str(COMMITTED), str(other), "--y", "acc_avg", "--x", "cr", "--out", str(tmp_path / "rd")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rd.png").stat().st_size > 10_000 and (tmp_path / "rd.svg").is_file()
    bad = subprocess.run([*script, str(COMMITTED), "--y", "acc_nope", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "metric 'acc_nope' is in no row; valid: ppl_streaming" in bad.stderr
    assert write_rate_distortion(rows, tmp_path / "again") == [tmp_path / "again.png", tmp_path / "again.svg"]


def test_plot_axis_is_checked_with_the_config():
    from kvcomp.errors import ConfigError
    from kvcomp.runner import check_config

    with pytest.raises(ConfigError, match="unknown plot.x 'ratio'; valid choices: bits, cr"):
        check_config(_hydra("plot.x=ratio"))


def test_the_rate_distortion_notebook_is_committed_executed():
    import json

    notebook = json.loads((ROOT / "notebooks" / "rate_distortion.ipynb").read_text())
    outputs = [o for cell in notebook["cells"] if cell["cell_type"] == "code" for o in cell["outputs"]]
    assert all(cell["execution_count"] for cell in notebook["cells"] if cell["cell_type"] == "code")
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4


def test_a_finished_run_stays_finished_when_a_group_gains_a_field_at_its_default():
    """Resuming a sweep: a run recorded before a config field existed is this run when the field is at its default
    (perplexity's context_tokens came later), not when it differs, nor when any recorded value differs."""
    from kvcomp.runner import same_run

    recorded = {"benchmark": {"name": "perplexity", "seq_len": 512}, "codec": {"name": "kivi", "bits": 2}, "seed": 0}
    now = {"benchmark": {"name": "perplexity", "seq_len": 512, "context_tokens": 0}, "codec": {"name": "kivi", "bits": 2},
           "seed": 0}
    assert same_run(recorded, now) and same_run(now, now)
    assert not same_run(recorded, {**now, "benchmark": {**now["benchmark"], "context_tokens": 64}})
    assert not same_run(recorded, {**now, "codec": {"name": "kivi", "bits": 4}})
    assert not same_run(recorded, {**now, "codec": {"name": "kivi", "bits": 2, "not_a_field": 1}})
    assert not same_run(None, now) and not same_run({**recorded, "press": {"name": "knorm"}}, now)
    pressed = {**recorded, "press": {"name": "knorm", "ratio": 0.5}}  # recorded before pressing while decoding existed
    assert same_run(pressed, {**recorded, "press": {"name": "knorm", "ratio": 0.5, "decoding_size": 0, "decoding_interval": 64}})


def test_labels_of_points_in_one_column_are_stacked_apart():
    """Points sharing a bit count (every press at one ratio) get labels at least ``gap`` points apart; a lone point
    keeps its label beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvcomp.plots import log_axis, spread_labels

    fig, ax = plt.subplots()
    points = [(10.0, 20.0 + 0.001 * i, f"press {i}") for i in range(5)] + [(2.0, 30.0, "alone")]
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    log_axis(ax)
    spread_labels(ax, points, gap=7.0)
    offsets = {a.get_text(): a.xyann[1] for a in ax.texts}
    column = sorted(offsets[f"press {i}"] for i in range(5))
    assert all(b - a >= 7.0 - 1e-6 for a, b in zip(column, column[1:])) and offsets["alone"] == 1
    assert ax.yaxis.get_major_formatter().__class__.__name__ == "ScalarFormatter"
    plt.close(fig)


def test_a_damaged_member_file_is_a_failed_member_and_no_member_file_is_skipped(tmp_path):
    """A results.json that cannot be read, is no object or has no rows (a damaged or crafted file), and one whose
    member failed since (its error.json): each a failed row; nothing stale is shown as ok."""
    good = {"overrides": ["codec.bits=2"], "rows": [{**ROWS[1], "reference_key": None}]}
    write_json_atomic(tmp_path / "codec.bits=2" / "results.json", good)
    (tmp_path / "codec.bits=3").mkdir()
    (tmp_path / "codec.bits=3" / "results.json").write_text('{"rows": [')
    write_json_atomic(tmp_path / "codec.bits=4" / "results.json", [1, 2])
    write_json_atomic(tmp_path / "codec.bits=5" / "results.json", {"overrides": []})
    write_json_atomic(tmp_path / "codec.bits=6" / "results.json", {**good, "overrides": ["codec.bits=6"]})
    write_failure(tmp_path / "codec.bits=6", {"codec": {"name": "kivi"}}, ["codec.bits=6"], RuntimeError("boom"))
    assert aggregate(tmp_path) == 4
    with open(tmp_path / "summary.csv", newline="") as handle:
        rows = {row["run_dir"]: row for row in csv.DictReader(handle)}
    assert rows["codec.bits=2"]["status"] == "ok" and rows["codec.bits=6"]["error"] == "RuntimeError: boom"
    assert "is unreadable (JSONDecodeError" in rows["codec.bits=3"]["error"]
    for member in ("codec.bits=4", "codec.bits=5"):
        assert rows[member]["status"] == "failed" and "is not a kvcomp results.json" in rows[member]["error"]


def test_a_sweep_resumed_over_a_damaged_member_and_names_that_look_like_paths(tmp_path):
    """``model.name=../../escaped`` names a member folder inside the sweep's (written ``..%2F..%2Fescaped``); a member
    whose results.json is damaged fails, the summary says so, and the sweep exits 1."""
    from tests.run_py import run_py

    sweep = tmp_path / "a" / "b"
    damaged = sweep / "codec.bits=2,codec=kivi,model.name=..%2F..%2Fescaped" / "results.json"
    damaged.parent.mkdir(parents=True)
    damaged.write_text('{"rows": [')
    result = run_py("-m", "codec=kivi", "codec.bits=2,99", "model.name=../../escaped", f"hydra.sweep.dir={sweep}",
                    cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert all(p.parts[:2] == ("a", "b") for p in written), written
    summary = (sweep / "summary.md").read_text()
    assert "results.json is unreadable (JSONDecodeError" in summary and "bits=99 is not supported" in summary
    assert "kvcomp: 2 sweep member(s) failed" in result.stderr
