"""The pipeline behind ``run.py``: load model -> build + calibrate codec -> benchmark -> results.

Importable without Hydra's entry point: :func:`run` takes a composed config (DictConfig) and an
output directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

from kvcomp.artifacts import (REFIT, ArtifactError, atomic_path, read_json, safetensors_problem, tensors_nbytes,
                              write_json_atomic)
from kvcomp.benchmarks import build_benchmark
from kvcomp.benchmarks.base import Benchmark
from kvcomp.benchmarks.gate import flag_degenerate
from kvcomp.benchmarks.intervals import pair_with_reference
from kvcomp.benchmarks.perplexity import context_length
from kvcomp.cache import check_press, install
from kvcomp.calibration import CalibrationData, calibrate, check_collection, check_windows
from kvcomp.codecs import (Codec, CodecConfig, ModelInfo, build_codec, codec_config, needs_calibration, reads_fused,
                           scores_from_payload)
from kvcomp.config import BENCHMARKS, GROUPS, CalibrationConfig, HardwareConfig, LoggerConfig, ModelConfig, typed
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.kernels import check_kernel_backend
from kvcomp.models.fingerprint import model_fingerprint
from kvcomp.models.loading import check_device, layer_devices, load_model, model_location
from kvcomp.paths import cache_dir
from kvcomp.plots import X_AXES
from kvcomp.presses import Press, PressConfig, build_press, press_config
from kvcomp.progress import phase, quiet_library_bars
from kvcomp.results import RESULTS_FILE, clear_failure, log_to_wandb, markdown_table, portable, versions

log = logging.getLogger(__name__)
REFERENCE_ROWS = 3  # what cached reference rows hold (3: and the states the distribution metrics need); older: recomputed


@dataclass
class RunPlan:
    """A run's validated group configs (everything checked before the model is loaded)."""

    model: ModelConfig
    hardware: HardwareConfig
    logger: LoggerConfig
    calibration: CalibrationConfig
    benchmark: Any
    codec: CodecConfig
    press: PressConfig | None = None  # token eviction before the codec (None: every token kept)


def check_config(cfg: DictConfig, overrides: list[str] | None = None) -> RunPlan:
    """Validate every group of a composed config and the machine it needs; raise :class:`ConfigError`
    naming the field and the valid choices. Needs no model (a sweep checks all members up front).
    ``overrides``: the run's command-line overrides (they decide a local folder's name, :func:`model_name`)."""
    if cfg.benchmark.name not in BENCHMARKS:
        raise unknown_choice("benchmark", cfg.benchmark.name, BENCHMARKS)
    if cfg.get("plot") is not None and cfg.plot.x not in X_AXES:
        raise unknown_choice("plot.x", cfg.plot.x, X_AXES)
    plan = RunPlan(
        model=typed("model", cfg.model),
        hardware=typed("hardware", cfg.hardware),
        logger=typed("logger", cfg.logger),
        calibration=typed("calibration", cfg.calibration),
        benchmark=typed("benchmark", cfg.benchmark, BENCHMARKS[cfg.benchmark.name].config_class),
        codec=codec_config(cfg.codec),
        press=press_config(cfg.get("press")),
    )
    if plan.press is not None:
        check_benchmark_press(plan)
    if plan.benchmark.name == "perplexity":
        from kvcomp.benchmarks.perplexity import protocols_for
        from kvcomp.codecs.registry import codec_class

        plan.benchmark.protocols = protocols_for(plan.benchmark.protocols, codec_class(plan.codec.name).encodes_after_forward())
    check_device(plan.hardware.device)
    check_kernel_backend(plan.hardware.kernel_backend, plan.hardware.device)
    model_location(plan.model.source, plan.model.hub_id, fetch=False, embedded=plan.model.embedded)
    plan.model.name = model_name(plan.model, overrides or [])
    return plan


def model_name(model: ModelConfig, overrides: list[str]) -> str:
    """The name results, tables and messages use: ``model.name``, except for a local folder given in the
    overrides (``model.source=<folder>``) without ``model.name=``, whose name in the config belongs to the
    group file the folder replaced: then the folder's name (a hub snapshot folder: its repository's name)."""
    keys = {o.lstrip("+~").split("=")[0] for o in overrides}
    if model.source in ("embedded", "hub") or "model.source" not in keys or "model.name" in keys:
        return model.name
    folder = Path(os.path.abspath(os.path.expanduser(model.source)))
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.split("--")[-1]  # .../models--org--name/snapshots/<commit>
    return folder.name or model.name


