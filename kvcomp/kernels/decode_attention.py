"""Decode-step attention read straight from compressed K/V payloads (flash-decoding over cache segments).

A decode step has one query token per sequence. Its keys and values are each a list of *segments* in
cache order: full-precision tensors ``[B, H, T, D]`` (sinks, the full-precision tail, the fresh token)
and payload *readers* that say how a kernel decodes an encoded block in registers:

- :class:`UniformReader`: packed 1/2/4/8-bit codes with per-group scale and zero-point
  (``x = code * scale + zero``; KIVI keys per channel, values per token; ``uniform``);
- :class:`CodebookReader`: packed indices into per-(KV head, channel group) centroid tables, then the
  codec's normalisation undone (``x = z * scale_c * scale_t + center_c + center_t``; TemporalKV,
  ChannelKV, KVQuant);
- :class:`SketchReader` (keys only): QJL's sign bits and norms, scored without decoding a key.

Keys of pre-RoPE codecs carry :class:`RotaryPositions`: the kernel rotates each decoded key by its
position's angle ``pos * inv_freq`` (as the model's rotary embedding does) before the dot product.

:func:`decode_attention_reference` is the torch reference: it dequantizes every reader
(:meth:`PayloadReader.dequantize`), concatenates the segments and runs softmax attention in float32.
:func:`decode_attention` dispatches to the Triton kernels of
:mod:`kvcomp.kernels.decode_attention_triton`, which never write decoded K/V to memory: split-K programs
each reduce a slice of the tokens to a partial output and its log-sum-exp, and a merge kernel combines
the partials of all slices and segments. The kernels read the step's attention mask per token (left
padding, ragged batches, any pattern).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvcomp.kernels.qjl_scores import SketchedKeys, reconstruct_keys
from kvcomp.stages.codebook import ChunkLayout, CodebookQuantizer
from kvcomp.stages.normalization import affine_denormalize
from kvcomp.stages.rope import apply_rope
from kvcomp.stages.uniform_quantizer import GroupQuantizer


@dataclass
class RotaryPositions:
    """RoPE of the tokens of one key payload, recomputed from positions as the model's rotary embedding
    does: ``cos = cos(pos * inv_freq) * scaling`` rounded to the model's ``dtype`` (HF's cos/sin dtype).

    ``positions [B, L]``: the position id of every cached token; the payload's token ``t`` is cached
    token ``first + t``.
    """

    positions: torch.Tensor
    first: int
    inv_freq: torch.Tensor  # [D/2] float32
    scaling: float
    dtype: torch.dtype

    def cos_sin(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, D]`` (float32) of the payload's ``num_tokens`` tokens."""
        pos = self.positions[:, self.first : self.first + num_tokens].float()
        freqs = pos[..., None] * self.inv_freq.float().to(pos.device)
        angles = torch.cat([freqs, freqs], dim=-1)
        return tuple((f(angles) * self.scaling).to(self.dtype).float() for f in (torch.cos, torch.sin))


@dataclass
class PayloadReader:
    """What a kernel needs to read one encoded segment; subclasses define the format."""

    num_tokens: int
    head_dim: int

    def dequantize_unrotated(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, rope: RotaryPositions | None = None) -> torch.Tensor:
        """The segment decoded in torch, ``[B, H, T, D]`` float32 (rotated when ``rope`` is given)."""
        x = self.dequantize_unrotated()
        if rope is None:
            return x
        return apply_rope(x, *rope.cos_sin(self.num_tokens))


