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
from kvcomp.artifacts import file_lock
from kvcomp.calibration.collect import KVActivations, collect_kv
from kvcomp.codecs import Codec, CodecState, needs_calibration
from kvcomp.paths import cache_dir, cache_relative
from kvcomp.schema import at_least


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
class CalibrationData:
    """The calibration windows and the model they run through: :meth:`activations` collects what
    ``Codec.fit`` receives (codecs never see the model, nor import calibration)."""

    model: torch.nn.Module
    tokenizer: object
    windows: torch.Tensor  # [num_samples, seq_len]
    config: CalibrationConfig
    force: bool = False  # collect again even when a verified collection is cached

    def activations(self, codec: Codec) -> KVActivations:
        """What ``codec.fit`` receives: pre-RoPE keys and values of every window, without the codec's
        :attr:`~kvcomp.codecs.base.Codec.calibration_drop_first` leading tokens, with Fisher weights only
        when it :attr:`~kvcomp.codecs.base.Codec.needs_fisher` (:func:`~kvcomp.calibration.collect.collect_kv`:
        reused from the cache folder when a verified collection of the same model and windows exists,
        unless ``force``)."""
        activations = collect_kv(self.model, codec.model, self.windows, codec.calibration_drop_first,
                                 force=self.force, fisher=codec.needs_fisher)
        types = {codec.model.layer_types[i] for i in codec.model.model_layers} if codec.model.layer_types else {None}
        ropes = [window_rope(self.model, self.windows.shape[1], codec.calibration_drop_first, kind) for kind in types]
        same = all(r is not None and all(torch.equal(a, b) for a, b in zip(r, ropes[0])) for r in ropes)
        activations.rope = ropes[0] if same else None  # layers with different RoPE (Gemma 3): no shared angles
        return activations


def window_rope(model, seq_len: int, drop_first: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos/sin ``[seq_len - drop_first, head_dim]`` (float32) of a window's kept positions, from the model's
    rotary embedding (of ``layer_type`` where it has one per layer type; None for models without one)."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None
    parameter = next(model.parameters())
    extra = (layer_type,) if layer_type is not None and hasattr(rotary, f"{layer_type}_inv_freq") else ()
    with torch.no_grad():
        cos, sin = rotary(parameter[:1], torch.arange(seq_len, device=parameter.device)[None], *extra)
    return cos[0, drop_first:].float(), sin[0, drop_first:].float()


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


def calibrate(codec: Codec, calibration: CalibrationConfig, load_activations, path: Path | None = None,
              force: bool = False) -> dict:
    """Install a fitted state into ``codec``: load the cached artifact or fit and save one.

    ``load_activations()`` returns what ``codec.fit`` receives, e.g.
    ``CalibrationData(...).activations(codec)`` (called only when fitting). ``path``: an
    artifact to use instead of the cache's (refused if fitted for another model or config); ``force``
    refits and overwrites it. A state with NaN or Inf is refused (not saved). Processes calibrating the same
    artifact at once fit it once: the first holds a lock on it while fitting, the others wait, then load it.
    Returns a small report
    (``{"artifact": ..., "reused": bool, "seconds": float}``; the artifact path relative to the cache
    folder when it lies there); codecs that need no calibration return ``{}``.
    """
    if not needs_calibration(codec):
        return {}
    expected = fitted_for(codec, calibration)
    path = Path(path) if path is not None else artifact_path(codec, calibration)
    start = time.perf_counter()
    with file_lock(path, f"the {codec.name} calibration {path.name}"):  # concurrent sweep members fit once
        reused = path.is_file() and not force
        if reused:
            codec.install_state(CodecState.load(path, expected))
        else:
            state = codec.fit(load_activations())
            state.check_finite(f"{codec.name} calibration (fitted on {calibration.name})")
            state.fitted_for = expected
            state.save(path)
            codec.install_state(state)
    return {"artifact": cache_relative(path), "reused": reused, "seconds": round(time.perf_counter() - start, 2)}