def check_codec_for_model(plan: RunPlan) -> Codec | None:
    """Build the codec against the model's shapes when its config is at hand without loading weights
    (embedded once fetched, local folders, hub models in the local cache); raise its ConfigError. Returns
    the codec (None when the config is not at hand)."""
    from transformers import AutoConfig

    location = model_location(plan.model.source, plan.model.hub_id, fetch=False, embedded=plan.model.embedded)
    try:
        config = AutoConfig.from_pretrained(location, local_files_only=True)
    except Exception:  # not fetched yet: the member checks its codec once the model is loaded
        return None
    return build_codec(plan.codec, ModelInfo.from_hf_config(config, name=_label(plan.model)))


def check_data(plan: RunPlan, benchmark: Benchmark, codec: Codec | None, force: bool = False) -> None:
    """Before the model loads: the benchmark's data, and the calibration corpus of a codec that will fit,
    are at hand (offline: in the local cache); when the codec could be built (the model's files are at hand),
    the corpus holds the calibration windows side by side (:func:`calibration_texts`) and the cache disk can
    hold their K/V collection (:func:`~kvcomp.calibration.check_collection`).

    The corpus is checked when the codec calibrates (``codec`` is None when it could not be built yet: then
    its class says so, unless that depends on the config) and no fitted artifact may serve instead: none
    given (``calibration.artifact``) and none of this codec in the cache, whose key needs the model's
    fingerprint, known only once it loads. Otherwise a fit that turns out to be needed reads the corpus
    after the load and raises the same error."""
    from kvcomp.codecs.registry import codec_class
    from kvcomp.data import check_corpus_available

    benchmark.check(plan.model)
    if plan.press is not None:
        benchmark.check_press(plan.press.name)
    calibrates = needs_calibration(codec if codec is not None else codec_class(plan.codec.name))
    artifact = plan.calibration.artifact
    reusable = not force and ((artifact is not None and Path(artifact).is_file())
                              or any((cache_dir() / "calibration").glob(f"{plan.codec.name}-*.safetensors")))
    if calibrates and not reusable:
        check_corpus_available(plan.calibration.name, split="calibration")
        if codec is not None:
            tokenizer = _local_tokenizer(plan.model)
            if tokenizer is not None:
                calibration_texts(plan.calibration, tokenizer)
            check_collection(codec, plan.calibration)


def _local_tokenizer(model: ModelConfig):
    """The model's tokenizer from its local files (no weights are loaded), or None when they are not at hand."""
    from transformers import AutoTokenizer

    location = model_location(model.source, model.hub_id, fetch=False, embedded=model.embedded)
    try:
        return AutoTokenizer.from_pretrained(location, local_files_only=True)
    except (OSError, ValueError):  # not fetched yet: the windows are checked once the model is loaded
        return None


def _label(model: ModelConfig) -> str:
    """How messages name the model: its hub id, or its (folder's) name."""
    return model.hub_id if model.source == "hub" else model.name


