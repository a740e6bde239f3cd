"""Log-domain Sinkhorn variance normalisation of a matrix (KVarN, arXiv 2606.03458; SINQ, arXiv 2509.22944).

A tile ``M [R, C]`` is written ``M = s_row * B * s_col`` with a positive scale per row ``s_row [R, 1]`` and per
column ``s_col [1, C]``, chosen so that the rows and the columns of ``B`` have (nearly) equal standard deviations.
As the authors' reference code computes it (``sinkhorn.py`` of huawei-csl/KVarN's vLLM backend, and the PyTorch
golden of its Ascend kernel), starting from ``log s_col = log s_row = 0``, each of ``iterations`` rounds does

1. ``log s_col += log clip(std_rows(M / s_col / s_row), 1e-3, 1e3)``, then ``log s_col`` clipped to
   ``[-0.3, 10]`` (std over the rows of each column, unbiased);
2. the same for ``log s_row`` with the std over the columns of each row of the updated ``M / s_col / s_row``;

and keeps the scales of the round (or the start) with the lowest imbalance
``max(std_cols) / min(std_cols) + max(std_rows) / min(std_rows)`` (2 for a perfectly balanced tile; a later
round wins ties). Every leading dimension is a separate tile. Computed in float32 like the reference: a tile whose
squares overflow float32 (entries beyond about 1e19) has an infinite std and keeps the scales it has.
"""

from __future__ import annotations

import torch

STD_CLIP = (1e-3, 1e3)  # the reference's clamp of each std before its log
LOG_SCALE_CLIP = (-0.3, 10.0)  # the reference's clamp of each log scale: scales in [0.74, 22026]
TINY_STD = 1e-8  # the reference's floor of the smallest std in the imbalance


def imbalance(m: torch.Tensor) -> torch.Tensor:
    """``max/min`` of the column stds plus ``max/min`` of the row stds of each tile ``[..., R, C]`` -> ``[...]``."""
    col, row = m.std(dim=-2), m.std(dim=-1)
    return (col.amax(-1) / col.amin(-1).clamp_min(TINY_STD)) + (row.amax(-1) / row.amin(-1).clamp_min(TINY_STD))


def _log_scale(log_s: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (log_s + std.clamp(*STD_CLIP).log()).clamp(*LOG_SCALE_CLIP)


def variance_normalize(m: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(balanced, s_col, s_row)`` of tiles ``m [..., R, C]`` (``R, C >= 2``): float32
    ``balanced = m / s_col / s_row``, ``s_col [..., 1, C]`` and ``s_row [..., R, 1]`` (see the module docstring)."""
    m = m.float()
    log_col = m.new_zeros(*m.shape[:-2], 1, m.shape[-1])
    log_row = m.new_zeros(*m.shape[:-1], 1)
    best_col, best_row, best = log_col, log_row, imbalance(m)
    for _ in range(iterations):
        log_col = _log_scale(log_col, (m / log_col.exp() / log_row.exp()).std(dim=-2, keepdim=True))
        log_row = _log_scale(log_row, (m / log_col.exp() / log_row.exp()).std(dim=-1, keepdim=True))
        score = imbalance(m / log_col.exp() / log_row.exp())
        better = (score <= best)[..., None, None]
        best_col, best_row = torch.where(better, log_col, best_col), torch.where(better, log_row, best_row)
        best = torch.where(better[..., 0, 0], score, best)
    s_col, s_row = best_col.exp(), best_row.exp()
    return m / s_col / s_row, s_col, s_row
