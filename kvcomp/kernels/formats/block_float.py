"""Codes naming the values of a small float format times one scale per block of channels (vLLM's NVFP4):
``x = levels[code] * s_block``. Device functions: :mod:`kvcomp.kernels.formats.block_float_triton`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.kernels.formats.base import CallQuery, PayloadReader, Strided
from kvcomp.stages.packing import unpack_bits


class BlockFloatArgs(NamedTuple):
    data: Strided  # the codes
    scales: Strided  # one per block of channels of each token
    levels: torch.Tensor


class BlockFloatConstants(NamedTuple):
    BITS: int
    BLOCK: int


@dataclass
class BlockFloatReader(PayloadReader):
    """Codes of ``bits`` bits naming the values of a small float format, ``levels[code]`` (float32 ``[2**bits]``,
    on the payload's device), times one scale per block of ``block`` channels of each token and head (``scales``
    ``[B, H, T, D/block]``, of a dtype the kernel loads natively): vLLM's NVFP4 (e2m1 codes, e4m3 block scales,
    the layer's global scale folded into ``levels``). ``codes`` uint8 ``[B, H, T, D*bits/8]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    levels: torch.Tensor
    bits: int
    block: int
    wide_tile = True


    def kernel_args(self, query: CallQuery) -> tuple[BlockFloatArgs, BlockFloatConstants]:
        return (BlockFloatArgs(Strided.of(self.codes), Strided.of(self.scales), self.levels),
                BlockFloatConstants(self.bits, self.block))

    def dequantize_unrotated(self) -> torch.Tensor:
        b, h, t, _ = self.codes.shape
        values = self.levels.float()[unpack_bits(self.codes, self.bits, self.head_dim).long()]
        return (values.view(b, h, t, -1, self.block) * self.scales.float()[..., None]).view(b, h, t, self.head_dim)
