"""Sweeps through Hydra's launcher plugins on the embedded model: members run in parallel (``local_parallel``)
until the sweep is killed mid-way, and running it again as submitit jobs (``submitit_local``, the SLURM launcher's
local executor) finishes it with every earlier result kept."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
MEMBERS = ["codec=kivi", "codec.bits=2,4,8", "benchmark.num_windows=2", "benchmark.seq_len=128"]
LAUNCHERS = {
    "local_parallel": ["hydra/launcher=local_parallel", "hydra.launcher.n_jobs=2"],
    "submitit_local": ["hydra/launcher=submitit_local"],
}


def _sweep(launcher, sweep_dir, embedded_env):
    command = [sys.executable, str(ROOT / "run.py"), "-m", *LAUNCHERS[launcher], *MEMBERS, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.Popen(command, cwd=sweep_dir.parent, env=embedded_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_killed_sweep_resumes_under_another_launcher_with_nothing_lost(embedded, tmp_path):
    """Members run two at a time (``local_parallel``) until the sweep is killed; run again as submitit jobs
    (``submitit_local``), it finishes with every earlier result kept, not recomputed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVCOMP_PROGRESS": "0"}
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    first = _sweep("local_parallel", sweep_dir, env)
    deadline = time.time() + 600
    while not list(sweep_dir.rglob("results.json")) and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and every member it started
    first.wait()
    assert "n_jobs=2" in first.stdout.read()  # joblib's own line: members ran two at a time
    done = {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.rglob("results.json")}  # complete files only
    assert 1 <= len(done) and not (sweep_dir / "summary.md").exists()

    second = _sweep("submitit_local", sweep_dir, env)
    output, _ = second.communicate(timeout=900)
    assert second.returncode == 0, output[-3000:]
    members = sorted(p.parent.name for p in sweep_dir.rglob("results.json"))
    assert len(members) == 3 and not list(sweep_dir.rglob("error.json"))
    for name, results in done.items():  # kept, not recomputed (timings would differ)
        assert json.loads((sweep_dir / name / "results.json").read_text()) == results
    summary = (sweep_dir / "summary.md").read_text()
    assert summary.count("| kivi(bits=") == 3 and summary.count("| fp16() |") == 1
    assert (sweep_dir / "rate_distortion.png").stat().st_size > 10_000 and (sweep_dir / "rate_distortion.svg").is_file()
    logs = [p.read_text() for p in sweep_dir.glob(".submitit/*/*_log.out")]  # each member ran as a submitit job
    assert len(logs) == 3 and sum(log.count("already holds this run") for log in logs) == len(done), logs
