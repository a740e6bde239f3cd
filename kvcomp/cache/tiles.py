"""Decode-step attention on the torch path, read from the payloads tile by tile (flash-decoding in torch).

One query token per sequence attends to key and value segments in cache order: full-precision tensors
``[B, H, T, D]`` and :class:`~kvcomp.codecs.base.Payload` s, which ``reader(payload, kind)`` makes into
:class:`~kvcomp.kernels.formats.PayloadReader` s. The cached tokens are cut into tiles of at most ``tile`` tokens
that never straddle a segment of either stream; each tile's keys and values are decoded
(:meth:`~kvcomp.kernels.formats.PayloadReader.dequantize`), attended to, and merged with the tiles before it by the
running maximum and sum of the softmax (Dao et al.'s online softmax, as the split kernels merge their partials):
no decoded copy of a whole stream exists, and the working memory is a tile, whatever the context length.

A payload stored in a rotated basis (``x = inner @ R``, :class:`~kvcomp.kernels.formats.RotatedReader`) is read as
stored: its keys are scored against the query rotated by ``R^T`` and its values' share of the output is un-rotated
by ``R`` (a ``[R, D] x [D, D]`` product per tile instead of one per token). The result equals
:func:`~kvcomp.kernels.decode_attention.decode_attention_reference` over the same segments within float32 rounding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from kvcomp.codecs.base import Payload
from kvcomp.kernels.formats import PayloadReader, RotaryPositions
from kvcomp.kernels.formats.base import stored

TILE_VALUES = 1 << 18  # decoded values per stream and tile (1 MiB in float32, which a core's cache holds): the working memory


def tile_tokens(batch: int, heads: int, head_dim: int) -> int:
    """Tokens per tile: :data:`TILE_VALUES` decoded values per stream, a multiple of 64 tokens, at least 64."""
    return max(64, TILE_VALUES // (batch * heads * head_dim) // 64 * 64)


def granularity(payload: Payload) -> int:
    """The fewest tokens a slice of ``payload`` may start at a multiple of: every tensor's rows cover whole tokens
    (a per-channel group of KIVI's keys: 32 tokens per row of scales)."""
    n, step = payload.num_tokens, 1
    for tensor in payload.tensors.values():
        rows = tensor.shape[2]
        per_row = n // math.gcd(n, rows)
        step = step * per_row // math.gcd(step, per_row)
    return step


def narrow(payload: Payload, start: int, count: int) -> Payload:
    """Tokens ``start .. start + count - 1`` of ``payload`` (views; both multiples of :func:`granularity`, or
    ``count`` up to the end)."""
    n, tensors = payload.num_tokens, {}
    for name, tensor in payload.tensors.items():
        rows = tensor.shape[2]
        first, stop = start * rows // n, -(-(start + count) * rows // n)
        tensors[name] = tensor.narrow(2, first, stop - first)
    return Payload(tensors, count)


class _Stream:
    """One stream's segments with their first cache index; scores against, and weighted sums of, any token range
    within one segment."""

    def __init__(self, segments: list, kind: str, reader: Callable, rope: RotaryPositions | None):
        self.segments, self.kind, self.reader, self.rope = segments, kind, reader, rope
        self.starts, first = [], 0
        for segment in segments:
            self.starts.append(first)
            first += segment.num_tokens if isinstance(segment, Payload) else segment.shape[2]
        self.length = first
        self.rotated_queries = {}

    def bounds(self) -> list[int]:
        return self.starts + [self.length]

    def _covering(self, lo: int, hi: int):
        """The segment that holds tokens ``[lo, hi)`` and where they lie in what is read of it: ``(tensor or
        reader (wrappers unwrapped where only a rotation wraps it), its rotation or None, offset of ``lo``)``. A
        payload is read from the multiple of its :func:`granularity` at or before ``lo``."""
        index = max(i for i, s in enumerate(self.starts) if s <= lo)
        segment, start = self.segments[index], self.starts[index]
        if not isinstance(segment, Payload):
            return segment[:, :, lo - start:hi - start], None, 0
        step = granularity(segment)
        first = (lo - start) // step * step
        last = min(segment.num_tokens, -(-(hi - start) // step) * step)
        reader = self.reader(narrow(segment, first, last - first), self.kind)
        inner, wrapped = stored(reader)
        if wrapped.offset is None and wrapped.sketch is None and wrapped.rotation is not None:
            return inner, wrapped.rotation, lo - start - first
        if self.rope is not None:
            reader = _RopedReader(reader, dataclasses.replace(self.rope, first=self.rope.first + first))
        return reader, None, lo - start - first

    def scores(self, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``q [B, H, R, D]`` (float32) against keys ``[lo, hi)``: ``[B, H, R, hi - lo]``."""
        read, rotation, offset = self._covering(lo, hi)
        if rotation is not None:  # scored in the stored basis: the query rotated once per rotation
            if id(rotation) not in self.rotated_queries:
                self.rotated_queries[id(rotation)] = q @ rotation.float().transpose(-1, -2)
            q = self.rotated_queries[id(rotation)]
        if isinstance(read, torch.Tensor):
            return q @ read.float().transpose(-1, -2)
        return read.torch_scores(q)[..., offset:offset + hi - lo]

    def weigh(self, weights: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``sum_t weights[..., t] v_t`` over values ``[lo, hi)``: ``[B, H, R, D]`` (float32)."""
        read, rotation, offset = self._covering(lo, hi)
        if isinstance(read, torch.Tensor):
            return weights @ read.float()
        if offset or offset + hi - lo < read.num_tokens:  # what is read of the payload begins before / ends after
            weights = torch.nn.functional.pad(weights, (offset, read.num_tokens - offset - (hi - lo)))
        share = read.torch_values(weights)
        return share if rotation is None else share @ rotation.float()


class _RopedReader:
    """A key reader whose tokens are rotated by their positions (pre-RoPE codecs, rotated key offsets): read by
    decoding it (:meth:`~kvcomp.kernels.formats.PayloadReader.dequantize`)."""

    def __init__(self, reader: PayloadReader, rope: RotaryPositions):
        self.reader, self.rope, self.num_tokens = reader, rope, reader.num_tokens

    def torch_scores(self, q: torch.Tensor) -> torch.Tensor:
        return q @ self.reader.dequantize(self.rope).transpose(-1, -2)


def decode_attention_tiles(query: torch.Tensor, keys: list, values: list, kv_heads: int, scale: float,
                           valid: torch.Tensor | None, key_rope: RotaryPositions | None,
                           reader: Callable[[Payload, str], PayloadReader], tile: int | None = None) -> torch.Tensor:
    """Softmax attention of ``query [B, Hq, D]`` over the key and value segments of ``kv_heads`` heads (GQA: query
    head ``j`` reads KV head ``j // (Hq / H)``), ``valid [B, L]`` the cached tokens each sequence attends to (None:
    all), ``key_rope`` the rotation of the key payloads' tokens (pre-RoPE codecs), ``tile`` tokens per tile (default
    :func:`tile_tokens`). Returns ``[B, Hq, D]`` in the query's dtype."""
    key_stream, value_stream = _Stream(keys, "key", reader, key_rope), _Stream(values, "value", reader, None)
    b, hq, d = query.shape
    h = kv_heads
    tile = tile or tile_tokens(b, h, d)
    grouped = query.float().reshape(b, h, hq // h, d) * scale
    cuts = sorted(set(key_stream.bounds()) | set(value_stream.bounds()) | set(range(0, key_stream.length, tile)))
    running_max = torch.full((b, h, hq // h, 1), float("-inf"), device=query.device)
    total = torch.zeros_like(running_max)
    out = torch.zeros(b, h, hq // h, d, device=query.device)
    for lo, hi in zip(cuts, cuts[1:]):
        logits = key_stream.scores(grouped, lo, hi)  # [B, H, R, n]
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None, None, lo:hi], float("-inf"))
        new_max = torch.maximum(running_max, logits.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_max), 0.0, new_max)  # every token so far masked: weights stay zero
        weights = torch.exp(logits - safe)
        decay = torch.exp(running_max - safe)
        out = out * decay + value_stream.weigh(weights, lo, hi)
        total = total * decay + weights.sum(-1, keepdim=True)
        running_max = new_max
    out = torch.where(total > 0, out / total.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return out.reshape(b, hq, d).to(query.dtype)
