"""SnapKV (Li et al. 2024, arXiv 2404.14469; kvpress's ``SnapKVPress``): the last ``window_size`` prompt tokens (the
observation window) vote for the earlier ones. Their queries' attention over the whole prompt (causal, softmax over
every token), without the window's own columns, is averaged over the window's queries, smoothed along the tokens by
average pooling (``kernel_size``, zero padding counted, as kvpress and the authors' ``avgpool``), and averaged over
the query heads of each KV head (kvpress; the authors' code has no GQA). The window itself is always kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcomp.errors import ConfigError
from kvcomp.presses.base import Prefill, Press, PressConfig, kept_first, register, window_attention


@dataclass
class SnapKVConfig(PressConfig):
    name: str = "snapkv"
    window_size: int = 64  # the observation window (kvpress and the authors' default)
    kernel_size: int = 5  # the pooling width (odd)

    def __post_init__(self):
        super().__post_init__()
        if self.window_size < 1 or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ConfigError(f"window_size={self.window_size} must be >= 1 and kernel_size="
                              f"{self.kernel_size} odd and >= 1")

    def min_prompt(self) -> tuple[int, str]:
        return self.window_size + 1, f"its observation window of window_size={self.window_size} tokens and one before it"


@register
class SnapKVPress(Press):
    name = "snapkv"
    config_class = SnapKVConfig

    def scores(self, prefill: Prefill) -> torch.Tensor:
        w = self.config.window_size
        votes = window_attention(prefill, w)[..., :-w].mean(dim=-2)  # [B, Hq, n - w]
        k = self.config.kernel_size
        votes = F.avg_pool1d(votes, kernel_size=k, padding=k // 2, stride=1)
        b, hq, m = votes.shape
        h = prefill.keys.shape[1]
        return kept_first(votes.view(b, h, hq // h, m).mean(dim=2), w, at_end=True)
