"""``python run.py ...`` in a subprocess for the integration tests."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# runs share the cores with the other pytest-xdist workers: one thread each then, two when pytest runs alone
THREADS = "2" if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") == "1" else "1"


def run_py(*args, cwd, **env_overrides) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": THREADS, **env_overrides}
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
