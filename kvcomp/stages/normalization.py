"""Normalisation of K/V blocks before codebook quantization (TemporalKV thesis §1.5, §2.1).

``x [B, H, T, D]`` is mapped to ``z = (x - center) / scale`` and back with ``x_hat = z_hat * scale + center``.

- ``none``: ``z = x`` (ChannelKV as the thesis runs it).
- ``channel_zscore``: offline per-channel mean and std of the calibration set (TemporalKV keys and
  values; KVQuant keys).
- ``channel_range``: offline per-channel mean and half the 0.5%-99.5% quantile range (KVQuant keys
  with 1% outliers).
- ``token_zscore``: online mean and std of each token over all heads x channels of the layer
  (KVQuant values); both are stored per token in ``param_dtype`` (float32 where a token's do not fit it).
- ``token_range``: online half quantile range of each token, offline per-channel mean as center
  (KVQuant values with 1% outliers); the scale is stored per token.

Errors in normalised space are ``scale^2`` times smaller than in raw space, which is why Fisher weights
are multiplied by ``scale^2`` (thesis §1.6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.stages.ranges import stored_in

MODES = ("none", "channel_zscore", "channel_range", "token_zscore", "token_range")
LOW_QUANTILE, HIGH_QUANTILE = 0.005, 0.995
TINY = 1e-6


def quantile(x: torch.Tensor, q: float, dim: int = -1) -> torch.Tensor:
    """Linear-interpolation quantile along ``dim`` (like :func:`torch.quantile`, without its size limit)."""
    ordered = x.float().sort(dim=dim).values
    pos = q * (ordered.shape[dim] - 1)
    lo, frac = int(pos), pos - int(pos)
    hi = min(lo + 1, ordered.shape[dim] - 1)
    return ordered.select(dim, lo) * (1 - frac) + ordered.select(dim, hi) * frac


@dataclass
class ChannelStats:
    """Offline per-(KV head, channel) statistics of one layer's keys or values, each ``[H, D]``."""

    mean: torch.Tensor
    std: torch.Tensor
    low: torch.Tensor  # 0.5% quantile
    high: torch.Tensor  # 99.5% quantile

    @classmethod
    def of(cls, x: torch.Tensor, channel_block: int = 16) -> "ChannelStats":
        """Statistics over samples and tokens of ``x [S, H, T, D]``."""
        h, d = x.shape[1], x.shape[3]
        flat = x.permute(1, 3, 0, 2).reshape(h * d, -1)
        mean = torch.empty(h * d)
        std, low, high = torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)
        for start in range(0, h * d, channel_block):  # bounded memory for long calibration sets
            part = flat[start : start + channel_block].float()
            mean[start : start + channel_block] = part.mean(-1).cpu()
            std[start : start + channel_block] = part.std(-1).cpu()
            low[start : start + channel_block] = quantile(part, LOW_QUANTILE).cpu()
            high[start : start + channel_block] = quantile(part, HIGH_QUANTILE).cpu()
        return cls(*(t.view(h, d) for t in (mean, std, low, high)))

    @property
    def half_range(self) -> torch.Tensor:
        return ((self.high - self.low) / 2).clamp_min(TINY)

    def as_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{name}": getattr(self, name) for name in ("mean", "std", "low", "high")}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "ChannelStats":
        return cls(*(tensors[f"{prefix}.{name}"].float() for name in ("mean", "std", "low", "high")))

    def to(self, device) -> "ChannelStats":
        return ChannelStats(*(t.to(device) for t in (self.mean, self.std, self.low, self.high)))


def _per_channel(t: torch.Tensor) -> torch.Tensor:
    """``[H, D]`` -> broadcastable to ``[B, H, T, D]``."""
    return t.float()[None, :, None, :]


