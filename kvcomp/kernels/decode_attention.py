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
(:attr:`~kvcomp.kernels.valid_tokens.ValidTokens.spans`: left padding, ragged batches, a sliding window) and read the step's attention mask per
token only where that span holds a masked token (any pattern).
"""

from __future__ import annotations

import torch

from kvcomp.kernels.decode_plan import DecodePlans
from kvcomp.kernels.formats import PayloadReader, RotaryPositions, Segment
from kvcomp.kernels.valid_tokens import ValidTokens


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


def decode_attention(
    query: torch.Tensor,
    key_segments: list[Segment],
    value_segments: list[Segment],
    scale: float,
    valid: torch.Tensor | ValidTokens | None = None,
    key_rope: RotaryPositions | None = None,
    backend: str = "torch",
    num_splits: int | None = None,
    step: DecodePlans | None = None,
) -> torch.Tensor:
    """:func:`decode_attention_reference` (``backend="torch"``) or the Triton kernels (``"triton"``).
    ``valid`` covers exactly the cached tokens (``[B, L]``, or the step's :class:`ValidTokens`); ``step``: the
    forward's :class:`~kvcomp.kernels.decode_plan.DecodePlans` (the kernels' plan and workspace)."""
    if isinstance(valid, torch.Tensor):
        valid = ValidTokens(valid)
    if backend == "triton":
        from kvcomp.kernels.decode_attention_triton import decode_attention_triton

        return decode_attention_triton(query, key_segments, value_segments, scale, valid, key_rope=key_rope,
                                       num_splits=num_splits, step=step)
    return decode_attention_reference(query, key_segments, value_segments, scale, None if valid is None else valid.mask, key_rope)
