"""Benchmarks that read the compressed cache: perplexity, RULER (own generator) and lm-eval tasks.

Each is a :class:`~kvcomp.benchmarks.base.Benchmark`: ``check`` looks for its data before the model loads, ``prepare`` builds its data once per run (token windows, prompts, task
objects), ``evaluate`` measures one codec and returns metric rows, ``fingerprint`` identifies what the
rows depend on (the runner caches the uncompressed reference rows under it).
"""

from __future__ import annotations

import importlib
import pkgutil

from kvcomp.benchmarks.base import BENCHMARKS, Benchmark

for _module in pkgutil.iter_modules(__path__):  # importing a module registers the benchmarks it defines
    importlib.import_module(f"{__name__}.{_module.name}")


def build_benchmark(config) -> Benchmark:
    """The benchmark for a validated benchmark config (``config.name`` picks it; an unknown one is a
    :class:`~kvcomp.errors.ConfigError`)."""
    return BENCHMARKS[config.name](config)
