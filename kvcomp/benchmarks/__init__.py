"""Benchmarks that read the compressed cache: perplexity, RULER (own generator) and lm-eval tasks.

Each is a :class:`Benchmark`: ``check`` looks for its data before the model loads, ``prepare`` builds its data once per run (token windows, prompts, task
objects), ``evaluate`` measures one codec and returns metric rows, ``fingerprint`` identifies what the
rows depend on (the runner caches the uncompressed reference rows under it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvcomp.benchmarks.configs import BENCHMARKS
from kvcomp.errors import unknown_choice


class Benchmark(ABC):
    def __init__(self, config):
        self.config = config

    def check(self, model_cfg) -> None:
        """Cheap checks run before the model loads (e.g. that offline data is present); raise a
        :class:`~kvcomp.errors.KVCompError` naming the problem and the remedy. Default: nothing to check."""

    @abstractmethod
    def prepare(self, model, tokenizer, model_cfg) -> None:
        """Build the data (raises on bad settings before any slow work)."""

    @abstractmethod
    def fingerprint(self) -> dict:
        """JSON-able identity of the prepared data and settings."""

    @abstractmethod
    def evaluate(self, model, codec) -> list[dict]:
        """Metric rows for ``codec`` (each names its benchmark under ``"benchmark"``)."""


def example_summary(examples: list[dict]) -> dict:
    """Mean, min and max over examples of each per-example metric (``k``, ``k_min``, ``k_max``)."""
    keys = dict.fromkeys(k for e in examples for k in e)
    out = {}
    for k in keys:
        values = [e[k] for e in examples if k in e]
        out |= {k: sum(values) / len(values), f"{k}_min": min(values), f"{k}_max": max(values)}
    return out


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
