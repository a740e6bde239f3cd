"""Perplexity through the compressed cache, under both evaluation protocols.

``streaming``: each window is one forward through an empty :class:`CompressedCache`; the kvcomp
attention function shows every query the cache as it was when its token arrived (blocks encoded only
once complete, see :mod:`kvcomp.cache.attention`), which equals feeding the window token by token.
``simulated``: the seeds' protocol; every query attends to the cache state after the whole window
(blocks quantized with statistics that include later tokens).

``ppl = exp(sum of next-token NLL / number of predicted tokens)`` over all windows.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from kvcomp.cache import PROTOCOLS, CompressedCache
from kvcomp.codecs import Codec, expected_cache_bits
from kvcomp.config import PerplexityConfig
from kvcomp.errors import ConfigError


def codec_never_encodes(codec: Codec) -> bool:
    """True when no stream ever encodes a block (both protocols then give identical numbers)."""
    return all(
        codec.policy(kind, layer).block_size is None
        for kind in ("key", "value")
        for layer in range(codec.model.num_layers)
    )


@torch.no_grad()
def evaluate_perplexity(model, codec: Codec, windows: torch.Tensor, config: PerplexityConfig) -> dict:
    """Perplexity of ``model`` with ``codec`` on token ``windows [n, seq_len]``, per protocol.

    Also returns the cache bytes measured after one full window (batch 1), the bits per value they
    imply, and the bits the codec's formula predicts for the same window.
    """
    unknown = [p for p in config.protocols if p not in PROTOCOLS]
    if unknown or not config.protocols:
        raise ConfigError(f"perplexity protocols {list(config.protocols)}: choose from {', '.join(PROTOCOLS)}")
    device = next(model.parameters()).device
    metrics: dict = {}
    cache_stats: dict = {}
    shortcut = codec_never_encodes(codec)
    for i, protocol in enumerate(config.protocols):
        if shortcut and i > 0:  # nothing is ever encoded: the protocols cannot differ
            metrics[f"ppl_{protocol}"] = metrics[f"ppl_{config.protocols[0]}"]
            continue
        start = time.perf_counter()
        nll, count = 0.0, 0
        for batch in windows.split(config.batch_size):
            batch = batch.to(device)
            cache = CompressedCache(codec, protocol)
            logits = model(batch, past_key_values=cache, use_cache=True).logits.float()
            nll += F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            count += batch[:, 1:].numel()
            if not cache_stats:
                cache_stats = _cache_stats(cache, codec, batch.shape[0], windows.shape[1], model.dtype)
        metrics[f"ppl_{protocol}"] = math.exp(nll / count)
        metrics[f"eval_seconds_{protocol}"] = round(time.perf_counter() - start, 2)
    metrics["tokens_scored"] = int(windows[:, 1:].numel())
    return {**metrics, **cache_stats}


def _cache_stats(cache: CompressedCache, codec: Codec, batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    fp_bits = torch.finfo(dtype).bits
    return {
        "cache_bytes_per_window": cache.nbytes // batch,
        "cache_bytes_expected": expected_cache_bits(codec, seq_len, batch, fp_bits) / 8 / batch,
        "bits_per_value_measured": cache.measured_bits_per_value(),
        "full_precision_bits": fp_bits,
    }
