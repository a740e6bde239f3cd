"""Benchmarks that read the compressed cache: perplexity, RULER (own generator) and lm-eval tasks.

Each is a :class:`~kvcomp.benchmarks.base.Benchmark`: ``check`` looks for its data before the model loads, ``prepare`` builds its data once per run (token windows, prompts, task
objects), ``evaluate`` measures one codec and returns metric rows, ``fingerprint`` identifies what the
rows depend on (the runner caches the uncompressed reference rows under it).
"""

from __future__ import annotations

from kvcomp.benchmarks.base import Benchmark
from kvcomp.benchmarks.configs import BENCHMARKS
from kvcomp.errors import unknown_choice


def build_benchmark(config) -> Benchmark:
    """The benchmark for a validated benchmark config (``config.name`` picks it)."""
    if config.name not in BENCHMARKS:
        raise unknown_choice("benchmark", config.name, BENCHMARKS)
    if config.name == "perplexity":
        from kvcomp.benchmarks.perplexity import PerplexityBenchmark as cls
    elif config.name == "ruler":
        from kvcomp.benchmarks.ruler import RulerBenchmark as cls
    else:
        from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark as cls
    return cls(config)
