"""Transformers integration: the compressed cache, RoPE handling and the attention function."""

from kvcomp.cache.attention import ATTENTION_NAME, compressed_attention, install
from kvcomp.cache.compressed_cache import PROTOCOLS, CompressedCache, CompressedLayer

__all__ = ["ATTENTION_NAME", "PROTOCOLS", "CompressedCache", "CompressedLayer", "compressed_attention", "install"]
