"""HIGGS: Hadamard rotation + MSE-optimal Gaussian grid, per token (AQUA-KV spec §3.4).

For one token's vector ``r`` of ``D`` values (all KV heads of a layer, keys or values):

1. zero-pad to ``D' = ceil(D / g) g`` and split into ``m = D' / g`` groups ``r_j`` of ``g`` (a power of two);
2. ``s_j = |r_j|_2``, stored in ``scale_dtype`` (16 bits; the codes are computed with the rounded scale; float32
   in a block whose norms ``scale_dtype`` cannot hold, e.g. beyond float16's 65504);
3. ``u_j = H_g r_j / s_j`` (unnormalised Walsh-Hadamard, so ``|u_j|^2 = g`` and its coordinates are
   close to ``N(0, 1)``);
4. every ``d`` consecutive coordinates of ``u_j`` are replaced by the index of their nearest point of an
   ``n``-point grid MSE-optimal for ``N(0, I_d)`` (:mod:`kvcomp.stages.grids`), packed at ``log2 n`` bits;
5. decode: ``r_hat_j = H_g (s_j u_hat_j) / g``, cropped to ``D`` (float32 throughout: pre-RoPE key
   norms can exceed float16's range in the rotated domain).

Bits per value: ``log2(n) / d * D' / D + 16 m / D`` (2.016 / 3.016 / 4.016 for d = 2, n = 16 / 64 / 256,
D = g = 1024).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvcomp.stages.grids import nearest
from kvcomp.stages.hadamard import fwht, grouped
from kvcomp.stages.packing import pack_bits, packed_length, unpack_bits
from kvcomp.stages.ranges import stable_norm, stored_in


@dataclass(frozen=True, eq=False)
class HiggsQuantizer:
    """Quantize vectors ``[..., D]`` with the ``grid [n, d]`` in Hadamard groups of ``group`` values."""

    grid: torch.Tensor
    group: int
    scale_dtype: torch.dtype = torch.float16
    on_device: dict = field(default_factory=dict, repr=False)  # the grid per device: one copy, not one per call

    def grid_on(self, device: torch.device) -> torch.Tensor:
        if device not in self.on_device:
            self.on_device[device] = self.grid.to(device)
        return self.on_device[device]

    @property
    def code_bits(self) -> int:
        return int(math.log2(self.grid.shape[0]))

    def num_codes(self, dim: int) -> int:
        return -(-dim // self.group) * self.group // self.grid.shape[1]

    def bits_per_value(self, dim: int) -> float:
        """Exact stored bits per value of a ``dim``-vector: packed codes and one scale per group."""
        groups = -(-dim // self.group)
        scale_bits = torch.finfo(self.scale_dtype).bits
        return (8 * packed_length(self.num_codes(dim), self.code_bits) + scale_bits * groups) / dim

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        """``{"codes": uint8 [..., bytes], "scale": [..., m]}`` of ``x [..., D]`` (``range_checks``:
        :mod:`kvcomp.stages.ranges`)."""
        groups, _ = grouped(x.float(), self.group)
        scale = stored_in(stable_norm(groups), self.scale_dtype, range_checks)
        u = fwht(groups) / scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        d = self.grid.shape[1]
        index = nearest(u.reshape(*u.shape[:-2], -1, d), self.grid_on(u.device))
        return {"codes": pack_bits(index, self.code_bits), "scale": scale}

    def decode(self, tensors: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
        """The float32 ``[..., dim]`` reconstruction."""
        scale = tensors["scale"].float()
        index = unpack_bits(tensors["codes"], self.code_bits, self.num_codes(dim)).long()
        u = self.grid_on(scale.device)[index].reshape(*scale.shape, self.group)
        r = fwht(u * scale[..., None]) / self.group
        return r.flatten(-2)[..., :dim]
