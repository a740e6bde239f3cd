"""The Python API: compressed caches for a model loaded in your own script, and runs as the command line makes them.

```python
from kvcomp.api import compressed_cache

cache = compressed_cache(model, "kivi", bits=2)  # installs kvcomp's attention on model
out = model.generate(**inputs, cache=cache, max_new_tokens=32)
```

- :func:`load_codec` builds a codec for a loaded ``transformers`` model from its name and options, calibrating it
  when it needs a fit (on a kvcomp corpus, cached as the command line caches it; on your own texts; or on
  activations you collected).
- :func:`compressed_cache` gives a fresh :class:`~kvcomp.cache.CompressedCache` for one ``generate`` call or one
  forward (a cache holds one batch of sequences), installing kvcomp's attention on the model if it is not there yet.
- :func:`attention` installs that attention for a ``with`` block and removes it after.
- :func:`compose` and :func:`run` make and run a configuration exactly as ``python run.py`` does (Hydra's
  groups and overrides, ``results.json``); :func:`evaluate` runs one benchmark on a model you loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvcomp.benchmarks import build_benchmark
from kvcomp.benchmarks.gate import flag_degenerate
from kvcomp.benchmarks.intervals import pair_with_reference
from kvcomp.cache import CompressedCache, Installation, install
from kvcomp.cache.attention import installation
from kvcomp.calibration import CalibrationConfig, CalibrationData, fit_state
from kvcomp.codecs import CODECS, Activations, Codec, ModelInfo, build_codec, needs_calibration
from kvcomp.config import BENCHMARKS, ModelConfig, register_configs, typed
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.presses import PRESSES, Press, build_press
from kvcomp.runner import calibrate_codec
from kvcomp.runner import run as run_config

CONF = Path(__file__).resolve().parent.parent / "conf"  # the command line's Hydra groups (a source checkout)


def load_codec(model, codec: str = "kivi", *, tokenizer=None, calibration: str | CalibrationConfig | Sequence[str] | None = None,
               activations: Activations | None = None, force: bool = False, **options) -> Codec:
    """The codec ``codec`` (a ``codec=`` name or preset, e.g. ``"kivi"``, ``"qjl_3bit"``) with ``options`` (its config
    dataclass's fields, e.g. ``bits=2``), built for ``model``'s shapes, and fitted when it calibrates.

    A codec that calibrates is fitted on, in this order of precedence: ``activations`` (what ``Codec.fit``
    receives, e.g. from :meth:`~kvcomp.calibration.CalibrationData.activations`); ``calibration`` given as texts (a
    sequence of strings, cut into the default calibration windows; not cached); or a kvcomp corpus, ``calibration``
    as its name (``"enwiki"``, ``"lee"``, ...) or a :class:`~kvcomp.calibration.CalibrationConfig` (default: the
    command line's), whose fitted state is cached under the model's fingerprint and reused as a run's would be
    (``force=True`` refits). Fitting from texts or a corpus needs ``tokenizer``."""
    info = ModelInfo.from_hf_config(model.config, name=getattr(model.config, "_name_or_path", "") or None)
    settings = _settings("codec", codec, CODECS, options)
    built = build_codec(settings, info)
    if not needs_calibration(built):
        return built
    if activations is None and tokenizer is None:
        raise ConfigError(f"codec {codec!r} is fitted before use: pass tokenizer= (to calibrate on a corpus or on "
                          "your texts) or activations=")
    if activations is None:
        from kvcomp.models.fingerprint import model_fingerprint

        fingerprint = model_fingerprint(model, tokenizer)["fingerprint"]  # keys the cached K/V and fitted state
        built = build_codec(settings, replace(info, fingerprint=fingerprint))
    if activations is not None:
        built.install_state(fit_state(built, activations, "the given activations"))
    elif calibration is not None and not isinstance(calibration, (str, CalibrationConfig)):
        texts = _text_activations(model, tokenizer, built, list(calibration))
        built.install_state(fit_state(built, texts, "the given texts"))
    else:
        config = CalibrationConfig(name=calibration) if isinstance(calibration, str) else calibration or CalibrationConfig()
        calibrate_codec(model, tokenizer, built, config, force)
    return built


def _settings(group: str, name: str, registered: dict, options: dict) -> dict:
    """A group's settings from a name as the command line takes it: a registered name, or a preset file
    ``conf/<group>/<name>.yaml`` (e.g. ``kivi_4bit``, ``qjl_3bit``), composed as ``group=name`` is, with ``options``
    over it."""
    if name not in registered and (CONF / group / f"{name}.yaml").is_file():
        from omegaconf import OmegaConf

        return {**OmegaConf.to_container(compose(f"{group}={name}")[group]), **options}
    return {"name": name, **options}


def _text_activations(model, tokenizer, codec: Codec, texts: list[str]) -> Activations:
    """What ``codec.fit`` receives from the default calibration windows cut at seeded offsets from ``texts``."""
    from kvcomp.data import token_windows

    if not texts or not all(isinstance(t, str) for t in texts):
        raise ConfigError("calibration= texts: a non-empty sequence of strings (or a corpus name, e.g. 'enwiki')")
    config = CalibrationConfig(name="texts")
    windows = token_windows(texts, tokenizer, config.seq_len, config.num_samples, seed=config.seed, mode="random",
                            cache=False)
    return CalibrationData(model=model, tokenizer=tokenizer, windows=windows, config=config).activations(codec)


def load_press(model, press: str, **options) -> Press:
    """The press ``press`` (a ``press=`` name, e.g. ``"snapkv"``) with ``options`` (its config dataclass's fields,
    e.g. ``ratio=0.5``, the fraction of prompt tokens evicted), for ``model``'s shapes."""
    built = build_press(_settings("press", press, PRESSES, options), ModelInfo.from_hf_config(model.config))
    if built is None:
        raise ConfigError("press='none' evicts nothing: pass press=None to compressed_cache instead")
    return built


def compressed_cache(model, codec: str | Codec = "kivi", *, press: str | Press | None = None,
                     protocol: str = "exact_prefill", capacity: int | None = None, check_finite: bool | str = True,
                     compress_generated: bool = True, decoded_copy: bool = False, tokenizer=None, calibration=None,
                     activations=None, **options) -> CompressedCache:
    """A fresh compressed cache for ``model``: pass it to ``model.generate(..., cache=cache)`` or to a forward
    (``model(ids, cache=cache, use_cache=True)``; ``past_key_values=`` before transformers 5.24). One cache holds one batch of sequences; make a
    new one per ``generate`` call.

    ``codec``: a built :class:`~kvcomp.codecs.Codec` (from :func:`load_codec`, to fit once and reuse), or a name with
    ``options`` and the calibration arguments of :func:`load_codec`. ``press``: a press name (its defaults) or a
    :class:`~kvcomp.presses.Press` (:func:`load_press`) that evicts prompt tokens before the codec codes them.
    ``protocol``: ``exact_prefill`` (as the generation benchmarks: a forward attends to its own tokens
    uncompressed and to earlier ones as stored), ``streaming`` or ``simulated``
    (the docs' evaluation protocols); ``capacity``, ``check_finite``, ``compress_generated`` and ``decoded_copy``: as
    :class:`~kvcomp.cache.CompressedCache`.

    Installs kvcomp's attention on ``model`` when it has none (:func:`attention` scopes it to a block instead); it
    reads compressed caches and leaves other caches to the model's own attention."""
    if not isinstance(codec, Codec):
        codec = load_codec(model, codec, tokenizer=tokenizer, calibration=calibration, activations=activations, **options)
    elif options or calibration is not None or activations is not None:
        raise ConfigError(f"codec options {sorted(options)} or calibration go to load_codec; "
                          f"the given codec {codec.describe()} is already built")
    if isinstance(press, str):
        press = load_press(model, press)
    cache = CompressedCache(codec, protocol=protocol, check_finite=check_finite, compress_generated=compress_generated,
                            capacity=capacity, press=press, decoded_copy=decoded_copy)
    _installed(model)
    return cache


def _installed(model) -> None:
    """kvcomp's attention on ``model``, installed (torch backend) unless it has an installation already."""
    if installation(model) is None:
        install(model)


def attention(model, kernel_backend: str = "torch", cuda_graphs: bool = False) -> Installation:
    """Route ``model``'s attention through kvcomp; as a context manager (``with attention(model): ...``) it is
    removed at the end of the block, and whatever was installed before is back. ``kernel_backend="triton"``: decode
    steps read payloads in the fused kernels where the codec has one (CUDA). See :func:`kvcomp.cache.install`."""
    return install(model, kernel_backend, cuda_graphs)


def compose(*overrides: str):
    """The configuration ``python run.py OVERRIDES...`` runs (Hydra's composition of ``conf/``, the same
    schemas and checks), e.g. ``compose("codec=kivi", "codec.bits=4", "benchmark.num_windows=4")``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if not (CONF / "config.yaml").is_file():
        raise ConfigError(f"compose() reads the command line's groups in {CONF}, which this installation lacks: "
                          "install kvcomp from a source checkout (pip install -e .)")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def run(*overrides: str, output_dir: str | Path) -> dict:
    """Run ``python run.py OVERRIDES...`` in this process (one run, not a sweep) and return its results, also
    written to ``output_dir/results.json`` (a finished run with the same config is returned as it is, as the
    command line does; ``"force=true"`` re-runs it)."""
    return run_config(compose(*overrides), output_dir, list(overrides))


def evaluate(model, tokenizer, codec: str | Codec = "kivi", benchmark="perplexity", *, press: str | Press | None = None,
             max_context: int | None = None, reference: bool = False, **options) -> list[dict]:
    """Metric rows of one benchmark for ``codec`` on a model you loaded. ``benchmark``: a ``benchmark=`` name with its
    defaults, a mapping with ``name``, or a config dataclass (:mod:`kvcomp.benchmarks.configs`), e.g.
    ``PerplexityConfig(num_windows=4)``; ``codec``, ``press`` and ``options``: as :func:`compressed_cache`.
    ``max_context``: the longest input the benchmark may build (default: the model's ``max_position_embeddings``).
    ``reference``: the uncompressed reference's rows first (``reference_key`` set), then the codec's, compared with
    it as a run compares them (KL divergence and top-1 agreement, paired intervals, the degenerate-output ``flag``);
    computed here, not cached."""
    if isinstance(benchmark, str):
        benchmark = {"name": benchmark}
    name = benchmark["name"] if isinstance(benchmark, dict) else getattr(benchmark, "name", None)
    if name not in BENCHMARKS:
        raise unknown_choice("benchmark", name, BENCHMARKS)
    config = typed("benchmark", benchmark, BENCHMARKS[name].config_class) if isinstance(benchmark, dict) else benchmark
    if not isinstance(codec, Codec):
        codec = load_codec(model, codec, tokenizer=tokenizer, **options)
    if isinstance(press, str):
        press = load_press(model, press)
    context = max_context or getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    model_cfg = ModelConfig(name=codec.model.name or "model", source="hub", hub_id=codec.model.name or "model",
                            max_context=context or ModelConfig.max_context)
    runnable = build_benchmark(config)
    runnable.check(model_cfg)
    _installed(model)
    runnable.prepare(model, tokenizer, model_cfg)
    if not reference:
        return runnable.evaluate(model, codec, press)
    reference_rows, kept = runnable.evaluate_reference(model, build_codec(
        {"name": "fp16", "compress_sliding": codec.config.compress_sliding}, codec.model))
    rows = [{**row, "reference_key": "api"} for row in reference_rows] + runnable.evaluate(model, codec, press, kept)
    return flag_degenerate(pair_with_reference(rows))


__all__ = ["attention", "compose", "compressed_cache", "evaluate", "load_codec", "load_press", "run"]
