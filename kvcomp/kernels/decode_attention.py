"""Decode-step attention read straight from compressed K/V payloads (flash-decoding over cache segments).

A decode step has one query token per sequence. Its keys and values are each a list of *segments* in
cache order: full-precision tensors ``[B, H, T, D]`` (sinks, the full-precision tail, the fresh token)
and payload *readers* that say how a kernel decodes an encoded block in registers:

- :class:`UniformReader`: packed codes of 1 to 8 bits (a little-endian bit stream: 3, 5, 6 and 7-bit codes
  straddle bytes) with per-group scale and zero-point (``x = code * scale + zero``; KIVI keys per channel,
  values per token; ``uniform``; vLLM's TurboQuant values);
- :class:`CodebookReader`: packed indices into per-(KV head, channel group) centroid tables, then the
  codec's normalisation undone (``x = z * scale_c * scale_t + center_c + center_t``; TemporalKV,
  ChannelKV, KVQuant; TurboQuant / EDEN, with vLLM's norm correction ``z`` rescaled to unit norm first);
- :class:`BlockFloatReader`: packed codes naming small-float values times one scale per block of channels
  (``x = levels[code] * s_block``; vLLM's ``nvfp4``);
- :class:`SketchReader` (keys only): QJL's sign bits and norms, scored without decoding a key;
- :class:`SignReader` (values only): sign bits times a norm per token (``x = ||r|| sign``);
- :class:`ResidualSketchReader`: any of these plus the 1-bit sketch of its residual (TurboQuant-prod,
  ``x = inner + sqrt(pi/2)/d ||r|| S^T sign(S r)``): the sketch's score added to each key's, the values' sketch
  weighted in its own basis over the same keys and taken back by ``S``;
- :class:`ScaledReader`: float8 or int8 values loaded natively, times a per-tensor or per-(token, head) scale
  (``x = fp8 * s``; vLLM's ``fp8``, ``fp8_per_token_head`` and ``int8_per_token_head`` caches, TurboQuant's k8 keys);
- :class:`RotatedReader`: any of these stored in a rotated basis (``x = inner @ R``: vLLM's int4 per token and
  head, OSCAR, TurboQuant / EDEN), read with the query rotated and the output un-rotated;
- :class:`OffsetReader`: any of these stored less an offset per KV head (``center``): values ``x = inner + c``,
  keys ``x = inner + R_p c`` (the offset rotated to the token's position), read by adding ``q . R_p c`` to each
  score and ``c`` to the output.

Keys of pre-RoPE codecs carry :class:`RotaryPositions`: the kernel rotates each decoded key by its
position's angle ``pos * inv_freq`` (as the model's rotary embedding does) before the dot product.

:func:`decode_attention_reference` is the torch reference: it dequantizes every reader
(:meth:`PayloadReader.dequantize`), concatenates the segments and runs softmax attention in float32.
:func:`decode_attention` dispatches to the Triton kernels of
:mod:`kvcomp.kernels.decode_attention_triton`, which never write decoded K/V to memory: split-K programs
each reduce a slice of the tokens to a partial output and its log-sum-exp, and a merge kernel combines
the partials of all slices and segments. The kernels skip each sequence's tiles outside its span of valid tokens
(:attr:`ValidTokens.spans`: left padding, ragged batches, a sliding window) and read the step's attention mask per
token only where that span holds a masked token (any pattern).
"""

from __future__ import annotations

from functools import cached_property

import torch

from kvcomp.kernels.decode_plan import DecodeStep
from kvcomp.kernels.formats import PayloadReader, RotaryPositions, Segment


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


SPAN = 4  # int32 per sequence in :attr:`ValidTokens.spans`: first, stop, exact, (unused)


