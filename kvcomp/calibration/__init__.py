"""Calibration: the data a codec is fitted on, and the cached, checked artifacts ``fit`` produces.

A fitted state is saved once per (model, codec config, calibration set, library version) under
``cache_dir()/calibration/`` and reused by later runs; loading an artifact fitted for anything else
is a :class:`~kvcomp.errors.CalibrationMismatchError` that lists what differs.
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
from kvcomp.paths import cache_dir


@dataclass
class CalibrationData:
    """What ``Codec.fit`` receives: the model, its tokenizer and the calibration token windows."""

    model: torch.nn.Module
    tokenizer: object
    windows: torch.Tensor  # [num_samples, seq_len]
    config: CalibrationConfig


def fitted_for(codec: Codec, calibration: CalibrationConfig) -> dict:
    """What an artifact records about its origin; every field must match to reuse it."""
    return {
        "model": codec.model.name,
        "model_shape": [codec.model.num_layers, codec.model.num_kv_heads, codec.model.head_dim],
        "codec": codec.calibration_key(),
        "calibration": asdict(calibration),
        "kvcomp_version": kvcomp.__version__,
    }


def artifact_path(codec: Codec, calibration: CalibrationConfig) -> Path:
    """Where the state for this codec, model and calibration set is cached."""
    key = hashlib.sha256(json.dumps(fitted_for(codec, calibration), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{codec.name}-{key}.safetensors"


def calibrate(codec: Codec, calibration: CalibrationConfig, load_data, path: Path | None = None) -> dict:
    """Install a fitted state into ``codec``: load the cached artifact or fit and save one.

    ``load_data()`` returns the :class:`CalibrationData` (called only when fitting). Returns a small
    report (``{"artifact": ..., "reused": bool, "seconds": float}``); codecs that need no calibration
    return ``{}``.
    """
    if not codec.needs_calibration:
        return {}
    expected = fitted_for(codec, calibration)
    path = Path(path) if path is not None else artifact_path(codec, calibration)
    start = time.perf_counter()
    if path.is_file():
        codec.load_state(CodecState.load(path, expected))
        return {"artifact": str(path), "reused": True, "seconds": round(time.perf_counter() - start, 2)}
    state = codec.fit(load_data())
    state.fitted_for = expected
    state.save(path)
    codec.load_state(state)
    return {"artifact": str(path), "reused": False, "seconds": round(time.perf_counter() - start, 2)}
