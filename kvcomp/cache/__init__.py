"""Transformers integration: the compressed cache, RoPE handling and the attention function."""

import inspect

from kvcomp.cache.attention import ATTENTION_NAME, compressed_attention, install
from kvcomp.cache.compressed_cache import PROTOCOLS, CompressedCache, CompressedLayer


def with_cache(model, cache) -> dict:
    """``{"cache": cache}`` for models whose ``forward`` takes ``cache`` (transformers >= 5.24), else
    ``{"past_key_values": cache}``: keyword arguments for ``model(...)`` and ``model.generate(...)``."""
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache}


__all__ = ["ATTENTION_NAME", "PROTOCOLS", "CompressedCache", "CompressedLayer", "compressed_attention", "install",
           "with_cache"]