def run(cfg: DictConfig, output_dir: str | Path, overrides: list[str] | None = None) -> dict:
    """Run one configuration; write ``results.json`` in ``output_dir``; return the results.

    ``overrides``: the command-line overrides that made this run (recorded; sweep summaries show them
    as columns). ``force=true`` re-runs a finished run, recomputes the reference rows and refits the
    calibration."""
    output_dir = Path(output_dir)
    config = portable(OmegaConf.to_container(cfg, resolve=True))  # as results.json holds it: no install paths
    config.pop("hydra", None)
    force = bool(config.pop("force", False))
    config.pop("plot", None)  # how a sweep draws its members, not part of a run
    if config.get("press", {}).get("name") == "none":  # no eviction: the config of runs from before presses existed
        config.pop("press")
    results_path = output_dir / RESULTS_FILE
    if results_path.is_file() and not force:
        previous = read_json(results_path, "results file", "delete it, or run with force=true")
        if same_run(previous.get("config"), config):
            log.info("%s already holds this run (force=true re-runs it)\n%s", results_path,
                     markdown_table(previous["rows"]))
            clear_failure(output_dir)
            return previous

    plan = check_config(cfg, overrides)
    benchmark = build_benchmark(plan.benchmark)
    check_data(plan, benchmark, check_codec_for_model(plan), force)  # before the (possibly slow) weights load
    hardware, model_cfg = plan.hardware, plan.model
    torch.manual_seed(cfg.get("seed", 0))
    if hardware.device == "cpu":
        torch.set_num_threads(hardware.threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
    timings = {}
    start = time.perf_counter()
    quiet_library_bars()
    device = hardware.device
    if device == "cuda" and hardware.device_map is None:
        device = f"cuda:{torch.cuda.current_device()}"  # the GPU a local parallel member leased
    with phase(f"loading model {_label(model_cfg)} ({model_cfg.source})", timings, "load_seconds"):
        model, tokenizer = load_model(
            model_cfg.source, hub_id=model_cfg.hub_id, embedded=model_cfg.embedded, dtype=model_cfg.dtype or hardware.dtype,
            device=device, device_map=hardware.device_map, gpu_memory=hardware.gpu_memory, cpu_memory=hardware.cpu_memory,
        )
    if hardware.device_map is not None:
        log.info("layers placed by device_map=%s: %s", hardware.device_map, _spans(layer_devices(model)))
    install(model, hardware.kernel_backend)
    with phase("model fingerprint (weight files are hashed once)", timings, "fingerprint_seconds"):
        fingerprint = model_fingerprint(model, tokenizer)
    info = ModelInfo.from_hf_config(model.config, name=_label(model_cfg), fingerprint=fingerprint["fingerprint"])
    with phase(f"building codec {plan.codec.name}", timings, "codec_seconds"):
        codec = build_codec(plan.codec, info)
        press = build_press(plan.press, info)
        # before calibration: a press composes with stream-scope codecs (and decode presses with generated tokens coded)
        check_press(press, codec, "exact_prefill", getattr(plan.benchmark, "compress_generated", True))

    with phase(f"{plan.benchmark.name} data", timings, "benchmark_data_seconds"):
        benchmark.prepare(model, tokenizer, model_cfg)
    calibration_report = {}
    if needs_calibration(codec):
        with phase(f"calibrating {codec.name} on {plan.calibration.name}", timings, "calibration_seconds"):
            calibration_report = calibrate_codec(model, tokenizer, codec, plan.calibration, force)
    calibration_report.update(codec.summary())
    if hardware.kernel_backend == "triton":
        _report_kernels(codec)
    rows, kept = [], None  # kept: what the reference evaluation keeps for the comparison
    if plan.benchmark.include_reference and (codec.name != "fp16" or press is not None):
        reference = build_codec({"name": "fp16", "compress_sliding": plan.codec.compress_sliding}, info)
        with phase("uncompressed reference (cached across runs)", timings, "reference_seconds"):
            rows, kept = _reference_rows(model, reference, benchmark, model_cfg, hardware, force)
    with phase(f"evaluating {codec.describe()}", timings, "evaluation_seconds"):
        rows = flag_degenerate(pair_with_reference(rows + _rows(model, codec, benchmark, model_cfg, press, kept)))
    timings["total_seconds"] = round(time.perf_counter() - start, 2)

    results = portable({
        "config": config,
        "overrides": list(overrides or []),
        "model": {"name": model_cfg.name, **fingerprint},
        "rows": rows,
        "calibration": calibration_report,
        "timings": timings,
        "versions": versions(),
    })
    write_json_atomic(results_path, results)
    clear_failure(output_dir)
    log.info("%s on %s (%s):\n%s", plan.benchmark.name, model_cfg.name, results_path, markdown_table(rows))
    if plan.logger.name == "wandb":
        log_to_wandb(plan.logger, f"{model_cfg.name}-{codec.describe()}", config, rows, directory=output_dir)
    return results


def _spans(devices: dict[int, str]) -> str:
    """``{0: "cuda:0", 1: "cuda:0", 2: "cuda:1"}`` -> ``"layers 0-1 on cuda:0, 2 on cuda:1"``."""
    spans: list[list] = []
    for layer, device in devices.items():
        if spans and spans[-1][2] == device and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer, device])
    return "layers " + ", ".join(f"{a}-{b} on {d}" if a != b else f"{a} on {d}" for a, b, d in spans)


