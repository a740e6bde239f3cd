"""Codecs: one file per method family, all registered by name in :data:`CODECS`."""

from omegaconf import DictConfig, OmegaConf

from kvcomp.codecs.base import Codec, CodecConfig, CodecState, ModelInfo, Payload, StreamPolicy, expected_cache_bits
from kvcomp.codecs.registry import CODECS, codec_class
from kvcomp.codecs import fp16, kivi, uniform  # noqa: F401  (registration)
from kvcomp.errors import ConfigError


def codec_config(config) -> CodecConfig:
    """Turn a mapping (Hydra group or dict) into the codec's dataclass; unknown or mistyped fields are errors."""
    if isinstance(config, CodecConfig):
        return config
    raw = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
    cls = codec_class(raw.get("name", ""))
    try:
        typed = OmegaConf.merge(OmegaConf.structured(cls.config_class), raw)
    except Exception as exc:  # omegaconf raises several error types; re-raise as one clear error
        raise ConfigError(f"codec {cls.name}: {exc}".split("\n    full_key")[0]) from exc
    return OmegaConf.to_object(typed)


def build_codec(config, model: ModelInfo) -> Codec:
    """Build the codec named by ``config.name`` for ``model`` (validated)."""
    typed = codec_config(config)
    return codec_class(typed.name)(typed, model)


__all__ = [
    "CODECS",
    "Codec",
    "CodecConfig",
    "CodecState",
    "ModelInfo",
    "Payload",
    "StreamPolicy",
    "build_codec",
    "codec_config",
    "expected_cache_bits",
]