def _per_token_spread(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token scale (and mean for ``token_zscore``) over all heads x channels: ``[B, 1, T]``."""
    flat = x.float().permute(0, 2, 1, 3).flatten(2)  # [B, T, H*D]
    if mode == "token_zscore":
        std = flat.std(-1, correction=0)
        peak = flat.abs().amax(-1).clamp_min(TINY)  # tokens beyond ~1e19 overflow the variance: scaled by their peak
        std = torch.where(std.isfinite(), std, (flat / peak[..., None]).std(-1, correction=0) * peak)
        return std[:, None], flat.mean(-1)[:, None]
    spread = (quantile(flat, HIGH_QUANTILE) - quantile(flat, LOW_QUANTILE)) / 2
    return spread[:, None], None


def per_token(t: torch.Tensor) -> torch.Tensor:
    """Per-token parameters ``[B, T]`` or ``[B, H, T]`` (per head) as float32 broadcasting against ``[B, H, T, D]``."""
    return t.float()[..., None] if t.dim() == 3 else t.float()[:, None, :, None]


def affine_denormalize(z, channel_scale, channel_center, token_scale=None, token_center=None) -> torch.Tensor:
    """``z [B, H, T, D] * channel_scale * token_scale + channel_center + token_center`` (channel ``[H, D]``,
    token ``[B, T]``, ``[B, H, T]`` per head, or ``None``): every normalisation's inverse."""
    scale, center = _per_channel(channel_scale).to(z.device), _per_channel(channel_center).to(z.device)
    if token_scale is not None:
        scale = scale * per_token(token_scale)
    if token_center is not None:
        center = center + per_token(token_center)
    return z * scale + center


@dataclass(frozen=True)
class Normalizer:
    mode: str
    param_dtype: torch.dtype = torch.float16

    @property
    def stored_per_token(self) -> int:
        """16-bit parameters stored per token and layer (online modes)."""
        return {"token_zscore": 2, "token_range": 1}.get(self.mode, 0)

    def bits_per_value(self, num_heads: int, head_dim: int) -> float:
        return self.stored_per_token * torch.finfo(self.param_dtype).bits / (num_heads * head_dim)

    def normalize(self, x: torch.Tensor, stats: ChannelStats,
                  range_checks: list | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``x [B, H, T, D]`` -> ``(z, scale, stored)``: ``scale`` broadcasts to ``x``; ``stored`` holds
        the per-token parameters ``[B, 1, T]`` the decoder needs (rounded to ``param_dtype``; ``range_checks``:
        :mod:`kvcomp.stages.ranges`)."""
        stored: dict[str, torch.Tensor] = {}
        if self.mode == "none":  # made on x's device: a CPU scalar moved there is a host sync per encode on a GPU
            return x.float(), torch.ones((), device=x.device), stored
        if self.mode == "channel_zscore":
            center, scale = _per_channel(stats.mean), _per_channel(stats.std.clamp_min(TINY))
        elif self.mode == "channel_range":
            center, scale = _per_channel(stats.mean), _per_channel(stats.half_range)
        else:
            spread, mean = _per_token_spread(x, self.mode)
            stored["token_scale"] = stored_in(spread.clamp_min(TINY), self.param_dtype, range_checks)
            if mean is not None:
                stored["token_center"] = stored_in(mean, self.param_dtype, range_checks)
            center, scale = self._token_params(stats, stored)
        center, scale = center.to(x.device), scale.to(x.device)
        return (x.float() - center) / scale, scale, stored

    def denormalize(self, z: torch.Tensor, stats: ChannelStats, stored: dict) -> torch.Tensor:
        return affine_denormalize(z, *self.affine(stats, stored))

    def affine(self, stats: ChannelStats, stored: dict) -> tuple:
        """The inverse as ``x = z * channel_scale * token_scale + channel_center + token_center``:
        ``channel_*`` float32 ``[H, D]`` (:meth:`channel_affine`), ``token_*`` ``[B, T]`` or ``None``
        (:meth:`token_affine`): what decode kernels read."""
        return *self.channel_affine(stats), *self.token_affine(stored)

    def channel_affine(self, stats: ChannelStats) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse's per-channel ``(scale, center)``, from the calibration statistics alone (a decoder may keep
        them: they do not change from call to call)."""
        if self.mode == "channel_zscore":
            return stats.std.clamp_min(TINY), stats.mean
        if self.mode == "channel_range":
            return stats.half_range, stats.mean
        center = stats.mean if self.mode == "token_range" else torch.zeros_like(stats.mean)
        return torch.ones_like(stats.mean), center

    def token_affine(self, stored: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The inverse's per-token ``(scale, center)``, views of the stored parameters, or ``None``."""
        scale = stored["token_scale"].squeeze(1) if self.mode in ("token_zscore", "token_range") else None
        center = stored["token_center"].squeeze(1) if self.mode == "token_zscore" else None
        return scale, center

    def _token_params(self, stats: ChannelStats, stored: dict) -> tuple[torch.Tensor, torch.Tensor]:
        scale = stored["token_scale"].float().unsqueeze(-1)  # [B, 1, T, 1]
        if self.mode == "token_zscore":
            return stored["token_center"].float().unsqueeze(-1), scale
        return _per_channel(stats.mean).to(scale.device), scale