def _report_kernels(codec) -> None:
    """Say which layers' decode steps the Triton kernels serve (the others take the torch path)."""
    layers = range(codec.model.num_layers)
    fused = [i for i in layers if scores_from_payload(codec) or reads_fused(codec, i)]
    if len(fused) < len(layers):
        log.info("codec %s: no fused decode kernel for layers %s; they use the torch reference path",
                 codec.describe(), sorted(set(layers) - set(fused)))


def calibration_texts(calibration: CalibrationConfig, tokenizer) -> list[str]:
    """The calibration corpus's documents, refused when ``num_samples`` windows of ``seq_len`` tokens do not fit
    in it side by side (:func:`~kvcomp.calibration.check_windows`; its token ids are cached for the windows). The
    documents are always the split disjoint from evaluation's (seed 0); ``calibration.seed`` places the windows."""
    from kvcomp.data import load_corpus, tokenize_documents

    texts = load_corpus(calibration.name, "calibration")
    check_windows(tokenize_documents(texts, tokenizer, cache_tag=_tokens_tag(calibration)).numel(), calibration)
    return texts


def _tokens_tag(calibration: CalibrationConfig) -> str:
    return f"{calibration.name}-calibration"


def calibrate_codec(model, tokenizer, codec: Codec, calibration: CalibrationConfig, force: bool = False) -> dict:
    """Fit ``codec`` on ``calibration``'s windows through ``model``, or load its cached (or given) artifact
    (:func:`~kvcomp.calibration.calibrate`); returns the calibration report."""
    return calibrate(codec, calibration, lambda: calibration_data(model, tokenizer, calibration, force).activations(codec),
                     path=calibration.artifact, force=force)


def calibration_data(model, tokenizer, calibration, force: bool = False) -> CalibrationData:
    """The calibration windows (refused before any is cut when the corpus cannot hold them: :func:`calibration_texts`)."""
    from kvcomp.data import token_windows

    windows = token_windows(
        calibration_texts(calibration, tokenizer), tokenizer, calibration.seq_len, calibration.num_samples,
        seed=calibration.seed, mode="random", cache_tag=_tokens_tag(calibration),
    )
    return CalibrationData(model=model, tokenizer=tokenizer, windows=windows, config=calibration, force=force)


def _rows(model, codec: Codec, benchmark: Benchmark, model_cfg, press: Press | None = None,
          reference: dict | None = None) -> list[dict]:
    return [_codec_columns(codec, model_cfg, press) | metrics
            for metrics in benchmark.evaluate(model, codec, press, reference)]


def _codec_columns(codec: Codec, model_cfg, press: Press | None = None) -> dict:
    codec_columns = {
        "model": model_cfg.name,
        "codec": codec.describe(),
        "bits_per_value": round(codec.bits_per_value(), 4),
        "paper_bits_per_value": round(codec.paper_bits_per_value(), 4),
        "overhead_bits": codec.overhead_bits(),
    }
    if press is not None:
        codec_columns |= {"press": press.describe(), "press_ratio": press.config.ratio}
    return codec_columns


def _group_defaults(group: str, values: dict) -> dict:
    """The defaults of a config group's dataclass (codec, press and benchmark: the one its ``name`` selects)."""
    if group == "codec":
        from kvcomp.codecs.registry import codec_class

        schema = codec_class(values.get("name", "")).config_class
    elif group == "press":
        from kvcomp.presses.base import press_class

        schema = press_class(values.get("name", "")).config_class
    else:
        schema = BENCHMARKS[values.get("name", "")].config_class if group == "benchmark" else GROUPS.get(group)
    if schema is None:
        return {}
    return {f.name: f.default if f.default is not MISSING else f.default_factory()
            for f in fields(schema) if f.default is not MISSING or f.default_factory is not MISSING}


