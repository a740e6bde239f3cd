"""Expected Attention (Devoto et al. 2025, arXiv 2510.00636; kvpress's ``ExpectedAttentionPress``): each token is
scored by the attention that future queries are expected to pay it. The prefill's queries before RoPE (the first
``sinks`` left out) give a Gaussian per query head, mean ``mu`` and covariance ``S`` (biased); RoPE averaged over
the next ``n_future_positions`` positions, ``R = mean_p R_p``, moves it to ``mu' = R mu``, ``S' = R S R^T``; the
expected logit of key ``k`` is the log-moment ``z = mu'.k / sqrt(d) + k^T S' k / (2 d)`` (the second term with
``use_covariance``), softmaxed over the non-sink tokens, averaged over the query heads of each KV head and, with
``use_vnorm``, weighted ``(s + epsilon) ||v||``. The sinks are always kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.errors import ConfigError
from kvcomp.presses.base import Prefill, Press, PressConfig, kept_first, register
from kvcomp.stages.rope import rotate_half, undo_rope


@dataclass
class ExpectedAttentionConfig(PressConfig):
    name: str = "expected_attention"
    n_future_positions: int = 512  # kvpress's defaults
    sinks: int = 4  # kvpress's n_sink: left out of the statistics, always kept
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0  # kvpress's evaluation registry uses 1e-2 (under AdaKV)

    def __post_init__(self):
        super().__post_init__()
        if self.n_future_positions < 1 or self.sinks < 0:
            raise ConfigError(f"n_future_positions={self.n_future_positions} must be >= 1 "
                              f"and sinks={self.sinks} >= 0")

    def min_prompt(self) -> tuple[int, str]:
        return self.sinks + 2, f"sinks={self.sinks} and two more tokens for query statistics"


@register
class ExpectedAttentionPress(Press):
    name = "expected_attention"
    config_class = ExpectedAttentionConfig

    def validate(self) -> None:
        if not self.model.has_rope:
            raise ConfigError(f"press expected_attention averages RoPE over future positions; model {self.model.name} "
                              "has none")

    def scores(self, prefill: Prefill) -> torch.Tensor:
        cfg, n = self.config, prefill.length
        if prefill.rope is None or prefill.rotary is None:
            raise ConfigError("press expected_attention needs the layer's RoPE cos/sin and fixed RoPE frequencies "
                             "(kvcomp's attention, a RoPE type whose frequencies do not change with the length)")
        cos, sin = prefill.rope
        q = undo_rope(prefill.query.float(), cos.float(), sin.float())[:, :, cfg.sinks:]  # before RoPE, no sinks
        mu = q.mean(dim=2)  # [B, Hq, D]
        centred = q - mu[:, :, None]
        rotary = prefill.rotary
        future = torch.arange(n, n + cfg.n_future_positions, device=q.device, dtype=torch.float32)
        angles = future[:, None] * rotary.inv_freq.float().to(q.device)[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        mean_cos, mean_sin = (f(angles).mean(dim=0) * rotary.scaling for f in (torch.cos, torch.sin))

        def averaged_rope(x):  # x R^T for row vectors: each row rotated by the averaged RoPE
            return x * mean_cos + rotate_half(x) * mean_sin

        keys = prefill.keys.float()[:, :, cfg.sinks:]
        group = prefill.query.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [B, Hq, m, D]
        d = keys.shape[-1]
        logits = (keys @ averaged_rope(mu)[..., None])[..., 0] / d**0.5
        if cfg.use_covariance:
            rotated = averaged_rope(centred)  # q R^T: its covariance is R S R^T
            covariance = rotated.transpose(-1, -2) @ rotated / rotated.shape[2]
            logits = logits + ((keys @ covariance) * keys).sum(-1) / (2 * d)
        weights = logits.softmax(dim=-1)
        b, hq, m = weights.shape
        scores = weights.view(b, hq // group, group, m).mean(dim=2)
        if cfg.use_vnorm:
            scores = (scores + cfg.epsilon) * prefill.values.float()[:, :, cfg.sinks:].norm(dim=-1)
        return kept_first(scores, cfg.sinks, at_end=False)
