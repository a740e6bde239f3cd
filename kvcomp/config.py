"""Structured configs: one dataclass per Hydra group (the codec configs live beside their codecs).

The YAML files under ``conf/`` hold exactly these fields; :func:`register_configs` puts the schemas in
Hydra's ConfigStore and :func:`typed` validates a group against its dataclass (unknown or mistyped
fields are errors that name the group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvcomp.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")
KERNEL_BACKENDS = ("torch", "triton")
LOGGERS = ("none", "wandb")


def at_least(config, minimum: int, *names: str, optional: bool = False) -> None:
    """Raise :class:`ConfigError` naming the field when one of ``names`` of ``config`` is below ``minimum``
    (``optional``: ``None`` is allowed too)."""
    for name in names:
        value = getattr(config, name)
        if optional and value is None:
            continue
        if not isinstance(value, int) or value < minimum:
            valid = f"an integer >= {minimum}" + (" or null" if optional else "")
            raise ConfigError(f"{name}={value!r} is out of range; valid: {valid}")


def one_of(config, name: str, choices) -> None:
    """Raise :class:`ConfigError` when field ``name`` of ``config`` is not among ``choices``."""
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; valid choices: {', '.join(map(str, choices))}")


@dataclass
class ModelConfig:
    """A model: the embedded SmolLM2, a hub id, or a local folder. Shapes come from its HF config."""

    name: str = "smollm2_135m"
    source: str = "embedded"  # embedded | hub | path to a local folder
    hub_id: str | None = None
    dtype: str | None = None  # None: the hardware profile's dtype
    max_context: int = 8192

    def __post_init__(self):
        at_least(self, 1, "max_context")
        if self.dtype is not None:
            one_of(self, "dtype", DTYPE_NAMES)
        if self.source == "hub" and not self.hub_id:
            raise ConfigError("source='hub' needs hub_id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")


@dataclass
class CalibrationConfig:
    """Text a codec is fitted on (ignored by codecs that need no calibration)."""

    name: str = "enwiki"
    num_samples: int = 16
    seq_len: int = 512
    seed: int = 0
    artifact: str | None = None  # a fitted codec state to use instead of the cache's (refused if fitted for another model)

    def __post_init__(self):
        at_least(self, 1, "num_samples")
        at_least(self, 2, "seq_len")


@dataclass
class PerplexityConfig:
    """Perplexity on non-overlapping windows of an evaluation split."""

    name: str = "perplexity"
    dataset: str = "enwiki"
    split: str = "evaluation"
    seq_len: int = 512
    num_windows: int = 32  # <= 0: every window of the split
    window_selection: str = "spread"  # spread (evenly over the split) | first
    batch_size: int = 1
    protocols: list[str] = field(default_factory=lambda: ["streaming", "simulated"])
    include_reference: bool = True  # also evaluate the uncompressed model (cached across runs)

    def __post_init__(self):
        at_least(self, 2, "seq_len")
        at_least(self, 1, "batch_size")
        if not isinstance(self.num_windows, int):
            raise ConfigError(f"num_windows={self.num_windows!r}: valid: an integer (<= 0: every window)")


RULER_TASKS = [
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
]


@dataclass
class RulerConfig:
    """RULER's synthetic tasks generated offline (:mod:`kvcomp.benchmarks.ruler`), scored by generation
    through the compressed cache (:mod:`kvcomp.benchmarks.generation`)."""

    name: str = "ruler"
    tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])  # RULER's max_seq_length: prompt + generation budget
    num_samples: int = 2  # per task and length
    haystack: str = "enwiki"  # corpus (evaluation split) whose sentences replace RULER's essays
    seed: int = 42
    max_new_tokens: int | None = 64  # caps RULER's budget per task (niah 128, vt 30, cwe 120, fwe 50); None: uncapped
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    batch_size: int = 4  # samples of one task and length have the same token count: batched without padding
    protocol: str = "exact_prefill"  # exact_prefill | streaming | simulated (how the prefill sees its own tokens)
    compress_generated: bool = True  # false: only the prompt is encoded ([REF] of the TemporalKV thesis)
    include_reference: bool = True

    def __post_init__(self):
        at_least(self, 1, "num_samples", "batch_size")
        at_least(self, 1, "max_new_tokens", optional=True)
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ConfigError(f"lengths={list(self.lengths)!r} is out of range; valid: a non-empty list of positive integers")


@dataclass
class LMEvalConfig:
    """Any lm-eval task list, every request through a fresh compressed cache
    (:mod:`kvcomp.benchmarks.lm_eval_bridge`). Presets: ``longbench``, ``aime``, ``ruler_lmeval``."""

    name: str = "lm_eval"
    tasks: list[str] = field(default_factory=list)
    data: str = "auto"  # auto: the hub when reachable, else the local fixtures | hub | fixtures
    fixtures: dict[str, str] = field(default_factory=dict)  # task -> JSON-lines file (relative: kvcomp/benchmarks/fixtures)
    limit: int | None = None  # documents per task (None: all)
    num_fewshot: int | None = None
    batch_size: int = 1  # > 1 left-pads generation batches: pad tokens then count as sinks
    max_length: int | None = None  # context + generation tokens (None: the model config's max_context)
    max_gen_toks: int | None = None  # caps each task's generation budget (None: the task's own)
    truncation: str = "left"  # left (lm-eval) | middle (LongBench: keep the first and last halves)
    chat_template: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)  # TaskManager metadata (RULER: max_seq_lengths)
    protocol: str = "exact_prefill"
    compress_generated: bool = True
    include_reference: bool = True

    def __post_init__(self):
        at_least(self, 1, "batch_size")
        at_least(self, 1, "limit", "max_length", "max_gen_toks", optional=True)
        at_least(self, 0, "num_fewshot", optional=True)


@dataclass
class HardwareConfig:
    """Where and how the run computes."""

    name: str = "cpu"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # torch CPU threads; 0 = all cores
    kernel_backend: str = "torch"  # torch | triton (fused kernels where a codec has them)

    def __post_init__(self):
        at_least(self, 0, "threads")
        one_of(self, "dtype", DTYPE_NAMES)
        one_of(self, "kernel_backend", KERNEL_BACKENDS)
        if not (self.device == "cpu" or self.device == "mps" or self.device.startswith("cuda")):
            raise ConfigError(f"device={self.device!r} is unknown; valid: cpu, cuda, cuda:<index>, mps")


@dataclass
class LoggerConfig:
    """Where results go besides the local files."""

    name: str = "none"  # none | wandb
    project: str = "kvcomp"
    entity: str | None = None
    mode: str = "offline"  # offline | online | disabled

    def __post_init__(self):
        one_of(self, "name", LOGGERS)
        one_of(self, "mode", ("offline", "online", "disabled"))


GROUPS = {
    "model": ModelConfig,
    "calibration": CalibrationConfig,
    "benchmark": PerplexityConfig,
    "hardware": HardwareConfig,
    "logger": LoggerConfig,
}
BENCHMARKS = {
    "perplexity": PerplexityConfig,
    "ruler": RulerConfig,
    "lm_eval": LMEvalConfig,
    "longbench": LMEvalConfig,
    "aime": LMEvalConfig,
    "ruler_lmeval": LMEvalConfig,
}
BENCHMARK_SCHEMAS = {"schema_ruler": RulerConfig, "schema_lm_eval": LMEvalConfig}


def structured(schema: type, config, label: str, group: str = ""):
    """``config`` (DictConfig or mapping) merged onto ``schema``'s defaults, as a ``schema`` instance.

    Unknown or mistyped fields raise :class:`ConfigError` naming ``label`` and the field; a value out of
    range (the dataclass' ``__post_init__``) names it as ``<group>.<field>``."""
    raw = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    except ConfigError as exc:  # a range check of the dataclass (__post_init__)
        raise ConfigError(f"{group}.{exc}" if group else f"{label}: {exc}") from exc
    except Exception as exc:  # omegaconf's several error types become one clear error
        field_name = getattr(exc, "full_key", None)
        where = f" field {field_name!r}" if field_name else ""
        raise ConfigError(f"{label}{where}: {str(exc).splitlines()[0]}") from exc


def typed(group: str, config, schema: type | None = None):
    """Validate ``config`` against its group's dataclass (or ``schema``) and return the dataclass."""
    return structured(schema or GROUPS[group], config, f"{group} config", group)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore: ``<group>/schema`` for each group and
    ``codec/schema_<name>`` for each codec. Every YAML file of a group names its schema first in its
    defaults list, so Hydra rejects unknown or mistyped fields when it composes the run."""
    from hydra.core.config_store import ConfigStore

    from kvcomp.codecs import CODECS

    store = ConfigStore.instance()
    for group, schema in GROUPS.items():
        store.store(group=group, name="schema", node=schema)
    for name, schema in BENCHMARK_SCHEMAS.items():
        store.store(group="benchmark", name=name, node=schema)
    for name, codec in CODECS.items():
        store.store(group="codec", name=f"schema_{name}", node=codec.config_class)
