"""Sweep members running side by side on one machine (``hydra/launcher=local_parallel``).

Each member holds one GPU of ``CUDA_VISIBLE_DEVICES`` for its lifetime through a file lock per GPU
(:func:`lease_gpu`), so members never share a GPU even when a worker process runs several members
one after another. On CPU each member gets ``cores // n_jobs`` torch threads (:func:`member_threads`).
``${kvcomp_parallel_jobs:}`` (the launcher's default ``n_jobs``) is the number of visible GPUs, or 2
on a machine without CUDA.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

CPU_PARALLEL_JOBS = 2
PARALLEL_LAUNCHER = "JoblibLauncher"


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [name.strip() for name in listed.split(",") if name.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def parallel_jobs() -> int:
    """Members run at once by default: one per visible GPU, else :data:`CPU_PARALLEL_JOBS`."""
    import torch

    return len(visible_gpus()) if torch.cuda.is_available() and visible_gpus() else CPU_PARALLEL_JOBS


def register_resolver() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("kvcomp_parallel_jobs", parallel_jobs, replace=True)


def member_threads(n_jobs: int) -> int:
    """Torch CPU threads for one of ``n_jobs`` members sharing this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, n_jobs))


def lock_dir() -> Path:
    """Where the per-GPU lock files live: this machine's temporary folder, one per user."""
    folder = Path(tempfile.gettempdir()) / f"kvcomp-gpu-locks-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def lease_gpu(gpus: list[str] | None = None, poll_seconds: float = 2.0) -> Iterator[int]:
    """Hold the first free GPU of ``gpus`` (default :func:`visible_gpus`) until the block ends; yield
    its index among them (the ``cuda:<index>`` torch sees). Waits while every GPU is held."""
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        raise RuntimeError("lease_gpu: no GPU is visible (CUDA_VISIBLE_DEVICES is empty or CUDA is missing)")
    waited = False
    while True:
        for index, name in enumerate(gpus):
            handle = open(lock_dir() / f"gpu-{name}.lock", "a")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                log.info("this member runs on GPU %s (cuda:%d)", name, index)
                yield index
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()
            return
        if not waited:
            log.info("all %d GPUs are held by other members; waiting for one", len(gpus))
            waited = True
        time.sleep(poll_seconds)
