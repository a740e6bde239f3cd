"""Codecs: one file per method family, each registered in :data:`CODECS` under its config's ``name`` default (its
``@register``) when this package imports every module beside ``base`` and ``registry``."""

import importlib
import pkgutil

from kvcomp.codecs.base import (
    Activations,
    Calibrated,
    Codec,
    CodecConfig,
    CodecState,
    FusedPayload,
    LayerRequest,
    ModelInfo,
    ModelRequest,
    Payload,
    PayloadScores,
    PayloadValues,
    Request,
    Stateful,
    StreamPolicy,
    StreamRequest,
    expected_cache_bits,
    fit_layer_by_layer,
    keeps_state,
    needs_calibration,
    reads_fused,
    scores_from_payload,
    values_from_payload,
)
from kvcomp.codecs.registry import CODECS, codec_class
from kvcomp.schema import structured

for _module in pkgutil.iter_modules(__path__):  # importing a module registers the codecs it defines
    if _module.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_module.name}")


def codec_config(config) -> CodecConfig:
    """Turn a mapping (Hydra group or dict) into the codec's dataclass; unknown or mistyped fields are errors
    (a mapping needs omegaconf; a :class:`CodecConfig` is returned as it is)."""
    if isinstance(config, CodecConfig):
        return config
    cls = codec_class(config.get("name", ""))
    return structured(cls.config_class, config, f"codec {cls.name}")


def build_codec(config, model: ModelInfo) -> Codec:
    """Build the codec named by ``config.name`` for ``model`` (validated)."""
    typed = codec_config(config)
    return codec_class(typed.name)(typed, model)


__all__ = [
    "CODECS",
    "Activations",
    "Calibrated",
    "Codec",
    "CodecConfig",
    "CodecState",
    "FusedPayload",
    "LayerRequest",
    "ModelInfo",
    "ModelRequest",
    "Payload",
    "PayloadScores",
    "PayloadValues",
    "Request",
    "Stateful",
    "StreamPolicy",
    "StreamRequest",
    "build_codec",
    "codec_config",
    "expected_cache_bits",
    "fit_layer_by_layer",
    "keeps_state",
    "needs_calibration",
    "reads_fused",
    "scores_from_payload",
    "values_from_payload",
]
