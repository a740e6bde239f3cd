"""Values of a dtype the kernel loads natively (float8, int8) times a scale: vLLM's ``fp8`` / ``fp8_per_token_head``
caches and ``int8_per_token_head``, TurboQuant's k8 keys. Device functions: :mod:`kvcomp.kernels.formats.scaled_triton`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.kernels.formats.base import CallQuery, PayloadReader, Strided


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


    def kernel_args(self, query: CallQuery) -> tuple[ScaledArgs, ScaledConstants]:
        scale = Strided.of(self.scale) if self.per_token else self.scale.float().reshape(1).contiguous()
        return ScaledArgs(Strided.of(self.codes.view(self.dtype)), scale), ScaledConstants(self.per_token)

    def dequantize_unrotated(self) -> torch.Tensor:
        return self.codes.view(self.dtype).float() * self.scale.float()
