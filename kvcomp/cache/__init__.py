"""Transformers integration: the compressed cache, RoPE handling and the attention function."""

import functools
import inspect

from kvcomp.cache.attention import ATTENTION_NAME, Installation, compressed_attention, install
from kvcomp.cache.compressed_cache import PROTOCOLS, CompressedCache
from kvcomp.cache.eviction import check_press
from kvcomp.cache.layer import CompressedLayer


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def with_cache(model, cache) -> dict:
    """``{"cache": cache}`` for models whose ``forward`` takes ``cache`` (transformers >= 5.24), else
    ``{"past_key_values": cache}``: keyword arguments for ``model(...)`` and ``model.generate(...)``
    (the signature is read once per model class: decode loops call this every step)."""
    return {_cache_kwarg(type(model)): cache}


__all__ = ["ATTENTION_NAME", "PROTOCOLS", "CompressedCache", "CompressedLayer", "Installation", "check_press",
           "compressed_attention", "install", "with_cache"]