def same_run(previous: dict | None, config: dict) -> bool:
    """Whether a finished run's recorded config is this run's: equal, or equal but for fields a group gained since
    that run, at their defaults (a new option leaves finished sweeps resumable)."""
    if previous == config:
        return True
    if not isinstance(previous, dict) or set(previous) != set(config):
        return False
    for group, values in config.items():
        old = previous[group]
        if not (isinstance(values, dict) and isinstance(old, dict)):
            if values != old:
                return False
            continue
        if set(old) - set(values) or any(values[k] != old[k] for k in old):
            return False
        added = set(values) - set(old)
        try:
            defaults = _group_defaults(group, values) if added else {}
        except ConfigError:  # an unknown codec or benchmark name: not this run
            return False
        if any(k not in defaults or values[k] != defaults[k] for k in added):
            return False
    return True


def check_benchmark_press(plan: RunPlan) -> None:
    """A press evicts from a context prefilled before its later tokens: on RULER (the question kept out of the
    compression, as kvpress's pipeline) and lm-eval's generation tasks (LongBench, AIME: the question pressed with its
    context; likelihood tasks refused, :meth:`~kvcomp.benchmarks.lm_eval_bridge.LMEvalBenchmark.evaluate`), both
    under ``exact_prefill``, and on perplexity, whose protocols become ``context`` (the window's first
    ``context_tokens`` as one pressed prefill, the rest scored after it)."""
    name = plan.benchmark.name
    if name != "perplexity" and plan.benchmark.protocol != "exact_prefill":
        raise ConfigError(f"press={plan.press.name} evicts after an exact prefill: benchmark.protocol=exact_prefill, "
                          f"not {plan.benchmark.protocol!r}")
    if name == "perplexity" and list(plan.benchmark.protocols) != ["context"]:
        log.info("perplexity: a press evicts after a prefill; protocols %s -> [context]", list(plan.benchmark.protocols))
        plan.benchmark.protocols = ["context"]
    least, why = plan.press.min_prompt()
    if name == "perplexity":
        shortest, what = context_length(plan.benchmark, plan.benchmark.seq_len), "the context (benchmark.context_tokens)"
    elif name == "ruler":
        shortest, what = min(plan.benchmark.lengths), "the shortest of benchmark.lengths (its prompt is shorter still)"
    else:
        return
    if shortest < least:
        raise ConfigError(f"press={plan.press.name} needs prompts of at least {least} tokens ({why}), but {what} "
                          f"is {shortest}; lengthen them or change the press's settings")


def _reference_rows(model, reference: Codec, benchmark: Benchmark, model_cfg, hardware,
                    force: bool) -> tuple[list[dict], dict]:
    """The uncompressed rows and the tensors later rows are compared with (:meth:`Benchmark.evaluate_reference`),
    cached across runs for the same model (fingerprint), dtype and benchmark data. Each row carries ``reference_key``
    so that a sweep summary lists a shared reference once."""
    key = json.dumps(
        {
            "model": reference.model.identity,
            **({"reference": reference.describe()} if reference.config.compress_sliding else {}),  # other bytes
            "dtype": str(model.dtype),
            "device": hardware.device,
            "benchmark": benchmark.fingerprint(),
            "versions": {k: v for k, v in versions().items() if k in ("torch", "transformers", "kvcomp")},
            "rows": REFERENCE_ROWS,
        },
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = cache_dir() / "reference" / f"{digest}.json"
    tensors_path = path.with_suffix(".safetensors")
    if path.is_file() and not force:
        rows = read_json(path, "cached reference rows", REFIT)
        if not (isinstance(rows, list) and all(isinstance(r, dict) and r.get("reference_key") == digest for r in rows)):
            raise ArtifactError(f"cached reference rows {path} do not hold this reference; {REFIT}")
        return rows, _kept_tensors(tensors_path)
    reference_rows, kept = benchmark.evaluate_reference(model, reference)
    rows = [{**_codec_columns(reference, model_cfg), **row, "reference_key": digest} for row in reference_rows]
    if kept:
        with atomic_path(tensors_path, tensors_nbytes(kept)) as tmp:
            save_file({name: t.contiguous() for name, t in kept.items()}, str(tmp))
    write_json_atomic(path, rows)  # last: rows without their tensors are never read as complete
    return rows, kept


def _kept_tensors(path: Path) -> dict:
    """The tensors cached beside reference rows (none for benchmarks that keep none), refused when unreadable."""
    if not path.exists():
        return {}
    problem = safetensors_problem(path)
    if problem is not None:
        raise ArtifactError(f"cached reference tensors {path} cannot be read ({problem}); {REFIT}")
    return load_file(str(path))
