"""Dense-and-sparse outliers (KVQuant; TemporalKV thesis §1.8): the most extreme entries of each
token are stored exactly, in a sparse side list, and written over the decoded block.

An entry's extremeness is its distance from the channel mean in units of the channel's half
0.5%-99.5% calibration range, ``|x - mean_c| / half_range_c``, so that a key channel that is large
everywhere is not all outliers. Each token keeps its ``count = round(fraction * H * D)`` most extreme
entries over all KV heads and channels of the layer. This works token by token, so the streaming cache
and the one-shot prefill flag the same entries and the outlier share is exactly ``count / (H * D)``
(the thesis caps it at 1%; [REF] flags per-channel top/bottom 0.5% over a whole prefill, which has no
streaming equivalent).

Storage per outlier: the value in ``value_dtype`` (16 bits, the thesis' "+0.16 bits at 1%") and its
position among the token's ``H * D`` entries as int16 (16 more bits, which the thesis does not count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.stages.normalization import ChannelStats


@dataclass(frozen=True)
class OutlierSelector:
    fraction: float
    value_dtype: torch.dtype = torch.bfloat16

    def count(self, num_heads: int, head_dim: int) -> int:
        """Outliers kept per token and layer (0 when disabled)."""
        if self.fraction <= 0:
            return 0
        return max(1, round(self.fraction * num_heads * head_dim))

    def bits_per_value(self, num_heads: int, head_dim: int) -> float:
        """Exact stored bits per value: (value + int16 index) for each outlier."""
        per_outlier = torch.finfo(self.value_dtype).bits + 16
        return self.count(num_heads, head_dim) * per_outlier / (num_heads * head_dim)

    def paper_bits_per_value(self) -> float:
        """The thesis' accounting: 16 bits per outlier value, positions not counted."""
        return self.fraction * torch.finfo(self.value_dtype).bits

    def select(self, x: torch.Tensor, stats: ChannelStats) -> dict[str, torch.Tensor]:
        """Most extreme entries of each token of ``x [B, H, T, D]``: ``{"outlier_index", "outlier_value"}``,
        each ``[B, 1, T, count]``."""
        b, h, t, d = x.shape
        score = (x.float() - stats.mean[None, :, None, :].to(x.device)).abs() / stats.half_range[None, :, None, :].to(x.device)
        flat_score = score.permute(0, 2, 1, 3).reshape(b, t, h * d)
        index = flat_score.topk(self.count(h, d), dim=-1).indices  # [B, T, k]
        values = x.permute(0, 2, 1, 3).reshape(b, t, h * d).gather(-1, index)
        return {
            "outlier_index": index.to(torch.int16).unsqueeze(1),
            "outlier_value": values.to(self.value_dtype).unsqueeze(1),
        }

    @staticmethod
    def mask(x: torch.Tensor, selected: dict[str, torch.Tensor]) -> torch.Tensor:
        """Boolean ``[B, H, T, D]`` marking the selected entries."""
        b, h, t, d = x.shape
        flat = torch.zeros(b, t, h * d, dtype=torch.bool, device=x.device)
        flat.scatter_(-1, selected["outlier_index"].squeeze(1).long(), True)
        return flat.view(b, t, h, d).permute(0, 2, 1, 3)

    @staticmethod
    def restore(x_hat: torch.Tensor, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write the stored exact values over the decoded ``x_hat [B, H, T, D]``."""
        b, h, t, d = x_hat.shape
        flat = x_hat.permute(0, 2, 1, 3).reshape(b, t, h * d).clone()
        flat.scatter_(-1, stored["outlier_index"].squeeze(1).long(), stored["outlier_value"].squeeze(1).to(flat.dtype))
        return flat.view(b, t, h, d).permute(0, 2, 1, 3)