@dataclass
class UniformReader(PayloadReader):
    """A :class:`~kvcomp.stages.uniform_quantizer.GroupQuantizer` payload: ``codes`` uint8
    ``[B, H, T, D*bits/8]``; ``scale``/``zero`` ``[B, H, T, D/G]`` (per token) or ``[B, H, T/G, D]``
    (per channel)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    per_channel: bool

    @classmethod
    def of(cls, quantizer: GroupQuantizer, payload, head_dim: int) -> UniformReader:
        """The reader of a :class:`~kvcomp.codecs.base.Payload` that ``quantizer`` encoded."""
        t = payload.tensors
        return cls(payload.num_tokens, head_dim, t["codes"], t["scale"], t["zero"], quantizer.bits, quantizer.group_size,
                   quantizer.axis == "per_channel")

    def dequantize_unrotated(self) -> torch.Tensor:
        quantizer = GroupQuantizer(self.bits, self.group_size, "per_channel" if self.per_channel else "per_token")
        return quantizer.decode({"scale": self.scale, "zero": self.zero, "codes": self.codes}, self.head_dim, torch.float32)


@dataclass
class CodebookReader(PayloadReader):
    """A :class:`~kvcomp.stages.codebook.CodebookQuantizer` payload and the normalisation to undo:
    ``codes`` uint8 ``[B, H, T/time_len, bytes]`` of ``code_bits``-bit indices into ``codebooks``
    ``[H, G, k, dim]``; per-channel ``channel_scale``/``channel_center`` ``[H, D]`` and optional per-token
    ``token_scale``/``token_center`` ``[B, T]``."""

    codes: torch.Tensor
    codebooks: torch.Tensor
    layout: ChunkLayout
    channel_scale: torch.Tensor
    channel_center: torch.Tensor
    token_scale: torch.Tensor | None = None
    token_center: torch.Tensor | None = None

    @property
    def num_centroids(self) -> int:
        return self.codebooks.shape[2]

    @property
    def code_bits(self) -> int:
        return CodebookQuantizer(self.layout, self.num_centroids).code_bits

    def dequantize_unrotated(self) -> torch.Tensor:
        quantizer = CodebookQuantizer(self.layout, self.num_centroids)
        z = quantizer.decode(self.codes, self.codebooks, self.head_dim)
        return affine_denormalize(z, self.channel_scale, self.channel_center, self.token_scale, self.token_center)


@dataclass
class SketchReader(PayloadReader):
    """QJL's sign-sketched keys (:class:`~kvcomp.kernels.qjl_scores.SketchedKeys`). The kernel scores them
    from their sign bits (:mod:`kvcomp.kernels.qjl_scores`: Eq. 4 plus the outlier term); the reference
    decodes ``k_hat`` (:func:`~kvcomp.kernels.qjl_scores.reconstruct_keys`), whose logits are the same."""

    keys: SketchedKeys

    def dequantize_unrotated(self) -> torch.Tensor:
        return reconstruct_keys(self.keys, self.head_dim)


Segment = torch.Tensor | PayloadReader


def segment_length(segment: Segment) -> int:
    return segment.num_tokens if isinstance(segment, PayloadReader) else segment.shape[2]


def materialize(segments: list[Segment], rope: RotaryPositions | None = None) -> torch.Tensor:
    """Concatenate a stream's segments, readers dequantized (``rope``: the key rotation of readers)."""
    parts = [s.dequantize(rope) if isinstance(s, PayloadReader) else s.float() for s in segments]
    return torch.cat(parts, dim=2)


def decode_attention_reference(
    query: torch.Tensor,
    key_segments: list[Segment],
    value_segments: list[Segment],
    scale: float,
    valid: torch.Tensor | None = None,
    key_rope: RotaryPositions | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Softmax attention of one query token per sequence, ``query [B, Hq, D]`` -> ``[B, Hq, D]``, over the
    segments (GQA: query head ``j`` reads KV head ``j // (Hq / H)``). ``valid [B, L]``: the cached tokens
    each sequence attends to (default all); ``key_rope``: rotation of key readers. Computed in float32 and
    returned in the query's dtype, or computed and returned in ``dtype`` (float64: the GPU checks)."""
    compute = dtype or torch.float32
    keys, values = materialize(key_segments, key_rope).to(compute), materialize(value_segments).to(compute)
    b, hq, d = query.shape
    h, length = keys.shape[1], keys.shape[2]
    grouped = query.to(compute).reshape(b, h, hq // h, d)
    logits = grouped @ keys.transpose(-1, -2) * scale  # [B, H, R, L]
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :length], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a sequence with no valid token gets zeros
    return (probs @ values).reshape(b, hq, d).to(dtype or query.dtype)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (the GPU benchmarks' correctness column)."""
    reference = reference.double()
    return ((out.double() - reference).norm() / reference.norm()).item()


@dataclass
class ValidTokens:
    """The cached tokens each sequence attends to in one decode step, ``mask [B, L]`` (bool), made once per
    step and shared by every layer; :attr:`as_bytes` is the kernels' copy (one byte per token)."""

    mask: torch.Tensor

    @cached_property
    def as_bytes(self) -> torch.Tensor:
        return self.mask.to(torch.uint8).contiguous()


def decode_attention(
    query: torch.Tensor,
    key_segments: list[Segment],
    value_segments: list[Segment],
    scale: float,
    valid: torch.Tensor | ValidTokens | None = None,
    key_rope: RotaryPositions | None = None,
    backend: str = "torch",
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`decode_attention_reference` (``backend="torch"``) or the Triton kernels (``"triton"``).
    ``valid`` covers exactly the cached tokens (``[B, L]``, or the step's :class:`ValidTokens`)."""
    if isinstance(valid, torch.Tensor):
        valid = ValidTokens(valid)
    if backend == "triton":
        from kvcomp.kernels.decode_attention_triton import decode_attention_triton

        mask = None if valid is None else valid.as_bytes
        return decode_attention_triton(query, key_segments, value_segments, scale, mask, key_rope=key_rope,
                                       num_splits=num_splits)
    return decode_attention_reference(query, key_segments, value_segments, scale, None if valid is None else valid.mask, key_rope)