class ValidTokens:
    """The cached tokens each sequence attends to in one decode step, ``mask [B, L]`` (bool), made once per
    step and shared by every layer. The kernels read :attr:`spans`, and :attr:`as_bytes` (one byte per token) only
    for a sequence whose valid tokens are not one run."""

    def __init__(self, mask: torch.Tensor, spans: torch.Tensor | None = None):
        self.mask = mask
        self._spans = spans
        self._parts: dict[tuple, ValidTokens] = {}  # columns / without, made once for every layer of the step

    @cached_property
    def as_bytes(self) -> torch.Tensor:
        mask = self.mask
        if mask.dtype == torch.bool and mask.stride(-1) == 1:
            return mask.view(torch.uint8)
        return mask.to(torch.uint8).contiguous()

    @property
    def spans(self) -> torch.Tensor:
        """Per sequence, int32 ``[B, SPAN]``: ``first, stop, exact``, where every valid token lies in ``[first, stop)``
        and ``exact`` (1) says every token there is valid: the kernels skip the tiles outside the span and read the
        mask only where it is not exact. Made on the mask's device (no host sync): a left-padded, sliding-window or
        unpadded mask is one exact run; a sequence with no valid token an empty one."""
        if self._spans is None:
            mask = self.mask.bool()
            b, length = mask.shape
            index = torch.arange(length, device=mask.device)
            count = mask.sum(-1)
            first = torch.where(mask, index, length).amin(-1) if length else count
            stop = torch.where(mask, index + 1, 0).amax(-1) if length else count
            first = torch.where(count > 0, first, 0)
            exact = count == stop - first
            self._spans = torch.stack([first, stop, exact.long(), torch.zeros_like(count)], -1).to(torch.int32)
        return self._spans

    def columns(self, lo: int, hi: int) -> "ValidTokens":
        """The mask of cached tokens ``[lo, hi)`` (a payload's launch group), its spans derived from these; the same
        object for every layer (one copy per step into a CUDA-graph workspace)."""
        if ("in", lo, hi) not in self._parts:
            self._parts["in", lo, hi] = ValidTokens(self.mask[:, lo:hi], _kept_spans(self.spans, lo, hi, True))
        return self._parts["in", lo, hi]

    def without(self, lo: int, hi: int) -> "ValidTokens":
        """The mask of the cached tokens outside ``[lo, hi)``, the rest placed after ``lo`` (as :meth:`columns`)."""
        if ("out", lo, hi) not in self._parts:
            mask = torch.cat([self.mask[:, :lo], self.mask[:, hi:]], 1)
            self._parts["out", lo, hi] = ValidTokens(mask, _kept_spans(self.spans, lo, hi, False))
        return self._parts["out", lo, hi]


def _kept_spans(spans: torch.Tensor, lo: int, hi: int, inside: bool) -> torch.Tensor:
    """Spans after keeping only tokens ``[lo, hi)`` (``inside``) or only those outside: each bound ``x`` becomes the
    number of kept tokens before it, which keeps every kept valid token within the span and an exact span exact."""
    bounds = spans[:, :2]
    if inside:
        bounds = bounds.clamp(lo, hi) - lo
    else:
        bounds = torch.where(bounds <= lo, bounds, torch.where(bounds <= hi, lo, bounds - (hi - lo)))
    return torch.cat([bounds, spans[:, 2:]], 1)


def decode_attention(
    query: torch.Tensor,
    key_segments: list[Segment],
    value_segments: list[Segment],
    scale: float,
    valid: torch.Tensor | ValidTokens | None = None,
    key_rope: RotaryPositions | None = None,
    backend: str = "torch",
    num_splits: int | None = None,
    step: DecodeStep | None = None,
) -> torch.Tensor:
    """:func:`decode_attention_reference` (``backend="torch"``) or the Triton kernels (``"triton"``).
    ``valid`` covers exactly the cached tokens (``[B, L]``, or the step's :class:`ValidTokens`); ``step``: the
    forward's :class:`~kvcomp.kernels.decode_plan.DecodeStep` (the kernels' plan and workspace)."""
    if isinstance(valid, torch.Tensor):
        valid = ValidTokens(valid)
    if backend == "triton":
        from kvcomp.kernels.decode_attention_triton import decode_attention_triton

        return decode_attention_triton(query, key_segments, value_segments, scale, valid, key_rope=key_rope,
                                       num_splits=num_splits, step=step)
    return decode_attention_reference(query, key_segments, value_segments, scale, None if valid is None else valid.mask, key_rope)
