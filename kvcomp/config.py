"""Structured configs: one dataclass per Hydra group. The model, hardware and logger groups are here;
the others live beside the code they configure and are gathered here: codec configs beside their codecs
(:data:`kvcomp.codecs.CODECS`), :class:`~kvcomp.calibration.CalibrationConfig`, and the benchmark configs
(:mod:`kvcomp.benchmarks.configs`). This module imports them, never the reverse.

The YAML files under ``conf/`` set only fields of their group's dataclass. A codec's base file sets only its
``name`` and a preset only what differs from its base, so every codec default is stated once, in its
dataclass (``tests/usage/test_config.py`` checks). :func:`register_configs` puts the schemas in Hydra's
ConfigStore and :func:`typed` validates a group against its dataclass (unknown or mistyped fields are
errors that name the group).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from kvcomp.benchmarks import BENCHMARKS
from kvcomp.benchmarks.configs import LMEvalConfig, PerplexityConfig, RulerConfig
from kvcomp.calibration import CalibrationConfig
from kvcomp.codecs import CODECS
from kvcomp.presses import PRESSES, PressConfig
from kvcomp.errors import ConfigError
from kvcomp.kernels import KERNEL_BACKENDS
from kvcomp.schema import at_least, one_of, structured

DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placement strategies
LOGGERS = ("none", "wandb")


@dataclass
class ModelConfig:
    """A model: the embedded SmolLM2, a hub id, or a local folder. Shapes come from its HF config."""

    name: str = "smollm2_135m"
    source: str = "embedded"  # embedded | hub | path to a local folder
    embedded: str | None = None  # with source=embedded: smollm2_135m (null: the default) | qwen25_coder_05b | gemma3_270m
    hub_id: str | None = None
    dtype: str | None = None  # None: the hardware profile's dtype
    max_context: int = 8192

    def __post_init__(self):
        at_least(self, 1, "max_context")
        if self.dtype is not None:
            one_of(self, "dtype", DTYPE_NAMES)
        if self.source == "hub" and not self.hub_id:
            raise ConfigError("source='hub' needs hub_id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
        if self.embedded is not None:
            from kvcomp.data.assets import EMBEDDED_MODELS

            one_of(self, "embedded", tuple(EMBEDDED_MODELS))


@dataclass
class HardwareConfig:
    """Where and how the run computes."""

    name: str = "cpu"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # torch CPU threads; 0 = $OMP_NUM_THREADS, else all cores
    kernel_backend: str = "torch"  # torch | triton (fused kernels where a codec has them)
    # Models bigger than one GPU: accelerate places whole decoder layers over the visible GPUs
    # (null: the whole model on `device`). Each layer's cache, codec state and kernels follow its layer.
    device_map: str | None = None  # null | auto | balanced | balanced_low_0 | sequential
    gpu_memory: str | None = None  # with device_map: weights per GPU, e.g. 60GiB (null: what each GPU has free)
    cpu_memory: str | None = None  # with device_map: layers that do not fit go to CPU memory, up to this

    def __post_init__(self):
        at_least(self, 0, "threads")
        one_of(self, "dtype", DTYPE_NAMES)
        one_of(self, "kernel_backend", KERNEL_BACKENDS)
        if self.device_map is not None:
            one_of(self, "device_map", DEVICE_MAPS)
            if not self.device.startswith("cuda") or ":" in self.device:
                raise ConfigError(f"device_map={self.device_map!r} places layers over the visible GPUs; it needs "
                                  f"device=cuda, not {self.device!r}")
        elif self.gpu_memory is not None or self.cpu_memory is not None:
            raise ConfigError("gpu_memory / cpu_memory are used only with device_map (e.g. hardware.device_map=auto)")
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
# ``benchmark/schema_<name>`` for each benchmark config besides the group's own (perplexity): ruler, lm_eval
BENCHMARK_SCHEMAS = {f"schema_{b.config_class.name}": b.config_class for b in BENCHMARKS.values()
                     if b.config_class is not GROUPS["benchmark"]}


def typed(group: str, config, schema: type | None = None):
    """Validate ``config`` against its group's dataclass (or ``schema``) and return the dataclass."""
    return structured(schema or GROUPS[group], config, f"{group} config", group)


def group_file(path) -> dict:
    """One group file (``conf/<group>/<name>.yaml``) as a plain dict without its defaults list, for scripts that
    build a run by hand (a preset's base file is not merged in; a codec's base file, which names only its schema,
    gets the schema's name)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(path))
    schemas = [str(d).removeprefix("schema_") for d in config.pop("defaults", None) or [] if str(d).startswith("schema_")]
    if schemas and "name" not in config:
        config["name"] = schemas[0]
    return config


def sweep_dir(experiment: str | None, stamp: str) -> str:
    """A sweep's folder (``conf/config.yaml``): ``multirun/<experiment>`` for an experiment file, so that running
    it again resumes its members there, else ``multirun/<date>/<time>``."""
    return f"multirun/{experiment or stamp}"


MEMBER_DIR_BYTES = 200  # a member folder's name is cut (and a hash of the rest added) beyond this


def member_dir(override_dirname: str) -> str:
    """A sweep member's folder below the sweep's (``conf/config.yaml``): its overrides (Hydra's
    ``override_dirname``) as one safe name: path separators written ``%2F`` / ``%5C`` (``model.name=../../x`` stays one
    folder inside the sweep's; every name holds ``=``, so none is ``..``), and a long one cut with a hash of it."""
    name = override_dirname.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C")
    if len(name.encode()) > MEMBER_DIR_BYTES:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name.encode()[:MEMBER_DIR_BYTES - 13].decode(errors='ignore')}-{digest}"
    return name


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore: ``<group>/schema`` for each group and
    ``codec/schema_<name>`` for each codec and ``press/schema_<name>`` for each press. Every YAML file of a group names its schema first in its
    defaults list, so Hydra rejects unknown or mistyped fields when it composes the run. Also registers
    the ``kvcomp_sweep_dir`` and ``kvcomp_member_dir`` resolvers (:func:`sweep_dir`, :func:`member_dir`)."""
    OmegaConf.register_new_resolver("kvcomp_sweep_dir", sweep_dir, replace=True)
    OmegaConf.register_new_resolver("kvcomp_member_dir", member_dir, replace=True)
    schemas = [(group, "schema", schema) for group, schema in GROUPS.items()]
    schemas += [("benchmark", name, schema) for name, schema in BENCHMARK_SCHEMAS.items()]
    schemas += [("codec", f"schema_{name}", codec.config_class) for name, codec in CODECS.items()]
    schemas += [("press", "schema_none", PressConfig)]
    schemas += [("press", f"schema_{name}", press.config_class) for name, press in PRESSES.items()]
    store = ConfigStore.instance()
    for group, name, schema in schemas:
        if _STORED.get((group, name)) is not schema:  # each schema converted once per process (a structured
            store.store(group=group, name=name, node=schema)  # config takes milliseconds; tests compose hundreds)
            _STORED[(group, name)] = schema


_STORED: dict[tuple[str, str], type] = {}  # (group, name) -> the schema register_configs stored there


__all__ = [
    "BENCHMARKS", "BENCHMARK_SCHEMAS", "DTYPE_NAMES", "GROUPS", "KERNEL_BACKENDS", "LOGGERS", "CalibrationConfig",
    "HardwareConfig", "LMEvalConfig", "LoggerConfig", "ModelConfig", "PerplexityConfig", "RulerConfig",
    "group_file", "register_configs", "typed",
]
