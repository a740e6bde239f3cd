"""Codecs: one file per method family, all registered by name in :data:`CODECS`."""

from kvcomp.codecs.base import (
    Activations,
    Codec,
    CodecConfig,
    CodecState,
    ModelInfo,
    Payload,
    StreamPolicy,
    expected_cache_bits,
    fit_layer_by_layer,
)
from kvcomp.codecs.registry import CODECS, codec_class
from kvcomp.codecs import aquakv, channelkv, csr, fp16, higgs, kivi, kvquant, kvtc, qjl, temporalkv, uniform  # noqa: F401  (registration)
from kvcomp.schema import structured


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
    "Codec",
    "CodecConfig",
    "CodecState",
    "ModelInfo",
    "Payload",
    "StreamPolicy",
    "build_codec",
    "codec_config",
    "expected_cache_bits",
    "fit_layer_by_layer",
]
