"""Values of a dtype the kernel loads natively (float8, int8) times a scale: vLLM's ``fp8`` / ``fp8_per_token_head``
caches and ``int8_per_token_head``, TurboQuant's k8 keys. Device functions: :mod:`kvcomp.kernels.formats.scaled_triton`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.kernels.formats.base import CallQuery, PayloadReader, Strided, four_programs


class ScaledArgs(NamedTuple):
    data: Strided
    scale: object  # Strided [B, H, T, 1] (per token and head), or a float32 tensor [1] (per tensor)


class ScaledConstants(NamedTuple):
    TOKEN_SCALE: bool


@dataclass
class ScaledReader(PayloadReader):
    """Values of a dtype the kernel loads natively, times a scale: vLLM's ``fp8`` / ``fp8_per_token_head`` caches
    (:mod:`kvcomp.codecs.fp8`) and ``int8_per_token_head`` (:mod:`kvcomp.codecs.int_token_head`). ``codes``
    ``[B, H, T, D]`` of ``dtype`` (float8: its bit patterns as uint8; int8), times ``scale``: one float32 value
    (per tensor) or ``[B, H, T, 1]`` (per token and head)."""

    codes: torch.Tensor
    dtype: torch.dtype
    scale: torch.Tensor

    @property
    def per_token(self) -> bool:
        return self.scale.dim() == 4

    def register_cap(self, narrow: bool, num_warps: int) -> int:
        """128 registers per thread in ``narrow`` tiles at 2 warps (:meth:`crowded_warps`; eight programs per
        multiprocessor, without spills: fp8 compiles to 168 uncapped under Triton 3.6, six programs); launches of 4
        warps take at most 128 (fp8 104, int8 per token-head 128) and are left their choice."""
        return four_programs(4) if narrow and num_warps < 4 else 0

    def crowded_warps(self, narrow: bool) -> int:
        """2 in ``narrow`` tiles at a head_dim of at most 128, as packed ints
        (:meth:`~kvcomp.kernels.formats.uniform.UniformReader.crowded_warps`): vLLM's fp8 at 16 x 32K is predicted
        0.610 ms of device time against 0.758 with 4 warps, int8 per token-head 0.580 against 0.758 (static model,
        ``tools/kernel_model.py``; not measured)."""
        return 2 if narrow and self.head_dim <= 128 else 0

    def kernel_args(self, query: CallQuery) -> tuple[ScaledArgs, ScaledConstants]:
        scale = Strided.of(self.scale) if self.per_token else self.scale.float().reshape(1).contiguous()
        return ScaledArgs(Strided.of(self.codes.view(self.dtype)), scale), ScaledConstants(self.per_token)

    def dequantize_unrotated(self) -> torch.Tensor:
        return self.codes.view(self.dtype).float() * self.scale.float()
