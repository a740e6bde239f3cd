"""The benchmark contract (:class:`Benchmark`) and what benchmarks share; below every benchmark module
and the package's :func:`~kvcomp.benchmarks.build_benchmark`, importing none of them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvcomp.registry import Registry


class Benchmark(ABC):
    """One benchmark; ``@register`` makes it buildable under each of :attr:`names`."""

    names: ClassVar[tuple[str, ...]]  # the ``benchmark.name`` values it serves (lm-eval's presets share one)
    config_class: ClassVar[type]  # its config dataclass (:mod:`kvcomp.benchmarks.configs`)

    def __init__(self, config):
        self.config = config

    def check(self, model_cfg) -> None:
        """Cheap checks run before the model loads (e.g. that offline data is present); raise a
        :class:`~kvcomp.errors.KVCompError` naming the problem and the remedy. Default: nothing to check."""

    def check_press(self, press_name: str) -> None:
        """Raise :class:`~kvcomp.errors.ConfigError` before the model loads when this benchmark's settings cannot
        evaluate a press (called after :meth:`check`). Default: every setting can."""

    @abstractmethod
    def prepare(self, model, tokenizer, model_cfg) -> None:
        """Build the data (raises on bad settings before any slow work)."""

    @abstractmethod
    def fingerprint(self) -> dict:
        """JSON-able identity of the prepared data and settings."""

    @abstractmethod
    def evaluate(self, model, codec, press=None, reference: dict | None = None) -> list[dict]:
        """Metric rows for ``codec`` (each names its benchmark under ``"benchmark"``), its caches evicting prompt
        tokens with ``press`` (:mod:`kvcomp.presses`); ``reference``: what :meth:`evaluate_reference` kept, to
        compare with (None: no comparison)."""

    def evaluate_reference(self, model, codec) -> tuple[list[dict], dict]:
        """The uncompressed reference's rows and the tensors (by name) that :meth:`evaluate` compares later rows with,
        cached with the rows. Default: :meth:`evaluate`'s rows, nothing kept."""
        return self.evaluate(model, codec), {}


def example_summary(examples: list[dict]) -> dict:
    """Mean, min and max over examples of each per-example metric (``k``, ``k_min``, ``k_max``)."""
    keys = dict.fromkeys(k for e in examples for k in e)
    out = {}
    for k in keys:
        values = [e[k] for e in examples if k in e]
        out |= {k: sum(values) / len(values), f"{k}_min": min(values), f"{k}_max": max(values)}
    return out


BENCHMARKS = Registry("benchmark", names=lambda cls: cls.names)
register = BENCHMARKS.register  # class decorator: make a benchmark buildable under each of its ``names``
