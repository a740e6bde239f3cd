"""Codebook (product) quantization of ``[batch, heads, tokens, head_dim]`` blocks in chunks.

A :class:`ChunkLayout` says how a block is cut into chunks (vectors) and which codebook each chunk uses:

- a chunk covers ``time_len`` adjacent tokens x ``channel_len`` adjacent channels (flattened, time-major);
- the channels are split into groups of ``group_channels``; every chunk inside a group (all tokens, and
  all ``group_channels / channel_len`` chunk columns of the group) shares one codebook per KV head.

The three codebook codecs of the TemporalKV thesis are three layouts (T §3.3, §5.2, Tab. 2.3):

================  ==========  ===========  ================
method            time_len    channel_len  group_channels
================  ==========  ===========  ================
TemporalKV-l      l           1            g (= l)
ChannelKV-l       1           l            l
KVQuant (scalar)  1           1            g (= l)
================  ==========  ===========  ================

Codes are stored as ``[B, H, T / time_len, head_dim / channel_len]`` (tokens, or token groups, on
dim 2), bit-packed along the last dim when a codebook has fewer than 256 entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.stages.kmeans import nearest_centroid
from kvcomp.stages.packing import pack_bits, packed_length, unpack_bits


@dataclass(frozen=True)
class ChunkLayout:
    time_len: int
    channel_len: int
    group_channels: int

    @property
    def dim(self) -> int:
        """Length of one chunk vector."""
        return self.time_len * self.channel_len

    def num_groups(self, head_dim: int) -> int:
        return head_dim // self.group_channels

    def check(self, head_dim: int) -> str | None:
        """Why this layout cannot cut ``head_dim`` channels, or ``None``."""
        if self.group_channels % self.channel_len:
            return f"group of {self.group_channels} channels is not a whole number of {self.channel_len}-channel chunks"
        if head_dim % self.group_channels:
            return f"head_dim={head_dim} is not a multiple of the {self.group_channels}-channel codebook group"
        return None

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, D]`` -> ``[H, G, N, dim]``: the chunks each (head, group) codebook codes."""
        b, h, t, d = x.shape
        tl, cl, gc = self.time_len, self.channel_len, self.group_channels
        x = x.reshape(b, h, t // tl, tl, d // gc, gc // cl, cl)
        # -> [H, G, B, T/tl, gc/cl, tl, cl]
        x = x.permute(1, 4, 0, 2, 5, 3, 6)
        return x.reshape(h, d // gc, -1, tl * cl)

    def from_chunks(self, chunks: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
        """Inverse of :meth:`to_chunks`: ``[H, G, N, dim]`` -> ``[B, H, T, D]``."""
        h, g = chunks.shape[:2]
        tl, cl, gc = self.time_len, self.channel_len, self.group_channels
        x = chunks.reshape(h, g, batch, tokens // tl, gc // cl, tl, cl)
        x = x.permute(2, 0, 3, 5, 1, 4, 6)  # [B, H, T/tl, tl, G, gc/cl, cl]
        return x.reshape(batch, h, tokens, g * gc)

    def codes_to_storage(self, codes: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
        """Chunk codes ``[H, G, N]`` -> ``[B, H, T/tl, D/cl]`` (token groups on dim 2)."""
        h, g = codes.shape[:2]
        per_group = self.group_channels // self.channel_len
        c = codes.reshape(h, g, batch, tokens // self.time_len, per_group)
        return c.permute(2, 0, 3, 1, 4).reshape(batch, h, tokens // self.time_len, g * per_group)

    def codes_from_storage(self, stored: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`codes_to_storage`."""
        b, h, t_groups, columns = stored.shape
        per_group = self.group_channels // self.channel_len
        g = columns // per_group
        c = stored.reshape(b, h, t_groups, g, per_group).permute(1, 3, 0, 2, 4)
        return c.reshape(h, g, -1)


@dataclass(frozen=True)
class CodebookQuantizer:
    """Nearest-centroid coding of chunks with per-(head, group) codebooks ``[H, G, k, dim]``."""

    layout: ChunkLayout
    num_centroids: int

    @property
    def code_bits(self) -> int:
        return max(1, (self.num_centroids - 1).bit_length())

    def bits_per_value(self, head_dim: int) -> float:
        """Stored code bits per value (codes are bit-packed along the channel axis of a token group)."""
        columns = head_dim // self.layout.channel_len
        return 8 * packed_length(columns, self.code_bits) / (columns * self.layout.dim)

    def encode(self, z: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
        """``z [B, H, T, D]`` (normalised) -> packed uint8 codes ``[B, H, T/tl, bytes]`` (torch; the fused
        kernel beside it: :func:`kvcomp.kernels.codebook_encode.encode_codebook`)."""
        b, h, t, _ = z.shape
        chunks = self.layout.to_chunks(z.float())
        hh, g, n, dim = chunks.shape
        codes = nearest_centroid(chunks.reshape(hh * g, n, dim), codebooks.reshape(hh * g, -1, dim))
        stored = self.layout.codes_to_storage(codes.view(hh, g, n).to(torch.uint8), b, t)
        return pack_bits(stored, self.code_bits)

    def decode(self, packed: torch.Tensor, codebooks: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Packed codes -> normalised ``[B, H, T, D]`` (float32) by gathering centroids."""
        b, h, t_groups, _ = packed.shape
        stored = unpack_bits(packed, self.code_bits, head_dim // self.layout.channel_len)
        codes = self.layout.codes_from_storage(stored).long()  # [H, G, N]
        dim = self.layout.dim
        chunks = torch.gather(codebooks.float(), 2, codes.unsqueeze(-1).expand(-1, -1, -1, dim))
        return self.layout.from_chunks(chunks, b, t_groups * self.layout.time_len)
