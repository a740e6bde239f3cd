"""kvcomp: post-training KV-cache compression for large language models.

The library is importable without Hydra: codecs live in :mod:`kvcomp.codecs`, the compressed cache
and attention path in :mod:`kvcomp.cache`, benchmarks in :mod:`kvcomp.benchmarks`.
"""

__version__ = "0.1.0"
