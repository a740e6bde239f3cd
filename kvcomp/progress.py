"""Progress of long steps (calibration, fitting, evaluation, sweeps) that stays quiet in a SLURM log.

On a terminal :func:`progress` is a tqdm bar. Elsewhere (a log file, a batch job, a pipe) it logs one
line through :mod:`logging` when the step starts, at most one every ``KVCOMP_PROGRESS_INTERVAL``
seconds (default 60) while it runs, and one when it ends. ``KVCOMP_PROGRESS=0`` silences it;
``KVCOMP_PROGRESS=bar`` forces the bar.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

log = logging.getLogger("kvcomp.progress")


def _mode() -> str:
    setting = os.environ.get("KVCOMP_PROGRESS", "").lower()
    if setting in ("0", "off", "false", "none"):
        return "off"
    if setting == "bar" or sys.stderr.isatty():
        return "bar"
    return "log"


class _LogLines:
    """tqdm's ``update`` / ``set_postfix_str`` / ``close`` as sparse log lines."""

    def __init__(self, total: int | None, desc: str, unit: str, mode: str):
        self.total, self.desc, self.unit, self.n, self.postfix = total, desc, unit, 0, ""
        self.enabled = mode == "log"
        self.interval = float(os.environ.get("KVCOMP_PROGRESS_INTERVAL", "60"))
        self.start = self.last = time.perf_counter()
        self.closed = False
        if self.enabled:
            log.info("%s: started (%s %s)", desc, total if total is not None else "?", unit)

    def _line(self, verb: str) -> None:
        elapsed = time.perf_counter() - self.start
        of = f"/{self.total}" if self.total is not None else ""
        extra = f", {self.postfix}" if self.postfix else ""
        log.info("%s: %s %d%s %s in %.0fs%s", self.desc, verb, self.n, of, self.unit, elapsed, extra)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.enabled and now - self.last >= self.interval:
            self.last = now
            self._line("at")

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        if self.enabled and not self.closed:
            self._line("done,")
        self.closed = True


def progress_bar(total: int | None, desc: str, unit: str = "it"):
    """An object with ``update(n)``, ``set_postfix_str(text)`` and ``close()`` (see the module docstring)."""
    mode = _mode()
    if mode == "bar":
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)
    return _LogLines(total, desc, unit, mode)


def progress(iterable: Iterable, desc: str, total: int | None = None, unit: str = "it") -> Iterator:
    """Iterate ``iterable`` while reporting progress (see the module docstring)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    bar = progress_bar(total, desc, unit)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()


@contextmanager
def phase(description: str, timings: dict[str, float] | None = None, key: str | None = None) -> Iterator[None]:
    """Log ``description`` when a step starts and its duration when it ends; with ``timings``, record the
    seconds under ``key``, added to what is there (a phase may run in parts)."""
    log.info("%s ...", description)
    start = time.perf_counter()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        seconds = time.perf_counter() - start
        log.info("%s: %s %.1fs", description, outcome, seconds)
        if timings is not None and key is not None:
            timings[key] = round(timings.get(key, 0.0) + seconds, 2)


def quiet_library_bars() -> None:
    """Silence transformers' own bars (e.g. weight loading) unless bars are shown (see the module docstring)."""
    if _mode() != "bar":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
