"""StreamingLLM (Xiao et al. 2024, arXiv 2309.17453; kvpress's ``StreamingLLMPress``): the first ``sinks`` tokens
(attention sinks) and the most recent ones, the same for every KV head: of ``n`` prompt tokens, the ``k`` kept are
the ``sinks`` first and the ``k - sinks`` last. With ``decoding_size`` it also presses while decoding, the paper's
own setting: the cache holds the sinks and a window of recent tokens (refreshed every ``decoding_interval`` tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.errors import ConfigError
from kvcomp.presses.base import Prefill, Press, PressConfig, register


@dataclass
class StreamingLLMConfig(PressConfig):
    name: str = "streaming_llm"
    sinks: int = 4  # kvpress's n_sink and the paper's 4 initial tokens

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ConfigError(f"sinks={self.sinks} must be >= 0")


@register
class StreamingLLMPress(Press):
    name = "streaming_llm"
    config_class = StreamingLLMConfig
    shared_across_heads = True
    reads_queries = False
    decodes = True

    def scores(self, prefill: Prefill) -> torch.Tensor:
        """1 for the sinks and the last ``k - sinks`` tokens, 0 between (ties are never on the border)."""
        keys = prefill.keys
        b, n = keys.shape[0], keys.shape[2]
        k = prefill.kept or self.kept_count(n)
        sinks = min(self.config.sinks, k)
        position = torch.arange(n, device=keys.device)
        kept = (position < sinks) | (position >= n - (k - sinks))
        return kept.float().expand(b, 1, n)
