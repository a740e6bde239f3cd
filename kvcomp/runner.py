"""The pipeline behind ``run.py``: load model -> build + calibrate codec -> benchmark -> results.

Importable without Hydra's entry point: :func:`run` takes a composed config (DictConfig) and an
output directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from kvcomp.benchmarks import Benchmark, build_benchmark
from kvcomp.cache import install
from kvcomp.calibration import CalibrationData, calibrate
from kvcomp.codecs import Codec, ModelInfo, build_codec, codec_config
from kvcomp.config import BENCHMARKS, KERNEL_BACKENDS, LOGGERS, typed
from kvcomp.errors import unknown_choice
from kvcomp.kernels import check_kernel_backend
from kvcomp.paths import cache_dir
from kvcomp.results import RESULTS_FILE, log_to_wandb, markdown_table, versions, write_json_atomic


def run(cfg: DictConfig, output_dir: str | Path) -> dict:
    """Run one configuration; write ``results.json`` in ``output_dir``; return the results."""
    output_dir = Path(output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    config.pop("force", None)
    results_path = output_dir / RESULTS_FILE
    if results_path.is_file() and not cfg.get("force", False):
        previous = json.loads(results_path.read_text())
        if previous.get("config") == config:
            print(f"[kvcomp] {results_path} already holds this run (force=true re-runs it)")
            print(markdown_table(previous["rows"]))
            return previous

    model_cfg = typed("model", cfg.model)
    hardware = typed("hardware", cfg.hardware)
    logger = typed("logger", cfg.logger)
    calibration = typed("calibration", cfg.calibration)
    if cfg.benchmark.name not in BENCHMARKS:
        raise unknown_choice("benchmark", cfg.benchmark.name, BENCHMARKS)
    benchmark_cfg = typed("benchmark", cfg.benchmark, BENCHMARKS[cfg.benchmark.name])
    benchmark = build_benchmark(benchmark_cfg)
    if hardware.kernel_backend not in KERNEL_BACKENDS:
        raise unknown_choice("kernel backend", hardware.kernel_backend, KERNEL_BACKENDS)
    if logger.name not in LOGGERS:
        raise unknown_choice("logger", logger.name, LOGGERS)
    codec_cfg = codec_config(cfg.codec)  # validate before the slow model load
    check_kernel_backend(hardware.kernel_backend, hardware.device)

    torch.manual_seed(cfg.get("seed", 0))
    if hardware.device == "cpu":
        torch.set_num_threads(hardware.threads or os.cpu_count() or 1)
    timings = {}
    start = time.perf_counter()
    from kvcomp.models import load_model

    model, tokenizer = load_model(
        model_cfg.source, hub_id=model_cfg.hub_id, dtype=model_cfg.dtype or hardware.dtype, device=hardware.device
    )
    install(model, hardware.kernel_backend)
    info = ModelInfo.from_hf_config(model.config, name=model_cfg.hub_id or model_cfg.name)
    codec = build_codec(codec_cfg, info)
    timings["load_seconds"] = round(time.perf_counter() - start, 2)
    codec.kernel_backend = hardware.kernel_backend

    benchmark.prepare(model, tokenizer, model_cfg)
    calibration_report = calibrate(
        codec, calibration, lambda: _calibration_data(model, tokenizer, calibration)
    )
    calibration_report.update(codec.summary())
    if hardware.kernel_backend == "triton":
        _report_kernels(codec)
    rows = []
    if benchmark_cfg.include_reference and codec.name != "fp16":
        reference = build_codec({"name": "fp16"}, info)
        rows += _reference_rows(model, reference, benchmark, model_cfg, hardware)
    rows += _rows(model, codec, benchmark, model_cfg)
    timings["total_seconds"] = round(time.perf_counter() - start, 2)

    results = {
        "config": config,
        "rows": rows,
        "calibration": calibration_report,
        "timings": timings,
        "versions": versions(),
    }
    write_json_atomic(results_path, results)
    print(f"\n[kvcomp] {benchmark_cfg.name} on {model_cfg.name} ({results_path}):")
    print(markdown_table(rows))
    if logger.name == "wandb":
        log_to_wandb(logger, f"{model_cfg.name}-{codec.describe()}", config, rows)
    return results


def _report_kernels(codec) -> None:
    """Say which layers' decode steps the Triton kernels serve (the others take the torch path)."""
    layers = range(codec.model.num_layers)
    fused = [i for i in layers if codec.scores_from_payload or codec.fused_attention_supported(i)]
    if len(fused) < len(layers):
        print(
            f"[kvcomp] codec {codec.describe()}: no fused decode kernel for layers "
            f"{sorted(set(layers) - set(fused))}; they use the torch reference path"
        )


def _calibration_data(model, tokenizer, calibration) -> CalibrationData:
    from kvcomp.data import load_corpus, token_windows

    texts = load_corpus(calibration.name, "calibration", seed=calibration.seed)
    windows = token_windows(
        texts, tokenizer, calibration.seq_len, calibration.num_samples, seed=calibration.seed, mode="random",
        cache_tag=f"{calibration.name}-calibration",
    )
    return CalibrationData(model=model, tokenizer=tokenizer, windows=windows, config=calibration)


def _rows(model, codec: Codec, benchmark: Benchmark, model_cfg) -> list[dict]:
    codec_columns = {
        "model": model_cfg.name,
        "codec": codec.describe(),
        "bits_per_value": round(codec.bits_per_value(), 4),
        "paper_bits_per_value": round(codec.paper_bits_per_value(), 4),
        "overhead_bits": codec.overhead_bits(),
    }
    return [codec_columns | metrics for metrics in benchmark.evaluate(model, codec)]


def _reference_rows(model, reference: Codec, benchmark: Benchmark, model_cfg, hardware) -> list[dict]:
    """The uncompressed rows, cached across runs for the same model, dtype and benchmark data."""
    key = json.dumps(
        {
            "model": reference.model.name,
            "dtype": str(model.dtype),
            "device": hardware.device,
            "benchmark": benchmark.fingerprint(),
            "versions": {k: v for k, v in versions().items() if k in ("torch", "transformers", "kvcomp")},
        },
        sort_keys=True,
        default=str,
    )
    path = cache_dir() / "reference" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    rows = _rows(model, reference, benchmark, model_cfg)
    write_json_atomic(path, rows)
    return rows
