"""Calibration: the data a codec is fitted on, and the cached, checked artifacts ``fit`` produces.

A fitted state is saved once per (model fingerprint, codec config, calibration set, library version)
under ``cache_dir()/calibration/`` and reused by later runs: a changed model (other weights, config or
tokenizer under the same name) gets a fresh fit. Loading an artifact fitted for anything else is a
:class:`~kvcomp.errors.CalibrationMismatchError` that lists what differs; a damaged one (truncated,
altered, non-finite) is an error that names the file and the remedy.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kvcomp
from kvcomp.codecs import Codec, CodecState
from kvcomp.config import CalibrationConfig
from kvcomp.paths import cache_dir, cache_relative


@dataclass
class CalibrationData:
    """What ``Codec.fit`` receives: the model, its tokenizer and the calibration token windows."""

    model: torch.nn.Module
    tokenizer: object
    windows: torch.Tensor  # [num_samples, seq_len]
    config: CalibrationConfig
    force: bool = False  # collect again even when a verified collection is cached


def fitted_for(codec: Codec, calibration: CalibrationConfig) -> dict:
    """What an artifact records about its origin; every field must match to reuse it."""
    return {
        "model": codec.model.identity,
        "model_shape": [codec.model.num_layers, codec.model.num_kv_heads, codec.model.head_dim],
        "codec": codec.calibration_key(),
        "calibration": {k: v for k, v in asdict(calibration).items() if k != "artifact"},
        "kvcomp_version": kvcomp.__version__,
    }


def artifact_path(codec: Codec, calibration: CalibrationConfig) -> Path:
    """Where the state for this codec, model and calibration set is cached."""
    key = hashlib.sha256(json.dumps(fitted_for(codec, calibration), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{codec.name}-{key}.safetensors"


def calibrate(codec: Codec, calibration: CalibrationConfig, load_data, path: Path | None = None,
              force: bool = False) -> dict:
    """Install a fitted state into ``codec``: load the cached artifact or fit and save one.

    ``load_data()`` returns the :class:`CalibrationData` (called only when fitting). ``path``: an
    artifact to use instead of the cache's (refused if fitted for another model or config); ``force``
    refits and overwrites it. A state with NaN or Inf is refused (not saved). Returns a small report
    (``{"artifact": ..., "reused": bool, "seconds": float}``; the artifact path relative to the cache
    folder when it lies there); codecs that need no calibration return ``{}``.
    """
    if not codec.needs_calibration:
        return {}
    expected = fitted_for(codec, calibration)
    path = Path(path) if path is not None else artifact_path(codec, calibration)
    start = time.perf_counter()
    reused = path.is_file() and not force
    if reused:
        codec.load_state(CodecState.load(path, expected))
    else:
        state = codec.fit(load_data())
        state.check_finite(f"{codec.name} calibration (fitted on {calibration.name})")
        state.fitted_for = expected
        state.save(path)
        codec.load_state(state)
    return {"artifact": cache_relative(path), "reused": reused, "seconds": round(time.perf_counter() - start, 2)}

