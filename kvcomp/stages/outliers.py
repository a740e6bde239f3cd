"""Dense-and-sparse outliers (KVQuant; TemporalKV thesis §1.8): extreme entries of each token are stored
exactly, in a sparse side list, and written over the decoded block.

Two rules choose them (``outlier_rule``); both work token by token, so the streaming cache and the
one-shot prefill flag the same entries, and both keep at most ``count = round(fraction * H * D)`` entries
per token over all KV heads and channels of the layer (the thesis caps the outlier share at 1%):

- ``token_topk`` (default): each token keeps exactly its ``count`` most extreme entries, extremeness
  being the distance from the channel mean in units of the channel's half 0.5%-99.5% calibration range,
  ``|x - mean_c| / half_range_c``, so that a key channel that is large everywhere is not all outliers.
- ``reference``: the KVQuant reference's thresholds (spec seed-000 §1.8). Keys: an entry outside its
  channel's 0.5% and 99.5% calibration quantiles (the thesis' per-channel thresholds; [REF] takes each
  channel's top and bottom 0.5% over a whole prefill, which has no streaming equivalent, and these
  calibrated thresholds are its token-by-token form). Values: an entry at or beyond the token's own 0.5%
  or 99.5% quantile over all its ``H * D`` entries, computed at run time ([REF]). So a token keeps
  between 0 and ``count`` entries; beyond ``count``, those furthest past their threshold (in units of the
  half range) are kept.

Storage per token: ``count`` slots, each the value in ``value_dtype`` (16 bits, the thesis' "+0.16 bits at
1%") and its position among the token's ``H * D`` entries as int16 (16 more bits, which the thesis does
not count). Under ``reference`` a slot a token does not use holds position ``H * D`` (nothing) and value 0:
it is stored and counted all the same, so the payload stays fixed-rate (bytes reported are bytes held) and
costs what ``token_topk``'s does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.stages.normalization import HIGH_QUANTILE, LOW_QUANTILE, TINY, ChannelStats, quantile

TOKEN_TOPK, REFERENCE = "token_topk", "reference"
RULES = (TOKEN_TOPK, REFERENCE)


def _by_token(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, T, H * D]``."""
    b, h, t, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, t, h * d)


@dataclass(frozen=True)
class OutlierSelector:
    fraction: float
    rule: str = TOKEN_TOPK  # one of RULES
    value_dtype: torch.dtype = torch.bfloat16

    def count(self, num_heads: int, head_dim: int) -> int:
        """Outlier slots per token and layer (0 when disabled)."""
        if self.fraction <= 0:
            return 0
        return max(1, round(self.fraction * num_heads * head_dim))

    def bits_per_value(self, num_heads: int, head_dim: int) -> float:
        """Exact stored bits per value: (value + int16 index) for each slot."""
        per_outlier = torch.finfo(self.value_dtype).bits + 16
        return self.count(num_heads, head_dim) * per_outlier / (num_heads * head_dim)

    def paper_bits_per_value(self) -> float:
        """The thesis' accounting: 16 bits per outlier value, positions not counted."""
        return self.fraction * torch.finfo(self.value_dtype).bits

    def _scores(self, x: torch.Tensor, stats: ChannelStats, kind: str) -> torch.Tensor:
        """``[B, T, H * D]`` extremeness of each entry; ``-inf`` where the rule never flags it."""
        flat = _by_token(x.float())
        if self.rule == TOKEN_TOPK:
            mean, half_range = (_by_token(t[None, :, None, :]).to(x.device) for t in (stats.mean, stats.half_range))
            return (flat - mean).abs() / half_range
        if kind == "key":  # outside the channel's calibration quantiles
            low, high, half_range = (_by_token(t[None, :, None, :]).to(x.device) for t in (stats.low, stats.high, stats.half_range))
            beyond = torch.maximum(flat - high, low - flat) / half_range
            return beyond.masked_fill(beyond <= 0, float("-inf"))
        low, high = quantile(flat, LOW_QUANTILE)[..., None], quantile(flat, HIGH_QUANTILE)[..., None]  # at or beyond the token's
        beyond = torch.maximum(flat - high, low - flat) / ((high - low) / 2).clamp_min(TINY)
        return beyond.masked_fill(beyond < 0, float("-inf"))

    def select(self, x: torch.Tensor, stats: ChannelStats, kind: str) -> dict[str, torch.Tensor]:
        """Outliers of each token of ``x [B, H, T, D]`` (a ``kind`` stream): ``{"outlier_index",
        "outlier_value"}``, each ``[B, 1, T, count]``; unused slots hold index ``H * D`` and value 0."""
        b, h, t, d = x.shape
        top = self._scores(x, stats, kind).topk(self.count(h, d), dim=-1)  # [B, T, k]
        used = top.values > float("-inf")
        values = _by_token(x).gather(-1, top.indices).masked_fill(~used, 0)
        return {
            "outlier_index": top.indices.masked_fill(~used, h * d).to(torch.int16).unsqueeze(1),
            "outlier_value": values.to(self.value_dtype).unsqueeze(1),
        }

    @staticmethod
    def _scatter(flat: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``flat [B, T, H * D]`` with ``src`` written at the stored positions ``index`` (unused slots dropped)."""
        padded = torch.cat([flat, flat.new_zeros(*flat.shape[:2], 1)], dim=-1)
        padded.scatter_(-1, index.squeeze(1).long(), src.squeeze(1).to(flat.dtype))
        return padded[..., :-1]

    @classmethod
    def mask(cls, x: torch.Tensor, selected: dict[str, torch.Tensor]) -> torch.Tensor:
        """Boolean ``[B, H, T, D]`` marking the selected entries."""
        b, h, t, d = x.shape
        index = selected["outlier_index"]
        flat = cls._scatter(torch.zeros(b, t, h * d, dtype=torch.bool, device=x.device), index, torch.ones_like(index, dtype=torch.bool))
        return flat.reshape(b, t, h, d).permute(0, 2, 1, 3)

    @classmethod
    def restore(cls, x_hat: torch.Tensor, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write the stored exact values over the decoded ``x_hat [B, H, T, D]``."""
        b, h, t, d = x_hat.shape
        flat = cls._scatter(_by_token(x_hat), stored["outlier_index"], stored["outlier_value"])
        return flat.reshape(b, t, h, d).permute(0, 2, 1, 3)
