"""Packed indices into per-(KV head, channel group) centroid tables, then the codec's normalisation undone
(:class:`~kvcomp.stages.codebook.CodebookQuantizer`: TemporalKV, ChannelKV, KVQuant, TurboQuant / EDEN):
``x = z * scale_c * scale_t + center_c + center_t``. Device functions: :mod:`kvcomp.kernels.formats.codebook_triton`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.kernels.formats.base import CallQuery, PayloadReader, Strided, four_programs, in_place
from kvcomp.stages.codebook import ChunkLayout, CodebookQuantizer
from kvcomp.stages.lloyd_max import TINY
from kvcomp.stages.normalization import affine_denormalize, per_token


class CodebookArgs(NamedTuple):
    data: Strided  # the codes
    codebooks: torch.Tensor
    ch_scale: torch.Tensor
    ch_center: torch.Tensor
    token_scale: tuple  # Strided, or () where none
    token_center: tuple


class CodebookConstants(NamedTuple):
    CODE_BITS: int
    CENTROIDS: int
    TL: int  # tokens per chunk
    CL: int  # channels per chunk
    GC: int  # channels per codebook group
    TOKEN_SCALE: bool
    TOKEN_CENTER: bool
    UNIT: bool


@dataclass
class CodebookReader(PayloadReader):
    """A :class:`~kvcomp.stages.codebook.CodebookQuantizer` payload and the normalisation to undo:
    ``codes`` uint8 ``[B, H, T/time_len, bytes]`` of ``code_bits``-bit indices into ``codebooks``
    ``[H, G, k, dim]``; per-channel ``channel_scale``/``channel_center`` ``[H, D]`` and optional per-token
    ``token_scale``/``token_center`` ``[B, T]``, or per token and head ``[B, H, T]`` (TurboQuant's norms).
    ``unit_norm`` (vLLM's TurboQuant norm correction): each token's vector, before its ``token_scale``, is
    rescaled to unit norm over all channels."""

    codes: torch.Tensor
    codebooks: torch.Tensor
    layout: ChunkLayout
    channel_scale: torch.Tensor
    channel_center: torch.Tensor
    token_scale: torch.Tensor | None = None
    token_center: torch.Tensor | None = None
    unit_norm: bool = False

    @property
    def num_centroids(self) -> int:
        return self.codebooks.shape[2]

    @property
    def wide_tile(self) -> bool:
        """One codebook for every channel group (TurboQuant, EDEN); per-group codebooks need narrow tiles."""
        return self.codebooks.shape[1] == 1

    def register_cap(self, narrow: bool, num_warps: int) -> int:
        """Four programs per multiprocessor in narrow tiles: per-channel-group codebooks (TemporalKV, ChannelKV,
        KVQuant) then spill, and still run 1.13-1.33x faster than at the compiler's 168-255 registers (H200, 16 x 32K,
        device time, ``benchmarks/sweep_decode_kernel.py``); a single codebook read in narrow tiles beside a residual
        sketch or a key offset (TurboQuant-prod, EDEN with ``center``) is predicted 10-12 % faster capped (static
        model, ``tools/kernel_model.py``; not measured). Wide tiles keep the compiler's choice."""
        return four_programs(num_warps) if narrow else 0

    @property
    def chunk_tokens(self) -> int:
        """A chunk's tokens (TemporalKV's): its centroid is read as one vector (``codebook_triton._chunk_tile``)."""
        return self.layout.time_len

    @property
    def code_bits(self) -> int:
        return CodebookQuantizer(self.layout, self.num_centroids).code_bits


    def kernel_args(self, query: CallQuery) -> tuple[CodebookArgs, CodebookConstants]:
        present = [t for t in (self.token_scale, self.token_center) if t is not None]
        tokens, s_b, s_h = in_place(*present) if present else ([], 0, 0)  # [B, T], or [B, H, T]
        read = iter(Strided(t, s_b, s_h) for t in tokens)
        scale, center = (() if t is None else next(read) for t in (self.token_scale, self.token_center))
        layout = self.layout
        return (CodebookArgs(Strided.of(self.codes), self.codebooks.contiguous(), self.channel_scale.float().contiguous(),
                             self.channel_center.float().contiguous(), scale, center),
                CodebookConstants(self.code_bits, self.num_centroids, layout.time_len, layout.channel_len,
                                  layout.group_channels, self.token_scale is not None, self.token_center is not None,
                                  self.unit_norm))

    def dequantize_unrotated(self) -> torch.Tensor:
        quantizer = CodebookQuantizer(self.layout, self.num_centroids)
        z = quantizer.decode(self.codes, self.codebooks, self.head_dim)
        if not self.unit_norm:
            return affine_denormalize(z, self.channel_scale, self.channel_center, self.token_scale, self.token_center)
        x = affine_denormalize(z, self.channel_scale, self.channel_center, None, self.token_center)
        return x / x.norm(dim=-1, keepdim=True).clamp_min(TINY) * per_token(self.token_scale)


def fused_encode_supported(layout: ChunkLayout, code_bits: int) -> bool:
    """Whether every codebook group fills whole bytes (then a program packs its group alone)."""
    return 8 % code_bits == 0 and (layout.group_channels // layout.channel_len * code_bits) % 8 == 0
